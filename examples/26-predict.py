"""Predictions with `trainer.predict(dl)`: the model's outputs for every batch, concatenated in order.

Trains a small classifier on synthetic data (with a per-class recall metric, reported as `recall.0`,
`recall.1`, ...), then predicts an unlabelled set: `predict` runs the model in eval mode without gradients
and returns its outputs on the CPU. A model with a dict output keeps the dict, each tensor concatenated.
Under DDP every process calls `predict`; rank 0 gets every sample once, in dataset order.

Run: `python examples/26-predict.py` (or `--small` for a few seconds' run).
"""

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Trainer, set_seed

CLASSES = 3


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :CLASSES] + 0.3 * torch.randn(n, CLASSES, generator=g)).argmax(1)
    return x, y


def recall(preds, targets):
    """Per-class recall: one value per class, reported per class."""
    hits = torch.bincount(targets[preds.argmax(1) == targets], minlength=CLASSES).float()
    return hits / torch.bincount(targets, minlength=CLASSES).clamp(min=1).float()


class WithEmbedding(nn.Module):
    """Returns a dict: the class scores and the hidden features."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x):
        hidden = self.body(x)
        return {"logits": self.head(hidden), "embedding": hidden}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="fewer samples and epochs")
    args = parser.parse_args()
    n, epochs = (512, 2) if args.small else (8192, 10)
    set_seed(0)
    x, y = make_data(n, 1)
    xv, yv = make_data(n // 4, 2)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, CLASSES))
    with Trainer(model, F.cross_entropy, torch.optim.Adam(model.parameters(), lr=1e-2), epochs=epochs,
                 metrics=[recall], log_batch=False) as trainer:
        trainer.fit(DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True),
                    DataLoader(TensorDataset(xv, yv), batch_size=128))
        # Unlabelled data: a DataLoader of inputs only. Labelled (x, y) batches work too (y is dropped).
        xs, ys = make_data(n // 4, 3)
        logits = trainer.predict(DataLoader(TensorDataset(xs), batch_size=128))
    print("predictions:", tuple(logits.shape), "on", logits.device)
    print("accuracy of the predictions:", round((logits.argmax(1) == ys).float().mean().item(), 4))

    model = WithEmbedding()  # untrained: this part only shows the shape of a dict output
    with Trainer(model, F.cross_entropy, epochs=1, log_batch=False, show_info=False) as trainer:
        out = trainer.predict(DataLoader(TensorDataset(xs), batch_size=128))
    print("dict output kept:", {k: tuple(v.shape) for k, v in out.items()})


if __name__ == "__main__":
    main()
