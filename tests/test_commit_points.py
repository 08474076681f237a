"""Commit points: after any exception or KeyboardInterrupt the trainer rolls back to its last commit point,
and a later fit() continues from there and ends bit-identical (parameters, optimizer state, scheduler step,
learning rates) to an uninterrupted run with the same seeds.

The commit points are (1) an applied optimizer update together with its step-wise scheduler step, and
(2) an epoch's end, after its on_after_epoch hooks, epoch-wise scheduler steps and saves. Anything between
two commit points (metrics, hooks, validation) is redone by the next fit. An update is a critical section:
a SIGINT arriving inside optimizer.step() is held until the update and its scheduler step are complete.

Every reference is an uninterrupted run of the same configuration in the same test (shuffle-free data).
"""

from __future__ import annotations

import collections
import os
import random
import signal
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.lr_scheduler import StepLR

from deepepochs import Callback, Optimizer, Trainer

QUIET = dict(device="cpu", log_batch=False, show_info=False)
EPOCHS = 3


class Boom(Exception):
    pass


def batches(n, size, seed, width=6, regression=False):
    """A shuffle-free list of (x, y) batches: classes, or with `regression` a float target."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g)
    y = x[:, :1] - x[:, 1:2] if regression else (x[:, 0] - x[:, 1] > 0).long()
    return [(x[i:i + size], y[i:i + size]) for i in range(0, n, size)]


TRAIN, VAL = batches(40, 4, 0), batches(12, 4, 1)  # 10 training batches, 3 validation batches


def make_trainer(callbacks=(), *, epochs=EPOCHS, k=1, epoch_scheduler=False, fuse_steps=True):
    """A small classifier, SGD with momentum and a step-wise (or epoch-wise, halving) StepLR, seeded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if epoch_scheduler:
        opt = Optimizer(sgd, StepLR(sgd, 1, gamma=0.5), sched_on="epoch")
    else:
        opt = Optimizer(sgd, StepLR(sgd, 4, gamma=0.8), sched_on="step")
    return Trainer(model, F.cross_entropy, opt, epochs=epochs, gradient_accumulation_steps=k,
                   fuse_steps=fuse_steps, callbacks=list(callbacks), **QUIET)


def snapshot(trainer):
    """What a commit point fixes: parameters, optimizer state, scheduler step, learning rates, epochs."""
    snap = {"params": [p.detach().clone() for p in trainer.raw_model.parameters()],
            "completed_epochs": trainer.loop.completed_epochs}
    for i, item in enumerate(trainer.opt):
        params = [p for group in item.opt.param_groups for p in group["params"]]
        snap[f"opt{i}.state"] = [{key: value.clone() if torch.is_tensor(value) else value
                                  for key, value in item.opt.state[p].items()} for p in params]
        snap[f"opt{i}.lr"] = [group["lr"] for group in item.opt.param_groups]
        snap[f"opt{i}.last_epoch"] = None if item.scheduler is None else item.scheduler.last_epoch
    return snap


def differences(a, b, path="run"):
    """Where two snapshots differ; tensors must be torch.equal (bit for bit)."""
    if torch.is_tensor(a):
        same = torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return [f"{path}: keys {sorted(a)} != {sorted(b)}"]
        return [d for key in a for d in differences(a[key], b[key], f"{path}.{key}")]
    if isinstance(a, list):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def assert_same_run(trainer, reference):
    diffs = differences(snapshot(trainer), snapshot(reference))
    assert not diffs, f"{len(diffs)} differences from the uninterrupted run, first: {diffs[:4]}"


def accuracy(preds, targets):
    return (preds.argmax(1) == targets).float().mean()


class EpochClock(Callback):
    """Remembers the running epoch (1-based)."""

    epoch = 0

    def on_before_epoch(self, trainer, train_tasks, val_tasks, epoch_idx):
        self.epoch = epoch_idx + 1  # the hook's epoch_idx is 0-based


class BatchCounter(EpochClock):
    """Counts the training batches each epoch ran, over all fits."""

    def __init__(self):
        self.trained = collections.Counter()

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        self.trained[self.epoch] += 1


