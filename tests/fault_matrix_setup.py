"""The fault matrix's run, shared by the in-process cells (tests/test_fault_matrix.py) and the cells that run
in a process of their own (tests/fault_matrix_target.py: the whole process group signalled with DataLoader
workers, SIGKILL followed by a resume, 2-process DDP).

One small classifier, fp16 with a scaler (one update skipped for inf gradients), dropout, shuffling, Adam with a
step-wise StepLR and accumulation over 2 batches; each stage runs on it: fit (by epochs or by updates with
validation points; `fit_swa`: by epochs with a BatchNorm layer and an `SWACallback` averaging every update
from the second, whose BatchNorm pass at the fit's end is the spec's `fit_statistics` stage), test, predict
and the LR sweep. `stage_result` gives what a stage returns in a form `states_equal` compares (a fit:
weights, optimizer, scheduler, scaler, history and the SWA average with its BatchNorm statistics).

`DATA` is the matrix's data and step dimension, run in the fits:

- `'plain'`: the DataLoaders in the main process and the trainer's own step;
- `'persistent'`: the training and the validation DataLoader each load in a fork worker kept from epoch to
  epoch (`persistent_workers=True`), whose iterators a refit or a resume must make anew without drawing what
  the uninterrupted run never drew;
- `'stream'`: the training data is a length-less `IterableDataset` drawing its samples from its own
  `torch.Generator` (each pass draws new ones), which a refit or resume must stream again as it was;
- `'returned_loss'`: a custom step that backpropagates with `self.backward(loss)`, calls `self.optimize()`
  and returns `{'loss': ...}`;
- `'own_backward'`: a custom step running its own `loss.backward()` (fp32: fp16 refuses an unscaled backward),
  then `self.optimize()`, returning its loss.
"""

from __future__ import annotations

import collections
import multiprocessing

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from deepepochs import Callback, Optimizer, SnapshotCallback, SWACallback, Trainer, TrainerBase

__all__ = ["BN_BATCHES", "DATA", "EPOCHS", "FITS", "MAX_UPDATES", "STAGES", "STEPS", "SWA_START", "VAL_EVERY",
           "OwnBackward", "ReturnedLoss", "Stream", "entered_states", "loaders", "make_trainer", "stage_data",
           "stage_result"]

STAGES = ("fit", "fit_by_updates", "fit_swa", "test", "predict", "lr_sweep")
#: How the stages' data loads and which step trains (see the module doc); the kinds but 'plain' run in the fits.
DATA = ("plain", "persistent", "stream", "returned_loss", "own_backward")
#: The stages a SnapshotCallback listens in.
FITS = ("fit", "fit_by_updates", "fit_swa")
SWA_START, BN_BATCHES = 2, 4  # fit_swa: every update from the 2nd averaged; the pass reads 4 of the 5 batches
MAX_UPDATES, VAL_EVERY = 5, 2  # fit_by_updates: the budget ends inside epoch 2, validation points in between
EPOCHS = 2
POISONED = {(1, 3)}  # fp16: the (epoch, batch) whose gradients are made inf, so the scaler skips that update


class Poison(Callback):
    """inf in a gradient at the POISONED positions: the scaler skips those updates (optimize_skipped)."""

    def on_after_backward(self, trainer, loss):
        if (trainer.loop.epoch, trainer.loop.batch_idx) in POISONED:
            next(trainer.raw_model.parameters()).grad.fill_(float("inf"))


class Stream(IterableDataset):
    """40 samples a pass, drawn from the stream's own generator (each pass draws new ones); no length."""

    def __init__(self):
        self.generator = torch.Generator().manual_seed(5)

    def __iter__(self):
        for _ in range(40):
            x = torch.randn(6, generator=self.generator)
            yield x, (x[0] - x[1] > 0).long()


class ReturnedLoss(TrainerBase):
    """A custom step: `self.backward(loss)`, `self.optimize()`, its loss returned."""

    def train_step(self, batch_x, batch_y, **step_args):
        loss = self.loss_fn(self.model(batch_x), batch_y)
        self.backward(loss)
        self.optimize()
        return {"loss": loss.detach()}


class OwnBackward(TrainerBase):
    """A custom step: its own `loss.backward()` (divided by the accumulation steps, as a plain loop does), then
    `self.optimize()`, its loss returned."""

    def train_step(self, batch_x, batch_y, **step_args):
        loss = self.loss_fn(self.model(batch_x), batch_y)
        (loss / self.config.gradient_accumulation_steps).backward()
        self.optimize()
        return {"loss": loss.detach()}


