"""Metrics: functions `(preds, targets) -> scalar | dict`, display names with `rename`, and the ready-made
classification metrics of `deepepochs.metrics` (micro / macro / weighted averages, or 'binary': class 1 in
scikit-learn's sense). Without `average=` they use 0.6's default: 'micro' for more than two classes (which
equals accuracy for single-label data, as `f2` below shows) and 'binary' for two.

Metrics are computed over the whole dataset, not averaged over batches (the default metric_patch='tensor'
keeps every prediction of the epoch and computes each metric once at its end).

Run: `python examples/03-metrics.py` (or `--small` for a few seconds' run).
"""

import argparse
from functools import partial

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Trainer, rename, set_seed
from deepepochs.metrics import accuracy, confusion_matrix, f1, fbeta, precision, recall


def make_data(n, seed, classes=4):
    """Overlapping Gaussian blobs: imbalanced classes (class 0 is the most frequent)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.multinomial(torch.tensor([0.4, 0.3, 0.2, 0.1]), n, replacement=True, generator=g)
    centers = torch.randn(classes, 10, generator=torch.Generator().manual_seed(5))
    return TensorDataset(torch.randn(n, 10, generator=g) + 0.9 * centers[y], y)


def top2_accuracy(preds, targets):
    """A custom metric: the target is among the two highest scores."""
    return (preds.topk(2, dim=1).indices == targets[:, None]).any(dim=1).float().mean()


def per_class_recall(preds, targets):
    """A metric may return a dict: each key becomes its own column."""
    cm = confusion_matrix(preds, targets, num_classes=4)
    recalls = cm.diag() / cm.sum(dim=1).clamp(min=1)
    return {f"recall_c{i}": r for i, r in enumerate(recalls)}


def confusion_matrix_total(preds, targets):
    """Number of samples the test saw, read from the confusion matrix (a sanity check)."""
    return confusion_matrix(preds, targets).sum().float()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="fewer samples and epochs")
    args = parser.parse_args()
    n, epochs = (400, 2) if args.small else (4000, 8)
    set_seed(0)
    train_dl = DataLoader(make_data(n, 1), batch_size=64, shuffle=True)
    val_dl = DataLoader(make_data(n // 4, 2), batch_size=64)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 4))

    metrics = [
        accuracy,                                            # shown as 'accuracy' (the function's name)
        rename(partial(f1, average="macro"), "f1_macro"),    # rename gives a display name
        rename(partial(f1, average="weighted"), "f1_weighted"),
        rename(partial(precision, average="micro"), "p_micro"),
        rename(partial(recall, average="macro"), "r_macro"),
        rename(partial(fbeta, beta=2.0), "f2"),             # default average: micro for 4 classes
        rename(top2_accuracy, "top2"),
    ]
    with Trainer(model, F.cross_entropy, torch.optim.Adam(model.parameters(), lr=1e-2), epochs=epochs,
                 metrics=metrics, log_batch=False) as trainer:
        # val_metrics apply to validation only: the dict metric adds one column per class.
        trainer.fit(train_dl, val_dl, val_metrics=[per_class_recall])
        results = trainer.test(val_dl, metrics=[rename(confusion_matrix_total, "samples")])
        print("test:", {k: round(v, 4) for k, v in results.items()})

    # The same functions work on plain tensors, e.g. a binary task (average='binary' scores class 1).
    preds = torch.tensor([0.9, 0.2, 0.6, 0.4, 0.8])  # probabilities of class 1, threshold 0.5
    targets = torch.tensor([1, 0, 0, 1, 1])
    print("binary precision / recall / f1:",
          [round(float(m(preds, targets, average="binary")), 4) for m in (precision, recall, f1)])
    print("confusion matrix (rows = true class):\n", confusion_matrix(preds, targets))


if __name__ == "__main__":
    main()