# ---- 1. a metric that fails at the end of a training task ----

def fit_with_a_metric_failing_in_epoch_2():
    """A trainer whose first fit died in its 'acc' training metric at the end of epoch 2's training."""
    clock = EpochClock()

    def acc(preds, targets):
        if clock.epoch == 2:
            raise Boom("metric failed")
        return accuracy(preds, targets)

    trainer = make_trainer([clock])
    with pytest.raises(Boom, match="metric failed"):
        trainer.fit(TRAIN, VAL, train_metrics=[acc])
    assert trainer.machine.state == "idle"
    return trainer


def test_a_refit_without_the_metric_that_failed_completes_like_an_uninterrupted_run():
    """The 'acc' metric raised at epoch 2's training end: a refit without it does not re-raise the error
    and ends with the weights of an uninterrupted run (metrics do not touch weights)."""
    trainer = fit_with_a_metric_failing_in_epoch_2()
    trainer.fit(TRAIN, VAL)
    reference = make_trainer([EpochClock()])
    reference.fit(TRAIN, VAL)
    assert_same_run(trainer, reference)


def test_a_refit_with_a_working_metric_of_the_same_name_uses_it():
    """The failing 'acc' is replaced by a working 'acc' in the refit: no re-raise, the replacement's value
    is reported for the last epoch, and weights equal an uninterrupted run that used the working metric."""
    trainer = fit_with_a_metric_failing_in_epoch_2()

    def acc(preds, targets):
        return accuracy(preds, targets)

    records = trainer.fit(TRAIN, VAL, train_metrics=[acc])
    reference = make_trainer([EpochClock()])
    ref_records = reference.fit(TRAIN, VAL, train_metrics=[acc])
    assert_same_run(trainer, reference)
    assert records["train"]["acc"][-1] == ref_records["train"]["acc"][-1]


# ---- 2. a hook that fails before an epoch's training ----

class FailBeforeEpoch(BatchCounter):
    """Counts training batches per epoch and raises once in `hook` at epoch 2."""

    def __init__(self, hook):
        super().__init__()
        self.hook, self.armed = hook, True

    def fail_if_due(self, hook, epoch):
        if self.armed and hook == self.hook and epoch == 2:  # 1-based
            self.armed = False
            raise Boom(f"injected in {hook}")

    def on_before_epoch(self, trainer, train_tasks, val_tasks, epoch_idx):
        super().on_before_epoch(trainer, train_tasks, val_tasks, epoch_idx)
        self.fail_if_due("on_before_epoch", epoch_idx + 1)

    def on_before_train_epochs(self, trainer, tasks, epoch_idx):
        self.fail_if_due("on_before_train_epochs", epoch_idx + 1)

    def on_before_train_epoch(self, trainer, task):
        self.fail_if_due("on_before_train_epoch", self.epoch)


@pytest.mark.parametrize("hook", ["on_before_epoch", "on_before_train_epochs", "on_before_train_epoch"])
def test_a_refit_after_a_failure_before_an_epochs_training_trains_all_its_batches(hook):
    """A hook raises before epoch 2 trained a batch (after epoch 1's 3-batch validation): the refit trains
    all 10 of epoch 2's batches, not the validation's batch count, and ends as the uninterrupted run."""
    counter = FailBeforeEpoch(hook)
    trainer = make_trainer([counter])
    with pytest.raises(Boom, match=f"injected in {hook}"):
        trainer.fit(TRAIN, VAL)
    assert trainer.loop.completed_epochs == 1
    trainer.fit(TRAIN, VAL)
    assert dict(counter.trained) == {1: 10, 2: 10, 3: 10}, "training batches run per epoch"
    reference = make_trainer([BatchCounter()])
    reference.fit(TRAIN, VAL)
    assert_same_run(trainer, reference)


# ---- 3. a hook that fails at an epoch's end ----