STEPS = {"returned_loss": ReturnedLoss, "own_backward": OwnBackward}


def loaders(workers: int = 0, context: str | None = None, persistent: bool = False):
    """(train, val): 40 shuffled samples in 5 batches (k=2 windows), 8 in 2; with `workers`, both load in that
    many DataLoader worker processes started by `context`, kept from epoch to epoch with `persistent`."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 6, generator=g)
    y = (x[:, 0] - x[:, 1] > 0).long()
    options = ({"num_workers": workers, "multiprocessing_context": context, "persistent_workers": persistent}
               if workers else {})
    train = DataLoader(TensorDataset(x[:40], y[:40]), batch_size=8, shuffle=True, **options)
    val = DataLoader(TensorDataset(x[40:], y[40:]), batch_size=4, **options)
    return train, val


def make_trainer(folder, stage, resume=False, snapshot_signal=None, every_n_updates=None, data="plain", **options):
    """The matrix's trainer for `stage` and `data` (its step); with `snapshot_signal` (or `every_n_updates`) a
    SnapshotCallback in `folder` listens for that signal (and writes every that many updates)."""
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(8)] if stage == "fit_swa" else []
    model = nn.Sequential(nn.Linear(6, 8), *norm, nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 2))
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    opt = Optimizer(adam, torch.optim.lr_scheduler.StepLR(adam, 2, gamma=0.8), sched_on="step")
    fp16 = data != "own_backward"
    callbacks = [Poison()] if fp16 else []
    if stage == "fit_swa":
        callbacks.append(SWACallback(start_update=SWA_START, bn_batches=BN_BATCHES))
    if snapshot_signal is not None or every_n_updates is not None:
        signals = (snapshot_signal,) if snapshot_signal is not None else ()
        callbacks.append(SnapshotCallback(folder, on_signals=signals, every_n_updates=every_n_updates))
    return STEPS.get(data, Trainer)(model, F.cross_entropy, opt, epochs=EPOCHS, gradient_accumulation_steps=2,
                                    precision="fp16" if fp16 else "fp32", fuse_steps=False, device="cpu",
                                    log_batch=False, show_info=False, callbacks=callbacks, resume=resume,
                                    running_id="run", max_updates=MAX_UPDATES if stage == "fit_by_updates" else None,
                                    **options)


def stage_data(data: str = "plain", workers: int = 0, context: str | None = None):
    """(train, val) of `data` (see `DATA`), made anew."""
    train, val = loaders(1, "fork", persistent=True) if data == "persistent" else loaders(workers, context)
    return (DataLoader(Stream(), batch_size=8), val) if data == "stream" else (train, val)


def stage_result(trainer, stage, workers: int = 0, context: str | None = None, data: str = "plain", given=None):
    """Run `stage` on a trainer (`data`: see `DATA`) with the (train, val) `given`, else made anew; what it
    returns, comparable with `states_equal`."""
    train, val = given if given is not None else stage_data(data, workers, context)
    if stage in ("fit", "fit_swa"):
        trainer.fit(train, val)
        return _state(trainer)
    if stage == "fit_by_updates":
        trainer.fit(train, val, val_every_n_updates=VAL_EVERY)
        return _state(trainer)
    if stage == "test":
        return trainer.test(val)
    if stage == "predict":
        return trainer.predict(val)
    result = trainer.find_lr(train, num_steps=6, plot=False)
    return (result.lrs, result.losses, _state(trainer))


def _state(trainer):
    return {"model": trainer.raw_model.state_dict(), "opt": trainer.opt[0].opt.state_dict(),
            "lrs": trainer.opt.lrs(), "scale": trainer.scaler.get_scale() if trainer.scaler is not None else None,
            "history": trainer.history,
            "averages": [cb.averaged.state_dict() for cb in trainer.callbacks if isinstance(cb, SWACallback)]}


def entered_states(stage, workers: int = 0, context: str | None = None, data: str = "plain"):
    """(how often a clean run of `stage` on `data` enters each state, for each state the entries (1-based) made
    while DataLoader worker processes are alive, what the run returned: without workers, the uninterrupted
    result the cells compare with)."""
    trainer = make_trainer(None, stage, data=data)
    entered, with_workers = collections.Counter(), collections.defaultdict(list)
    before = set(multiprocessing.active_children())

    def probe(dest):
        entered[dest] += 1
        if set(multiprocessing.active_children()) - before:
            with_workers[dest].append(entered[dest])

    trainer.machine.probe = probe
    result = stage_result(trainer, stage, workers, context, data)
    trainer.machine.probe = None
    return entered, dict(with_workers), result
