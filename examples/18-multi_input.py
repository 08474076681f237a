"""Models with several inputs: a batch `(x1, x2, y)` calls `model(x1, x2)`; the last item is the label.

Here a sequence input (a small 1-D convolution) and a tabular input are combined to predict a class;
labels can also be nested, e.g. `(x1, x2, (y_class, y_value))`, which the loss function receives as is.

Run: `python examples/18-multi_input.py` (or `--small` for a few seconds' run).
"""

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Trainer, rename, set_seed
from deepepochs.metrics import accuracy


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        # Pooling keeps coarse positions (32 steps -> 8): where the peak is matters here.
        self.seq = nn.Sequential(nn.Conv1d(1, 4, 5, padding=2), nn.ReLU(), nn.MaxPool1d(4), nn.Flatten())
        self.tab = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.cls = nn.Linear(32 + 8, 3)
        self.value = nn.Linear(32 + 8, 1)

    def forward(self, signal, table):
        h = torch.cat([self.seq(signal), self.tab(table)], dim=1)
        return self.cls(h), self.value(h).squeeze(1)


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    signal = torch.randn(n, 1, 32, generator=g)
    peak = torch.randint(0, 3, (n,), generator=g)
    signal[torch.arange(n), 0, 5 + 10 * peak] += 4.0  # where the peak is decides the class
    table = torch.randn(n, 4, generator=g)
    value = table[:, 0] * 2 + peak.float()
    return TensorDataset(signal, table, peak, value)


def collate(items):
    """(signal, table, (class, value)): two inputs and a nested label."""
    signal, table, peak, value = (torch.stack(t) for t in zip(*items))
    return signal, table, (peak, value)


def loss_fn(outputs, labels):
    (logits, value), (peak, target) = outputs, labels
    return F.cross_entropy(logits, peak) + 0.5 * F.mse_loss(value, target)


def class_accuracy(outputs, labels):
    return accuracy(outputs[0], labels[0])


def value_mae(outputs, labels):
    return (outputs[1] - labels[1]).abs().mean()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="fewer samples and epochs")
    args = parser.parse_args()
    n, epochs = (256, 2) if args.small else (3000, 8)
    set_seed(0)
    train_dl = DataLoader(make_data(n, 1), batch_size=32, shuffle=True, collate_fn=collate)
    val_dl = DataLoader(make_data(n // 4, 2), batch_size=64, collate_fn=collate)
    model = TwoInputs()
    with Trainer(model, loss_fn, torch.optim.Adam(model.parameters(), lr=1e-2), epochs=epochs,
                 metrics=[rename(class_accuracy, "acc"), rename(value_mae, "mae")], log_batch=False) as trainer:
        trainer.fit(train_dl, val_dl)
        results = trainer.test(val_dl)
    print("test:", {k: round(v, 4) for k, v in results.items()})


if __name__ == "__main__":
    main()