class FailAfterEpoch(Callback):
    """Raises `exc` once in on_after_epoch at epoch 2."""

    def __init__(self, exc):
        self.exc, self.armed = exc, True

    def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx):
        if self.armed and epoch_idx == 1:  # 0-based: epoch 2
            self.armed = False
            raise self.exc


@pytest.mark.parametrize("exc_type", [Boom, KeyboardInterrupt])
def test_a_failure_in_on_after_epoch_does_not_lose_the_epochs_scheduler_step(exc_type):
    """on_after_epoch raises at epoch 2, before the epoch's end is committed: the refit finishes epoch 2
    (its epoch-wise StepLR step included) and 3-4, so last_epoch is 4 and lr, weights and the per-epoch
    history equal an uninterrupted run's."""
    trainer = make_trainer([FailAfterEpoch(exc_type("injected in on_after_epoch"))], epochs=4,
                           epoch_scheduler=True)
    with pytest.raises(exc_type, match="injected in on_after_epoch"):
        trainer.fit(TRAIN, VAL)
    trainer.fit(TRAIN, VAL)
    reference = make_trainer(epochs=4, epoch_scheduler=True)
    reference.fit(TRAIN, VAL)
    assert trainer.opt[0].scheduler.last_epoch == 4
    assert_same_run(trainer, reference)
    for stage in ("train", "val"):
        assert trainer.history[stage]["loss"] == pytest.approx(reference.history[stage]["loss"], rel=1e-6)


# ---- 4. a rollback hook that fails ----

class FailingRollback(Callback):
    """Raises after the `at`-th backward (None: never), then in the first on_rollback that follows."""

    def __init__(self, at):
        self.at, self.backwards, self.rollback_armed = at, 0, at is not None

    def on_after_backward(self, trainer, loss):
        self.backwards += 1
        if self.backwards == self.at:
            raise Boom("injected after backward")

    def on_rollback(self, trainer, exception, state):
        if self.rollback_armed:
            self.rollback_armed = False
            raise Boom("injected in on_rollback")


@pytest.mark.parametrize("k", [1, 3])
def test_a_failing_on_rollback_still_leaves_a_trainer_that_refits_like_an_uninterrupted_run(k):
    """An error after the backward of epoch 2's batch 5 (mid-window when k=3), then an error in on_rollback:
    the trainer is idle, and the next fit neither raises InvalidTransition nor ends anywhere but where an
    uninterrupted run does."""
    trainer = make_trainer([FailingRollback(at=len(TRAIN) + 5)], k=k)
    with pytest.raises(Exception, match="injected"):
        trainer.fit(TRAIN, VAL)
    assert trainer.machine.state == "idle"
    assert all(p.grad is None for p in trainer.raw_model.parameters())
    trainer.fit(TRAIN, VAL)
    reference = make_trainer([FailingRollback(at=None)], k=k)
    reference.fit(TRAIN, VAL)
    assert_same_run(trainer, reference)


# ---- 5. real SIGINTs at random moments ----

WIDE_TRAIN = batches(96, 8, 2, width=256, regression=True)  # 12 batches
SIGINT_CONFIGS = [(1, True), (1, False), (3, True), (3, False)]  # (gradient_accumulation_steps, fuse_steps)
TRIALS_PER_CONFIG = 13


def wide_trainer(k, fuse_steps):
    """Six 256-wide layers and a per-parameter (foreach=False) Adam: the update is about half of a batch's
    time, and Python can deliver a signal between two parameters' updates."""
    torch.manual_seed(0)
    layers = [layer for _ in range(6) for layer in (nn.Linear(256, 256), nn.Tanh())]
    model = nn.Sequential(*layers, nn.Linear(256, 1))
    adam = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    opt = Optimizer(adam, StepLR(adam, step_size=2, gamma=0.9), sched_on="step")
    return Trainer(model, F.mse_loss, opt, epochs=2, gradient_accumulation_steps=k, fuse_steps=fuse_steps,
                   **QUIET)


