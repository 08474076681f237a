"""Patches: how batch results become dataset-level metrics.

1. `metric_patch='tensor' | 'mean' | 'confusion'` on the same two-class model: the tensor and confusion
   patches give the exact whole-dataset F1 (of class 1, the default for two classes); 'mean' averages
   per-batch F1 values, which is only an approximation.
2. A custom step returning patches: `ConfusionMetrics` (several metrics from one confusion matrix),
   `ValuePatch` (a batch mean), `MeanPatch`, and a custom `PatchBase` subclass (the worst sample loss).

Run: `python examples/04-patches.py` (or `--small` for a few seconds' run).
"""

import argparse
import copy

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import ConfusionMetrics, MeanPatch, PatchBase, Trainer, ValuePatch, set_seed
from deepepochs.metrics import accuracy, f1


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    centers = torch.randn(2, 8, generator=torch.Generator().manual_seed(3))
    return TensorDataset(torch.randn(n, 8, generator=g) + 0.7 * centers[y], y)


class MaxPatch(PatchBase):
    """A custom patch: the largest per-sample value seen (here: the worst sample's loss)."""

    def load(self, values):
        self.value = values.detach().max()  # detached: no autograd graph is kept alive
        return self

    def add(self, other):
        self.value = torch.maximum(self.value, other.value)
        return self

    def forward(self):
        return self.value


class PatchTrainer(Trainer):
    """Returns patches from its own evaluation step (see 13-custom_trainer.py for step methods)."""

    cm = ConfusionMetrics(("accuracy", "precision", "recall", "f1"), average="macro")

    def evaluate_step(self, batch_x, batch_y, **step_args):
        preds = self.model(batch_x)
        loss = self.loss(preds, batch_y)  # evaluation: no backward, just the value
        per_sample = F.cross_entropy(preds, batch_y, reduction="none")
        return {
            "loss": ValuePatch(loss, batch_y.shape[0]),       # a batch mean weighted by its samples
            "cm": self.cm(preds, batch_y),                    # one matrix -> four metrics (dict keys)
            "acc_mean": MeanPatch(accuracy, preds, batch_y),  # metric per batch, sample-weighted mean
            "worst_loss": MaxPatch().load(per_sample),
        }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="fewer samples and epochs")
    args = parser.parse_args()
    n, epochs = (300, 1) if args.small else (3000, 5)
    train_dl = DataLoader(make_data(n, 1), batch_size=32, shuffle=True)
    val_set = make_data(n // 3, 2)
    val_dl = DataLoader(val_set, batch_size=16)  # small batches: per-batch F1 differs from dataset F1
    set_seed(0)
    init = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    for kind in ("tensor", "mean", "confusion"):
        set_seed(1)  # the same shuffling for each run: the three models end up identical
        model = copy.deepcopy(init)
        with Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), epochs=epochs,
                     metrics=[accuracy, f1], metric_patch=kind, log_batch=False, show_info=False) as trainer:
            trainer.fit(train_dl)
            scores = trainer.test(val_dl)
        x, y = val_set.tensors
        exact = float(f1(model(x), y))  # F1 of the whole validation set at once
        print(f"metric_patch={kind!r:12} test f1 {scores['f1']:.4f}   whole-dataset f1 {exact:.4f}")

    model = copy.deepcopy(init)
    with PatchTrainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), epochs=epochs,
                      log_batch=False, show_info=False) as trainer:
        trainer.fit(train_dl)
        scores = trainer.test(val_dl)
    print("custom step patches:", {k: round(v, 4) for k, v in scores.items()})


if __name__ == "__main__":
    main()
