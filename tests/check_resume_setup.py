"""The run that the tests of resuming from a `CheckCallback`'s files stop and resume (one process:
tests/callbacks/test_check_resume.py; two DDP processes: tests/distributed/check_resume_targets.py): a fit by
updates, validated every few updates, over a shuffling DataLoader, with dropout, BatchNorm, and draws from
Python's and NumPy's generators in the loss (training and validation both call it).

Test modules import this from tests/ (pytest puts it on `sys.path`, as for state_compare)."""

from __future__ import annotations

import random
import shutil

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, CheckCallback, Optimizer, Trainer

__all__ = ["BATCH", "EVERY", "N", "UPDATES", "KeepFile", "build", "fit", "run_state"]

N, BATCH = 96, 8  # 12 batches (updates) an epoch in one process
UPDATES, EVERY = 30, 5  # validation points at 5, 10 (epoch 1), 15, 20 (epoch 2), 25, 30 (epoch 3)


def noisy_loss(preds, targets):
    """Cross-entropy scaled by draws from NumPy's and Python's global generators."""
    return F.cross_entropy(preds, targets) * (1.0 + 0.05 * float(np.random.rand()) - 0.05 * random.random())


def loaders(batch_size=BATCH):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N + 24, 6, generator=g)
    y = (x[:, 0] + 0.3 * torch.randn(N + 24, generator=g) > 0).long()
    return (DataLoader(TensorDataset(x[:N], y[:N]), batch_size=batch_size, shuffle=True),
            DataLoader(TensorDataset(x[N:], y[N:]), batch_size=6))


class KeepFile(Callback):
    """Copies the monitor's file as it stands once update `at` is committed (the files written at the
    validation points before it), to `copy` (on the process that writes files)."""

    def __init__(self, check, at, copy):
        self.check, self.at, self.copy = check, at, copy

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if trainer.loop.run.updates == self.at and not self.copy.exists() and trainer.dist.is_main:
            self.copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.check.path(trainer), self.copy)


def build(folder, save_best, *extra, resume=False, clock=True, seed=0, on_stage="val", patience=0, lr=0.01,
          **kwargs):
    """A trainer of the run, its monitor of the `on_stage` loss writing to `folder`; `extra`: functions of
    the monitor making more callbacks; `clock`: by updates, else 4 epochs."""
    torch.manual_seed(0)
    np.random.seed(seed)
    random.seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    check = CheckCallback("loss", on_stage=on_stage, save_best=save_best, ckpt_dir=folder,
                          patience=patience)
    limit = {"max_updates": UPDATES} if clock else {"epochs": 4}
    return Trainer(model, noisy_loss, Optimizer(opt, torch.optim.lr_scheduler.StepLR(opt, 2, 0.8)),
                   callbacks=[check, *(make(check) for make in extra)], running_id="run", resume=resume,
                   **{"log_batch": False, "show_info": False, **kwargs}, **limit)


def fit(trainer, clock=True, batch_size=BATCH, every=EVERY):
    """Fit the run (validation every `every` updates, or every second epoch) and close the trainer."""
    train, val = loaders(batch_size)
    with trainer:
        if clock:
            return trainer.fit(train, val, val_every_n_updates=every)
        return trainer.fit(train, val, val_freq=2)


def run_state(trainer):
    """Every tensor of the run: the model's (BatchNorm statistics included), the optimizer's, the scheduler's."""
    opts = trainer.opt.state_dict()
    return {"model": trainer.raw_model.state_dict(), "opt": opts["optimizers"], "sched": opts["schedulers"]}