class _Armed:
    """Whether a trial's fit runs: the SIGINT the timer sends raises `KeyboardInterrupt` only then. On a
    loaded machine the timer's signal can be handled by Python a few bytecodes after the fit returned and
    the timer was cleared; that late SIGINT is dropped instead of ending the test with KeyboardInterrupt."""

    fit = False

    @classmethod
    def sigint(cls, signum, frame):
        if cls.fit:
            raise KeyboardInterrupt


def fit_interrupted_at(trainer, delay, max_fits=4):
    """fit() with a real SIGINT `delay` seconds in, then fit() again while interrupted. Returns whether
    the signal interrupted a fit, and the error a fit() raised otherwise (None when one completed)."""
    interrupted = False
    with torch.enable_grad():  # a grad mode left disabled by a trial must not leak into the next one
        signal.setitimer(signal.ITIMER_REAL, delay)
        for _ in range(max_fits):
            try:
                _Armed.fit = True
                try:
                    trainer.fit(WIDE_TRAIN)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
                    _Armed.fit = False
                return interrupted, None
            except KeyboardInterrupt:
                interrupted = True
            except Exception as exc:
                return interrupted, exc
    return interrupted, f"still interrupted after {max_fits} fits"


def test_real_sigints_at_random_moments_resume_bit_identically():
    """SIGINT at a random moment of a fit (k=1 and 3, fused and not): after refitting, parameters, Adam's
    exp_avg/exp_avg_sq/step, the scheduler and the lr equal the uninterrupted run's bit for bit."""
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: os.kill(os.getpid(), signal.SIGINT))
    previous_int = signal.signal(signal.SIGINT, _Armed.sigint)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # steady timings on a loaded machine (two threads on two busy cores are not)
    interrupts, failures, trials = 0, [], 0
    try:
        for seed, (k, fuse_steps) in enumerate(SIGINT_CONFIGS):
            durations, runs = [], []
            for _ in range(2):  # the second run checks that the reference is deterministic, and is warm
                reference = wide_trainer(k, fuse_steps)
                start = time.perf_counter()
                reference.fit(WIDE_TRAIN)
                durations.append(time.perf_counter() - start)
                runs.append(snapshot(reference))
            assert not differences(runs[1], runs[0]), "two uninterrupted runs differ"
            expected, duration = runs[0], min(durations)
            rng = random.Random(seed)
            for _ in range(TRIALS_PER_CONFIG):
                delay = rng.uniform(0.001, duration)
                trainer = wide_trainer(k, fuse_steps)
                start = time.perf_counter()
                interrupted, error = fit_interrupted_at(trainer, delay)
                if not interrupted and error is None:  # the signal came after fit() returned: aim earlier
                    duration = min(duration, time.perf_counter() - start)
                trials += 1
                interrupts += interrupted
                diffs = [f"fit raised {error!r}"] if error else differences(snapshot(trainer), expected)
                if diffs:  # which parts differ: params, opt0.state, opt0.lr, opt0.last_epoch
                    parts = sorted({d.split("[")[0].split(":")[0] for d in diffs})
                    failures.append((k, fuse_steps, f"delay {delay * 1000:.1f} ms: {', '.join(parts)}"))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        signal.signal(signal.SIGINT, previous_int)
        torch.set_num_threads(threads)
    assert trials >= 50
    assert interrupts >= 0.7 * trials, f"only {interrupts} of {trials} signals interrupted a fit"
    per_config = collections.Counter(f"k={k} fuse_steps={fuse}" for k, fuse, _ in failures)
    assert not failures, (f"{len(failures)} of {trials} trials ({interrupts} interrupted) end unlike the"
                          f" uninterrupted run: {dict(per_config)}; first: {[f[2] for f in failures[:3]]}")


# ---- 6. the caller's SIGINT handler ----

class SigintAtBatch(Callback):
    """Sends this process a real SIGINT after training batch `at` of the first epoch."""

    def __init__(self, at):
        self.at = at

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if trainer.loop.completed_epochs == 0 and batch_idx + 1 == self.at:  # `at` is 1-based
            os.kill(os.getpid(), signal.SIGINT)


def raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


