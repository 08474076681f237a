"""Resuming from a file a `CheckCallback` wrote (its best or latest file), wherever it was written: at a
validation point of the update clock, in the middle of an epoch, or at an epoch's end. A new trainer that
resumes from such a file (`resume=True` choosing it, or `load_checkpoint` on it) and trains on to the same
target ends bit-identical to the run never stopped: every model, optimizer and scheduler tensor, and the
records. The fixture draws from every random stream a resume must continue: a shuffling DataLoader, dropout,
BatchNorm, and Python's and NumPy's generators in the loss (training and validation both call it)."""

from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch
from state_compare import states_equal
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, CheckCallback, Optimizer, Trainer
from deepepochs.checkpoint import read_checkpoint

N, BATCH = 96, 8  # 12 batches (updates) an epoch
UPDATES, EVERY = 30, 5  # validation points at 5, 10 (epoch 1), 15, 20 (epoch 2), 25, 30 (epoch 3)


def noisy_loss(preds, targets):
    """Cross-entropy scaled by draws from NumPy's and Python's global generators."""
    return F.cross_entropy(preds, targets) * (1.0 + 0.05 * float(np.random.rand()) - 0.05 * random.random())


def loaders():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N + 24, 6, generator=g)
    y = (x[:, 0] + 0.3 * torch.randn(N + 24, generator=g) > 0).long()
    return (DataLoader(TensorDataset(x[:N], y[:N]), batch_size=BATCH, shuffle=True),
            DataLoader(TensorDataset(x[N:], y[N:]), batch_size=12))


class KeepFile(Callback):
    """Copies the monitor's file as it stands once update `at` is committed (the files written at the
    validation points before it), to `copy`."""

    def __init__(self, check, at, copy):
        self.check, self.at, self.copy = check, at, copy

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if trainer.loop.run.updates == self.at and not self.copy.exists():
            self.copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(self.check.path(trainer), self.copy)


def build(folder, save_best, *extra, resume=False, clock=True):
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    check = CheckCallback("loss", on_stage="val", save_best=save_best, ckpt_dir=folder)
    limit = {"max_updates": UPDATES} if clock else {"epochs": 4}
    trainer = Trainer(model, noisy_loss, Optimizer(opt, torch.optim.lr_scheduler.StepLR(opt, 2, 0.8)),
                      callbacks=[check, *(make(check) for make in extra)], running_id="run", resume=resume,
                      log_batch=False, show_info=False, **limit)
    return trainer, check


def fit(trainer, clock=True):
    train, val = loaders()
    if clock:
        records = trainer.fit(train, val, val_every_n_updates=EVERY)
    else:
        records = trainer.fit(train, val, val_freq=2)
    trainer.close()
    return records


def state(trainer):
    """Every tensor of the run: the model's (BatchNorm statistics included), the optimizer's, the scheduler's."""
    opts = trainer.opt.state_dict()
    return {"model": trainer.raw_model.state_dict(), "opt": opts["optimizers"], "sched": opts["schedulers"]}


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """The run never stopped, with the monitors' files as they stood after updates 11 (a best file of the
    validation point at update 10, inside epoch 1) and 17 (a latest file of the point at 15, inside epoch 2)."""
    folder = tmp_path_factory.mktemp("check-resume")
    kept = {}
    for save_best, at in ((True, 11), (False, 17)):
        copy = folder / f"kept-{save_best}" / "run" / "val-loss.ckpt"
        trainer, _ = build(folder / f"run-{save_best}", save_best, lambda c, at=at, copy=copy: KeepFile(c, at, copy))
        records = fit(trainer)
        kept[save_best] = (copy, records, state(trainer))
    return kept


@pytest.mark.parametrize("save_best", [True, False], ids=["best", "latest"])
@pytest.mark.parametrize("how", ["resume", "load_checkpoint"])
def test_a_resume_from_a_monitors_file_of_a_mid_epoch_validation_point_ends_as_the_run_never_stopped(
        stopped_run, tmp_path, save_best, how):
    """The file of a validation point inside an epoch records that point's position; the resumed trainer
    continues there (not at the epoch's start) and ends with the uninterrupted run's tensors and records."""
    copy, records, want = stopped_run[save_best]
    ckpt = read_checkpoint(copy)
    assert ckpt.updates == (10 if save_best else 15) and ckpt.updates % (N // BATCH)  # a point inside an epoch
    assert ckpt.position is not None and ckpt.position["batches_done"] == ckpt.updates % (N // BATCH)
    if how == "resume":
        folder = tmp_path / "ckpt"
        shutil.copytree(copy.parent.parent, folder)
        trainer, _ = build(folder, save_best, resume=True)
    else:
        trainer, _ = build(tmp_path / "ckpt", save_best)
        trainer.load_checkpoint(copy)
    got = fit(trainer)
    assert trainer.loop.run.updates == UPDATES
    assert got == records
    assert states_equal(state(trainer), want)


def test_a_resume_from_a_best_file_of_an_epochs_end_with_validation_every_second_epoch_is_exact(tmp_path):
    """On the epoch clock (validation every second epoch) the best file is of an epoch's end: resumed, the
    run trains the epochs after it and ends with the uninterrupted run's tensors and records."""
    copy = tmp_path / "kept" / "run" / "val-loss.ckpt"
    trainer, _ = build(tmp_path / "a", True, lambda c: KeepFile(c, 3 * N // BATCH, copy), clock=False)
    records, want = fit(trainer, clock=False), state(trainer)
    assert read_checkpoint(copy).epoch == 2 and read_checkpoint(copy).position is None
    resumed, _ = build(tmp_path / "kept", True, resume=True, clock=False)
    assert fit(resumed, clock=False) == records
    assert states_equal(state(resumed), want)
