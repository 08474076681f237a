"""A fault matrix generated from the spec: every state a stage enters (recorded from a clean run of that
stage, so a new state of the spec is covered as soon as a stage reaches it), in every stage (fit: training
and validation, by epochs and by updates; test; predict; the LR sweep), gets each fault kind on entering
it: an exception in user code, SIGINT, and the listed signals SIGTERM and SIGUSR1 to the process. Each
cell must end in a documented outcome, and where the run continues it ends bit-identical to the uninterrupted run:

- exception / SIGINT: rolled back and ready (the machine idle), the exception re-raised; running the
  stage again gives the uninterrupted result (fit: weights, optimizer, scheduler, scaler and history);
- SIGTERM / SIGUSR1 during fit (a `SnapshotCallback` listens): `Preempted` with 128 + the signal's number
  and a snapshot; a new trainer resumed from it ends as the uninterrupted fit;
- SIGTERM / SIGUSR1 where nothing listens (test, predict, the LR sweep, or after the fit disarmed): the
  handler in place gets it (the default one would end the process; here a recorder stands in for it) and
  the stage is unaffected.

`make test` runs a fixed seeded sample of the cells; `DEEPEPOCHS_FAULT_MATRIX=full` (`make fault-matrix`)
runs them all. The process-group faults with DataLoader workers are in tests/preemption.
"""

from __future__ import annotations

import collections
import os
import random
import signal

import pytest
import torch
from state_compare import states_equal  # tests/, on sys.path under pytest
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, Optimizer, Preempted, SnapshotCallback, Trainer
from deepepochs.fsm.machine import load_spec

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="needs POSIX signals")

SPEC = load_spec()
STAGES = ("fit", "fit_by_updates", "test", "predict", "lr_sweep")
#: The stages a SnapshotCallback listens in.
FITS = ("fit", "fit_by_updates")
MAX_UPDATES, VAL_EVERY = 5, 2  # fit_by_updates: the budget ends inside epoch 2, validation points in between
FAULTS = ("exception", "SIGINT", "SIGTERM", "SIGUSR1")
FULL = os.environ.get("DEEPEPOCHS_FAULT_MATRIX", "") == "full"
SAMPLE_SIZE, SAMPLE_SEED = 24, 20261204
EPOCHS = 2
POISONED = {(1, 3)}  # fp16: the (epoch, batch) whose gradients are made inf, so the scaler skips that update


class Injected(Exception):
    pass


class Poison(Callback):
    """inf in a gradient at the POISONED positions: the scaler skips those updates (optimize_skipped)."""

    def on_after_backward(self, trainer, loss):
        if (trainer.loop.epoch, trainer.loop.batch_idx) in POISONED:
            next(trainer.raw_model.parameters()).grad.fill_(float("inf"))


def _loaders():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 6, generator=g)
    y = (x[:, 0] - x[:, 1] > 0).long()
    train = DataLoader(TensorDataset(x[:40], y[:40]), batch_size=8, shuffle=True)  # 5 batches, k=2 windows
    val = DataLoader(TensorDataset(x[40:], y[40:]), batch_size=4)
    return train, val


def _trainer(folder, stage, resume=False, snapshot_signal=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 2))
    adam = torch.optim.Adam(model.parameters(), lr=0.01)
    opt = Optimizer(adam, torch.optim.lr_scheduler.StepLR(adam, 2, gamma=0.8), sched_on="step")
    callbacks = [Poison()]
    if snapshot_signal is not None:
        callbacks.append(SnapshotCallback(folder, on_signals=(snapshot_signal,)))
    return Trainer(model, F.cross_entropy, opt, epochs=EPOCHS, gradient_accumulation_steps=2, precision="fp16",
                   fuse_steps=False, device="cpu", log_batch=False, show_info=False, callbacks=callbacks,
                   resume=resume, running_id="run", max_updates=MAX_UPDATES if stage == "fit_by_updates" else None)


def _run(trainer, stage):
    """Run `stage` on a trainer; what it returns, comparable with `states_equal`."""
    train, val = _loaders()
    if stage == "fit":
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
            "history": trainer.history}


_REFERENCE: dict = {}


