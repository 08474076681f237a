"""Learning-rate schedules through the `deepepochs.Optimizer` wrapper.

- `sched_on='epoch'` (default): the scheduler steps after every epoch (StepLR here).
- `sched_on='step'`: it steps after every optimizer update that actually happened (OneCycleLR here).
- `sched_with_loss=True`: `scheduler.step(loss)` with the epoch's validation loss, or the training loss
  without validation (ReduceLROnPlateau here).

Run: `python examples/09-lr_schedule.py` (or `--small` for a few seconds' run).
"""

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.optim import lr_scheduler
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, Optimizer, Trainer, set_seed


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 12, generator=g)
    y = x @ torch.linspace(-1, 1, 12) + 0.3 * torch.randn(n, generator=g)
    return TensorDataset(x, y[:, None])


class LrPrinter(Callback):
    """Records the learning rate each epoch starts with, and the one used by each update.

    Epoch-wise schedulers step at the epoch's very end, after the `on_after_epoch` hooks (see the state
    graph: the `end_epoch` trigger), so the next epoch's `on_before_epoch` sees the new rate."""

    def __init__(self):
        self.per_epoch, self.updates = [], []

    def on_before_optimize(self, trainer, optimize_index):
        self.updates.append(trainer.opt[0].opt.param_groups[0]["lr"])

    def on_before_epoch(self, trainer, train_tasks, val_tasks, epoch_idx):
        self.per_epoch.append(trainer.opt[0].opt.param_groups[0]["lr"])


def run(name, make_sched, epochs, train_dl, val_dl, **wrapper_args):
    set_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    lrs = LrPrinter()
    trainer = Trainer(model, F.mse_loss, Optimizer(opt, make_sched(opt), **wrapper_args), epochs=epochs,
                      callbacks=[lrs], log_batch=False, show_info=False)
    with trainer:
        records = trainer.fit(train_dl, val_dl)
    print(f"{name}: lr of each epoch {[round(lr, 5) for lr in lrs.per_epoch]}")
    print(f"{' ' * len(name)}  final val loss {records['val']['loss'][-1]:.4f}; {len(lrs.updates)} updates,"
          f" lr during the first three {[round(lr, 5) for lr in lrs.updates[:3]]}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="fewer samples and epochs")
    args = parser.parse_args()
    n, epochs = (256, 2) if args.small else (2048, 8)
    train_dl = DataLoader(make_data(n, 1), batch_size=32, shuffle=True)
    val_dl = DataLoader(make_data(n // 4, 2), batch_size=64)
    steps = epochs * len(train_dl)

    run("StepLR, per epoch", lambda opt: lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), epochs,
        train_dl, val_dl)
    run("OneCycleLR, per update", lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=steps),
        epochs, train_dl, val_dl, sched_on="step")
    run("ReduceLROnPlateau, val loss", lambda opt: lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5),
        epochs, train_dl, val_dl, sched_with_loss=True)


if __name__ == "__main__":
    main()