@pytest.mark.parametrize("handler", [signal.default_int_handler, raise_keyboard_interrupt])
def test_a_fit_interrupted_by_sigint_leaves_the_callers_sigint_handler_in_place(handler):
    """A real SIGINT interrupts the fit; afterwards signal.getsignal(SIGINT) is the caller's handler object."""
    previous = signal.signal(signal.SIGINT, handler)
    try:
        trainer = make_trainer([SigintAtBatch(3)])
        with pytest.raises(KeyboardInterrupt):
            trainer.fit(TRAIN, VAL)
        assert signal.getsignal(signal.SIGINT) is handler
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_custom_sigint_handler_is_still_installed_after_a_normal_fit():
    """A handler the caller installed before fit() is the SIGINT handler again once fit() returns."""
    previous = signal.signal(signal.SIGINT, raise_keyboard_interrupt)
    try:
        make_trainer().fit(TRAIN, VAL)
        assert signal.getsignal(signal.SIGINT) is raise_keyboard_interrupt
    finally:
        signal.signal(signal.SIGINT, previous)


# ---- an exception inside optimizer.step(): what it leaves, and how to continue exactly ------------------------
class FailingAdam(torch.optim.Adam):
    """Adam (single-tensor) that raises after updating its first parameter, on its `fail_at`-th step."""

    def __init__(self, params, fail_at):
        super().__init__(params, lr=0.05, foreach=False)
        self.calls, self.fail_at = 0, fail_at

    def step(self, closure=None):
        self.calls += 1
        if self.calls != self.fail_at:
            return super().step(closure)
        group = self.param_groups[0]
        saved = group["params"]
        group["params"] = saved[:1]  # the first parameter is updated, then the optimizer fails
        try:
            super().step(closure)
        finally:
            group["params"] = saved
        raise RuntimeError("optimizer failed part-way")


def test_an_exception_inside_step_leaves_the_first_parameters_updated_and_a_checkpoint_reload_continues_exactly(
        tmp_path):
    """The documented limit: the parameters updated before the failure keep their update (Adam's step count
    too), the others do not; fit() after loading the last checkpoint ends as the uninterrupted run."""
    from deepepochs import CheckCallback  # noqa: PLC0415

    def trainer(fail_at, folder):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
        return Trainer(model, F.cross_entropy, FailingAdam(model.parameters(), fail_at), epochs=EPOCHS,
                       callbacks=[CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=folder)],
                       running_id="run", **QUIET)

    reference = trainer(0, tmp_path / "reference")
    reference.fit(TRAIN)
    failing = trainer(14, tmp_path / "failing")  # the 4th update of epoch 2
    with pytest.raises(RuntimeError, match="optimizer failed part-way"):
        failing.fit(TRAIN)
    opt = failing.opt.items[0].opt
    steps = [int(opt.state[p]["step"]) for p in failing.raw_model.parameters()]
    assert steps == [14, 13, 13, 13]  # the first parameter's update of step 14 was applied, the rest not
    failing.load_checkpoint(tmp_path / "failing" / "run" / "train-loss.latest.ckpt")
    failing.fit(TRAIN)
    for key, value in reference.raw_model.state_dict().items():
        assert torch.equal(failing.raw_model.state_dict()[key], value), key


def test_a_fit_started_with_sigint_ignored_keeps_it_ignored_throughout():
    """A job started in the background has SIGINT ignored: fit and test leave it so (a handler of their own would
    make every process started meanwhile, which inherits an ignored signal across exec, take it again), and a
    SIGINT sent meanwhile changes nothing."""
    seen = []

    class Probe(Callback):
        def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
            seen.append(signal.getsignal(signal.SIGINT))
            if batch_idx == 1:
                os.kill(os.getpid(), signal.SIGINT)

        def on_before_test_batch(self, trainer, batch_x, batch_y, batch_idx):
            seen.append(signal.getsignal(signal.SIGINT))

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
        trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), epochs=1,
                          callbacks=[Probe()], **QUIET)
        trainer.fit(TRAIN)
        trainer.test(TRAIN)
        assert seen and all(handler == signal.SIG_IGN for handler in seen), seen
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