def _reference(stage, tmp_path_factory):
    """(the uninterrupted result, how often each state was entered) of `stage`, recorded once."""
    if stage not in _REFERENCE:
        trainer = _trainer(tmp_path_factory.mktemp("reference"), stage)
        entered = collections.Counter()
        trainer.machine.probe = lambda dest: entered.update([dest])
        result = _run(trainer, stage)
        trainer.machine.probe = None
        _REFERENCE[stage] = (result, entered)
    return _REFERENCE[stage]


def _entered(stage) -> collections.Counter:
    """The states a clean run of `stage` enters (a run of its own, at collection time)."""
    trainer = _trainer(None, stage)
    entered = collections.Counter()
    trainer.machine.probe = lambda dest: entered.update([dest])
    _run(trainer, stage)
    return entered


ENTERED = {stage: _entered(stage) for stage in STAGES}
CELLS = [(stage, state, fault) for stage in STAGES for state in sorted(ENTERED[stage]) for fault in FAULTS]
SELECTED = CELLS if FULL else sorted(random.Random(SAMPLE_SEED).sample(CELLS, min(SAMPLE_SIZE, len(CELLS))))


def test_every_state_of_the_spec_is_in_the_matrix_or_entered_only_by_a_fault():
    """The matrix follows the spec: a state no clean stage enters must be one only a fault leads to (the
    destination of an `interrupt` or `snapshot` edge), else the matrix would miss it."""
    covered = set().union(*ENTERED.values())
    fault_only = {t.dest for t in SPEC.transitions if t.trigger in ("interrupt", "snapshot") and t.dest}
    assert {s.name for s in SPEC.states} - covered <= fault_only - covered
    assert {s.name for s in SPEC.states} - covered - fault_only == set()


def _report(stage, state, fault, outcome) -> None:
    """Append the cell's outcome to the file DEEPEPOCHS_FAULT_MATRIX_REPORT names (the full run's counts)."""
    path = os.environ.get("DEEPEPOCHS_FAULT_MATRIX_REPORT")
    if path:
        with open(path, "a") as fh:
            fh.write(f"{stage} {state} {fault} {outcome}\n")


class _Recorder:
    """A stand-in for a signal's default handler: records the signals that reach it."""

    def __init__(self):
        self.got = []

    def __call__(self, signum, frame):
        self.got.append(signal.Signals(signum).name)


@pytest.mark.parametrize(("stage", "state", "fault"), SELECTED)
def test_a_fault_in_any_state_of_any_stage_ends_in_a_documented_outcome(stage, state, fault, tmp_path,
                                                                      tmp_path_factory):
    """Inject `fault` on entering `state` during `stage`; the outcome is a documented one, and where the run
    continues it ends as the uninterrupted run."""
    reference, entered = _reference(stage, tmp_path_factory)
    occurrence = 2 if entered[state] >= 2 else 1
    listened = fault in ("SIGTERM", "SIGUSR1") and stage in FITS
    trainer = _trainer(tmp_path / "snap", stage, snapshot_signal=fault if listened else None)
    seen = collections.Counter()

    def probe(dest):
        if dest != state:
            return
        seen[dest] += 1
        if seen[dest] != occurrence:
            return
        if fault == "exception":
            raise Injected(f"injected on entering {state}")
        signal.raise_signal(getattr(signal, fault))

    recorder = _Recorder()
    previous = {sig: signal.signal(sig, recorder) for sig in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        trainer.machine.probe = probe
        outcome = None
        try:
            result = _run(trainer, stage)
        except (Injected, KeyboardInterrupt) as exc:
            outcome = "rolled back"
            assert fault in ("exception", "SIGINT") and (fault == "exception") == isinstance(exc, Injected)
        except Preempted as stop:
            outcome = "preempted"
            assert listened and stop.code == 128 + getattr(signal, fault) and stop.path.exists()
        trainer.machine.probe = None
        if outcome is None:  # nothing stopped it: the handler in place got the signal
            assert seen[state] >= occurrence, "the fault was never injected"
            assert fault in ("SIGTERM", "SIGUSR1") and recorder.got == [fault]
            assert states_equal(result, reference)
            _report(stage, state, fault, "handler in place, unaffected")
            return
        assert trainer.machine.state == "idle"
        if outcome == "rolled back":
            assert states_equal(_run(trainer, stage), reference)
        else:
            resumed = _trainer(tmp_path / "snap", stage, resume=True, snapshot_signal=fault)
            assert states_equal(_run(resumed, stage), reference)
        _report(stage, state, fault, outcome)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
