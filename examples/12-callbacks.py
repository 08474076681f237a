"""Custom callbacks: one method per loop event (names and arguments as in deepepochs 0.6).

- `InitWeights` initialises the model in `on_before_fit` (under DDP parameters are broadcast afterwards).
- `BatchLossRecorder` reads each batch's loss in `on_after_train_batch` (reading a value is a host sync).
- `StopAtAccuracy` asks the trainer to stop after the epoch whose validation accuracy reaches a target.
- `Tracer` prints the hooks of the first training batch: `before` hooks run in registration order,
  `after` hooks in reverse, so a callback wraps the ones registered after it.

Run: `python examples/12-callbacks.py` (or `--small` for a few seconds' run).
"""

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, Trainer, set_seed
from deepepochs.metrics import accuracy


class InitWeights(Callback):
    def on_before_fit(self, trainer, epochs):
        for module in trainer.raw_model.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        print(f"[init] weights initialised before a fit toward {epochs} epochs")


class BatchLossRecorder(Callback):
    def __init__(self):
        self.losses = []

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        self.losses.append(metrics["loss"])


class StopAtAccuracy(Callback):
    def __init__(self, target):
        self.target = target

    def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx):
        if val_metrics.get("accuracy", 0.0) >= self.target:
            trainer.request_stop(f"val accuracy {val_metrics['accuracy']:.3f} >= {self.target}", "StopAtAccuracy")


class Tracer(Callback):
    """Prints the hooks it receives during the first training batch, tagged with its name."""

    def __init__(self, name):
        self.name, self.active = name, False

    def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
        self.active = batch_idx == 0 and trainer.loop.epoch == 1  # hook indices are 0-based
        self.say("on_before_train_batch")

    def on_before_backward(self, trainer, loss):
        self.say("on_before_backward")

    def on_after_backward(self, trainer, loss):
        self.say("on_after_backward")

    def on_after_optimize(self, trainer, optimize_index):
        self.say("on_after_optimize")

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        self.say("on_after_train_batch")
        self.active = False

    def say(self, hook):
        if self.active:
            print(f"  {self.name}.{hook}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="fewer samples and epochs")
    args = parser.parse_args()
    n, epochs = (256, 2) if args.small else (2048, 30)
    set_seed(0)
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 8, generator=g) + (y[:, None] * 2 - 1) * 0.4
    train_dl = DataLoader(TensorDataset(x[: n * 3 // 4], y[: n * 3 // 4]), batch_size=32, shuffle=True)
    val_dl = DataLoader(TensorDataset(x[n * 3 // 4:], y[n * 3 // 4:]), batch_size=64)
    recorder = BatchLossRecorder()
    callbacks = [InitWeights(), recorder, StopAtAccuracy(0.8), Tracer("A"), Tracer("B")]
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.05), epochs=epochs,
                 callbacks=callbacks, metrics=[accuracy], log_batch=False) as trainer:
        records = trainer.fit(train_dl, val_dl)
    print(f"trained {len(records['train']['loss'])} of {epochs} epochs; {len(recorder.losses)} batch losses"
          f" recorded, first {recorder.losses[0]:.4f}, last {recorder.losses[-1]:.4f}")


if __name__ == "__main__":
    main()
