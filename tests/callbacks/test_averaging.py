"""Weight averages (EMACallback, SWACallback): bit for bit in fp32 against a plain PyTorch loop using
torch's AveragedModel; moved by committed updates only (skipped and discarded ones leave them as they
were); an interrupted fit refitted, a snapshot resumed after SIGTERM and a learning-rate sweep end with the
average of the uninterrupted run; every checkpoint holds it, a plain torch.load reads it; evaluation with
the average on request; bad arguments name themselves."""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn, update_bn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import (
    Callback,
    CheckCallback,
    CheckpointError,
    ConfigError,
    EMACallback,
    Preempted,
    SnapshotCallback,
    SWACallback,
    Trainer,
)
from deepepochs.errors import DeepEpochsWarning

QUIET = dict(log_batch=False, show_info=False, device="cpu")
EPOCHS = 3


class Noisy(nn.Module):
    """Adds NumPy's and Python's random draws in training, so the run's every generator matters (`on`)."""

    def __init__(self, on=True):
        super().__init__()
        self.on = on

    def forward(self, x):
        if self.training and self.on:
            x = x + 1e-3 * float(np.random.rand()) - 1e-3 * random.random()
        return x


def make_model(noisy=True):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.ReLU(), Noisy(noisy),
                         nn.Linear(16, 3))


def make_data(n=64):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2))


def make_opt(model):
    return torch.optim.SGD(model.parameters(), 0.1, momentum=0.9)


def seed():
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)


def trainer_with(callbacks, model=None, noisy=True, **kw):
    model = make_model(noisy) if model is None else model
    return Trainer(model, F.cross_entropy, make_opt(model), epochs=kw.pop("epochs", EPOCHS), callbacks=callbacks,
                   **QUIET, **kw)


def fit(trainer, data=None, **kw):
    seed()
    return trainer.fit(make_data() if data is None else data, **kw)


def plain_loop(averaged_of, epochs=EPOCHS, bad=(), after_epoch=None):
    """A plain PyTorch loop: SGD steps, `averaged.update_parameters(model)` after each step; batches whose
    1-based running number is in `bad` do their forward but no step and no average."""
    model = make_model()
    opt = make_opt(model)
    averaged = averaged_of(model, opt)
    data = make_data()
    seed()
    count = 0
    for epoch in range(1, epochs + 1):
        model.train()
        for x, y in data:
            count += 1
            loss = F.cross_entropy(model(x), y)
            if count in bad:
                continue
            loss.backward()
            opt.step()
            opt.zero_grad()
            if after_epoch is None:
                averaged.update_parameters(model)
        if after_epoch is not None:
            after_epoch(epoch, model, opt, averaged)
    return model, averaged, data


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def avg_state(cb) -> dict:
    return {k: v.clone() for k, v in cb.averaged.state_dict().items()}


@pytest.mark.parametrize("kw,decay_at", [
    (dict(decay=0.9), lambda n: 0.9),
    (dict(half_life=5, buffers="copy"), lambda n: 0.5 ** (1 / 5)),
    (dict(decay=0.99, warmup=True), lambda n: min(0.99, (1 + n) / (10 + n))),
])
def test_the_ema_equals_a_plain_loop_using_averaged_model_bit_for_bit(kw, decay_at):
    """Decay, half-life and warm-up: the average and the weights equal torch's AveragedModel moved after each
    step of a plain loop with the same decays."""
    ema = EMACallback(**kw)
    trainer = trainer_with([ema])
    fit(trainer)
    use_buffers = kw.get("buffers", "average") == "average"
    steps = []

    class Decaying(AveragedModel):
        def update_parameters(self, model):
            self.multi_avg_fn = get_ema_multi_avg_fn(decay_at(len(steps)))
            steps.append(1)
            super().update_parameters(model)

    model, averaged, _ = plain_loop(lambda m, _: Decaying(m, use_buffers=use_buffers))
    assert same(avg_state(ema), averaged.state_dict())
    assert same(trainer.raw_model.state_dict(), model.state_dict())
    assert ema.updates == len(steps) == EPOCHS * 8


def test_swa_equals_a_plain_loop_with_swalr_and_update_bn_bit_for_bit():
    """From epoch 2 on the average takes each epoch's weights and SWALR steps; update_bn runs at the end."""
    swa = SWACallback(start_epoch=2, swa_lr=0.02, anneal_epochs=2, anneal_strategy="linear")
    trainer = trainer_with([swa], epochs=4)
    fit(trainer)
    holder = {}

    def averaged_of(model, opt):
        holder["lr"] = SWALR(opt, 0.02, anneal_epochs=2, anneal_strategy="linear")
        return AveragedModel(model)

    def after_epoch(epoch, model, opt, averaged):
        if epoch >= 2:  # torch's recipe: average the epoch, then step SWALR
            averaged.update_parameters(model)
            holder["lr"].step()

    model, averaged, data = plain_loop(averaged_of, epochs=4, after_epoch=after_epoch)
    update_bn(data, averaged)
    assert same(avg_state(swa), averaged.state_dict())
    assert same(trainer.raw_model.state_dict(), model.state_dict())
    assert trainer.opt[0].opt.param_groups[0]["lr"] == holder["lr"].optimizer.param_groups[0]["lr"] != 0.1
    assert swa.updates == 3


class NanLoss:
    """cross_entropy, NaN on the given 1-based calls."""

    def __init__(self, bad):
        self.bad, self.calls = set(bad), 0

    def __call__(self, out, y):
        self.calls += 1
        loss = F.cross_entropy(out, y)
        return loss * float("nan") if self.calls in self.bad else loss


def test_updates_skipped_for_a_nan_loss_leave_the_average_as_it_was():
    """nonfinite='skip': the skipped updates are not averaged; the average equals the plain loop's that
    leaves those batches out."""
    ema = EMACallback(0.8)
    model = make_model()
    trainer = Trainer(model, NanLoss({3, 12}), make_opt(model), epochs=EPOCHS, callbacks=[ema], nonfinite="skip",
                      **QUIET)
    fit(trainer)
    reference, averaged, _ = plain_loop(lambda m, _: AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.8),
                                                                use_buffers=True), bad={3, 12})
    assert same(avg_state(ema), averaged.state_dict())
    assert ema.updates == EPOCHS * 8 - 2


class Watch(Callback):
    """The average's state after each training batch, and the batches whose update was skipped."""

    def __init__(self, ema):
        self.ema, self.states, self.skipped = ema, [], set()

    def on_skip_optimize(self, trainer, opt_index):
        self.skipped.add(len(self.states))

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        self.states.append(avg_state(self.ema))


def test_fp16_updates_the_grad_scaler_skips_leave_the_average_untouched():
    """fp16: the GradScaler skips the first updates (its scale overflows) and a NaN loss's; after each skipped
    one the average is what it was, after each applied one it moved."""
    ema = EMACallback(0.9)
    watch = Watch(ema)
    model = make_model()
    trainer = Trainer(model, NanLoss({10}), make_opt(model), epochs=2, callbacks=[ema, watch], precision="fp16",
                      **QUIET)
    before = avg_state(ema)
    fit(trainer)
    assert 9 in watch.skipped and 0 < len(watch.skipped) < 16
    previous = before
    for i, state in enumerate(watch.states):
        assert same(state, previous) == (i in watch.skipped), i
        previous = state
    assert ema.updates == 16 - len(watch.skipped)


class FailAt(Callback):
    """Raises once, in training batch `batch` (0-based) of epoch `epoch`, before its forward."""

    def __init__(self, epoch, batch):
        self.epoch, self.batch, self.done = epoch, batch, False

    def on_before_train_forward(self, trainer):
        if not self.done and trainer.loop.epoch == self.epoch and trainer.loop.batch_idx == self.batch + 1:
            self.done = True
            raise RuntimeError("injected fault")


# The runs a fault or a signal interrupts draw torch's random numbers only: a refit replays torch's
# generators from the last commit point, not NumPy's or Python's (a resumed snapshot restores all of them).
@pytest.fixture(scope="module")
def uninterrupted():
    ema = EMACallback(0.9)
    trainer = trainer_with([ema], noisy=False, gradient_accumulation_steps=2)
    fit(trainer)
    return avg_state(ema), {k: v.clone() for k, v in trainer.raw_model.state_dict().items()}


@pytest.mark.parametrize("batch", [3, 4, 7])
def test_an_interrupted_fit_refitted_ends_with_the_uninterrupted_average(uninterrupted, batch):
    """A fault inside an accumulation window (batch 4 of a 2-batch window), at a window's start and in the
    epoch's last window: the discarded window never reached the average and the refit continues it."""
    ema = EMACallback(0.9)
    trainer = trainer_with([ema, FailAt(2, batch)], noisy=False, gradient_accumulation_steps=2)
    with pytest.raises(RuntimeError, match="injected fault"):
        fit(trainer)
    assert ema.updates == 4 + batch // 2
    trainer.fit(make_data())
    assert same(avg_state(ema), uninterrupted[0])
    assert same(trainer.raw_model.state_dict(), uninterrupted[1])


class InterruptDuringUpdate(Callback):
    """Sends SIGINT (Ctrl-C) once while the update of training batch `batch` (0-based) of epoch 2 runs."""

    def __init__(self, batch):
        self.batch, self.done = batch, False

    def on_before_optimize(self, trainer, optimize_index):
        if not self.done and trainer.loop.epoch == 2 and trainer.loop.batch_idx == self.batch + 1:
            self.done = True
            os.kill(os.getpid(), signal.SIGINT)


def test_a_ctrl_c_during_an_update_lets_it_commit_into_the_average_and_a_refit_ends_with_the_uninterrupted_one(
        uninterrupted):
    """Ctrl-C is held during an update: the update commits, the average takes it, then the fit stops."""
    ema = EMACallback(0.9)
    trainer = trainer_with([ema, InterruptDuringUpdate(3)], noisy=False, gradient_accumulation_steps=2)
    with pytest.raises(KeyboardInterrupt):
        fit(trainer)
    assert ema.updates == 4 + 2
    trainer.fit(make_data())
    assert same(avg_state(ema), uninterrupted[0])


def test_an_update_applied_before_a_fault_in_its_end_is_averaged_once_and_the_refit_matches(uninterrupted):
    """An optimizer post-hook raising after the update was applied: the rollback completes that update's
    commit, the average included, and the refit does not average it again."""
    ema = EMACallback(0.9)
    trainer = trainer_with([ema], noisy=False, gradient_accumulation_steps=2)
    calls = []

    def post_hook(opt, args, kwargs):
        calls.append(1)
        if len(calls) == 7:
            raise RuntimeError("injected fault after the step")

    handle = trainer.opt[0].opt.register_step_post_hook(post_hook)
    with pytest.raises(RuntimeError, match="injected fault after the step"):
        fit(trainer)
    handle.remove()
    assert ema.updates == 7
    trainer.fit(make_data())
    assert same(avg_state(ema), uninterrupted[0])
    assert same(trainer.raw_model.state_dict(), uninterrupted[1])


class SendAt(Callback):
    """Sends `sig` to this process after training batch `batch` (0-based) of epoch `epoch`."""

    def __init__(self, sig, epoch, batch):
        self.sig, self.epoch, self.batch = sig, epoch, batch

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if trainer.loop.epoch == self.epoch and batch_idx == self.batch:
            os.kill(os.getpid(), self.sig)


@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name == "nt", reason="POSIX signals")
def test_a_snapshot_resumed_after_sigterm_ends_with_the_uninterrupted_average(tmp_path, uninterrupted):
    """SIGTERM inside a window: the snapshot holds the average of the last commit point (a plain torch.load
    reads it) and a new trainer resuming from it ends with the uninterrupted run's average."""
    ema = EMACallback(0.9)
    trainer = trainer_with([SnapshotCallback(tmp_path), ema, SendAt(signal.SIGTERM, 2, 4)], running_id="run",
                           noisy=False, gradient_accumulation_steps=2)
    with pytest.raises(Preempted) as info:
        fit(trainer)
    saved = torch.load(info.value.path, weights_only=True)["averages"]["ema"]
    assert saved["updates"] == ema.updates == 4 + 2
    assert same(saved["model"], avg_state(ema))
    again = EMACallback(0.9)
    resumed = trainer_with([SnapshotCallback(tmp_path), again], running_id="run", resume=True,
                           noisy=False, gradient_accumulation_steps=2)
    torch.manual_seed(1234)  # what this process drew before must not matter
    resumed.fit(make_data())
    assert same(avg_state(again), uninterrupted[0])
    assert same(resumed.raw_model.state_dict(), uninterrupted[1])


def test_an_epoch_checkpoint_holds_the_average_and_a_resume_continues_it(tmp_path, uninterrupted):
    """A 'latest' checkpoint of epoch 2 holds that epoch's average; a resumed run ends with the uninterrupted
    average."""
    ema = EMACallback(0.9)
    trainer = trainer_with([CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=tmp_path), ema],
                           running_id="run", noisy=False, gradient_accumulation_steps=2, epochs=2)
    fit(trainer)
    file = tmp_path / "run" / "train-loss.latest.ckpt"
    assert same(torch.load(file, weights_only=True)["averages"]["ema"]["model"], avg_state(ema))
    again = EMACallback(0.9)
    resumed = trainer_with([CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=tmp_path), again],
                           running_id="run", resume=True, noisy=False, gradient_accumulation_steps=2)
    resumed.fit(make_data())
    assert same(avg_state(again), uninterrupted[0])


def test_an_swa_run_resumed_from_an_epoch_checkpoint_ends_as_the_uninterrupted_one(tmp_path):
    """SWA from epoch 2 with SWALR: a run stopped after epoch 3 and resumed to epoch 5 ends with the
    uninterrupted run's average, BatchNorm statistics, weights and learning rate (the schedule's position
    comes from the file)."""
    def run(folder, epochs, resume=False):
        swa = SWACallback(start_epoch=2, swa_lr=0.02, anneal_epochs=3)
        trainer = trainer_with([CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=folder), swa],
                               running_id="run", noisy=False, epochs=epochs, resume=resume)
        fit(trainer)
        return swa, trainer

    whole, whole_trainer = run(tmp_path / "whole", 5)
    run(tmp_path / "parts", 3)
    resumed, trainer = run(tmp_path / "parts", 5, resume=True)
    assert resumed.updates == whole.updates == 4
    assert same(avg_state(resumed), avg_state(whole))
    assert same(trainer.raw_model.state_dict(), whole_trainer.raw_model.state_dict())
    assert trainer.opt[0].opt.param_groups[0]["lr"] == whole_trainer.opt[0].opt.param_groups[0]["lr"]


def test_a_checkpoint_whose_average_has_the_wrong_shape_is_refused_naming_it(tmp_path):
    """The field checks cover the averages: nothing is loaded from a file whose average does not fit."""
    ema = EMACallback(0.9)
    trainer = trainer_with([CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=tmp_path), ema],
                           running_id="run", epochs=1)
    fit(trainer)
    file = tmp_path / "run" / "train-loss.latest.ckpt"
    data = torch.load(file, weights_only=True)
    data["averages"]["ema"]["model"]["module.0.weight"] = torch.zeros(2, 2)
    torch.save(data, file)
    other = EMACallback(0.9)
    fresh = trainer_with([other], epochs=1)
    before = avg_state(other)
    with pytest.raises(CheckpointError, match=r"averages\['ema'\]\['model'\]\['module.0.weight'\]"):
        fresh.load_checkpoint(file)
    assert same(avg_state(other), before)


def test_a_learning_rate_sweep_leaves_the_average_as_it_was():
    """find_lr trains with the trainer's loop; the average it moved is put back with the run state."""
    ema = EMACallback(0.9)
    trainer = trainer_with([ema])
    fit(trainer, epochs=1)
    before = avg_state(ema)
    trainer.find_lr(make_data(), num_steps=5, plot=False)
    assert same(avg_state(ema), before) and ema.updates == 8


def evaluate(model, data):
    model.eval()
    with torch.no_grad():
        return sum(F.cross_entropy(model(x), y, reduction="sum").item() for x, y in data) / len(data.dataset)


def test_validation_and_test_evaluate_the_average_and_give_the_training_weights_back():
    """evaluate=True: the validation and test losses are the averaged module's; training is unchanged."""
    val = DataLoader(make_data().dataset, batch_size=16)
    plain = trainer_with([EMACallback(0.9)])
    fit(plain, val_dl=val)
    ema = EMACallback(0.9, evaluate=True)
    trainer = trainer_with([ema])
    records = fit(trainer, val_dl=val)
    assert same(trainer.raw_model.state_dict(), plain.raw_model.state_dict())
    assert records["val"]["loss"][-1] == pytest.approx(evaluate(ema.averaged.module, val), rel=1e-6)
    assert trainer.test(val)["loss"] == pytest.approx(evaluate(ema.averaged.module, val), rel=1e-6)
    assert same(trainer.raw_model.state_dict(), plain.raw_model.state_dict())


def test_test_with_a_best_checkpoint_evaluates_the_files_average_and_gives_both_back(tmp_path):
    """EMACallback(evaluate=True) listed after a CheckCallback: test() evaluates the average saved in the best
    file (read back with torch.load); the model's weights and the average are the fit's afterwards."""
    val = DataLoader(make_data().dataset, batch_size=16)
    ema = EMACallback(0.9, evaluate=True)
    checker = CheckCallback("loss", mode="max", ckpt_dir=tmp_path)  # 'max': the first epoch stays the best
    trainer = trainer_with([checker, ema], running_id="run")
    fit(trainer, val_dl=val)
    own, average = {k: v.clone() for k, v in trainer.raw_model.state_dict().items()}, avg_state(ema)
    saved = torch.load(tmp_path / "run" / "val-loss.best.ckpt", weights_only=True)
    assert saved["epoch"] == 1 and not same(saved["averages"]["ema"]["model"], average)
    reference = AveragedModel(make_model(), use_buffers=True)
    reference.load_state_dict(saved["averages"]["ema"]["model"])
    with pytest.warns(Warning):  # test() says once that it gives the pre-test weights back
        metrics = trainer.test(val)
    assert metrics["loss"] == pytest.approx(evaluate(reference.module, val), rel=1e-6)
    assert same(trainer.raw_model.state_dict(), own) and same(avg_state(ema), average)


def test_predict_inside_applied_uses_the_average_and_the_model_gets_its_weights_back():
    """`with ema.applied(trainer)`: predict() returns the averaged module's outputs; afterwards the model's
    weights are its own."""
    ema = EMACallback(0.9)
    trainer = trainer_with([ema])
    fit(trainer)
    own = {k: v.clone() for k, v in trainer.raw_model.state_dict().items()}
    data = DataLoader(make_data().dataset, batch_size=16)
    with ema.applied(trainer):
        preds = trainer.predict(data)
    ema.averaged.module.eval()
    with torch.no_grad():
        expected = torch.cat([ema.averaged.module(x) for x, _ in data])
    assert torch.equal(preds, expected)
    assert same(trainer.raw_model.state_dict(), own)
    with pytest.raises(ConfigError, match=r"EMACallback.applied\(\) needs an average.*got 0 updates"):
        with EMACallback().applied(trainer_with([EMACallback()])):
            pass


@pytest.mark.parametrize("make,message", [
    (lambda: EMACallback(1.0), r"EMACallback decay must be a number in \(0, 1\), e.g. 0.999 \(got 1.0\)"),
    (lambda: EMACallback(0), r"EMACallback decay must be a number in \(0, 1\)"),
    (lambda: EMACallback(0.9, half_life=10), r"EMACallback takes decay or half_life, not both"),
    (lambda: EMACallback(half_life=-1), r"EMACallback half_life must be a number in \(0, inf\)"),
    (lambda: EMACallback(buffers="mean"), r"EMACallback buffers must be one of"),
    (lambda: SWACallback(0), r"SWACallback start_epoch must be an int >= 1"),
    (lambda: SWACallback(2, swa_lr=-0.1), r"SWACallback swa_lr must be a number"),
    (lambda: SWACallback(start_update=0), r"SWACallback start_update must be an int >= 1, the first committed"),
    (lambda: SWACallback(2, start_update=5), r"SWACallback takes start_epoch or start_update, exactly one \(got"
                                             r" start_epoch=2, start_update=5\)"),
    (lambda: SWACallback(), r"SWACallback takes start_epoch or start_update, exactly one"),
])
def test_bad_arguments_are_refused_naming_the_argument_and_the_value(make, message):
    """Each bad argument names itself, what it accepts and what it got."""
    with pytest.raises(ConfigError, match=message):
        make()


def test_an_swa_start_after_the_fits_last_epoch_is_refused():
    """Nothing would be averaged: the fit refuses before training."""
    trainer = trainer_with([SWACallback(start_epoch=5)])
    with pytest.raises(ConfigError, match=r"SWACallback start_epoch must be at most the fit's epochs \(3\).*got 5"):
        fit(trainer)
    assert trainer.loop.completed_epochs == 0


def test_an_swa_start_after_the_fits_update_budget_is_refused():
    """Under the update clock a start_update past max_updates is refused before training."""
    trainer = trainer_with([SWACallback(start_update=21)], epochs=None, max_updates=20)
    with pytest.raises(ConfigError, match=r"SWACallback start_update must be at most the fit's max_updates \(20\)"
                                          r", or nothing is averaged \(got 21\)"):
        fit(trainer)
    assert trainer.loop.run.updates == 0


def test_a_fit_by_epochs_that_ends_before_the_swa_start_update_warns_that_nothing_was_averaged():
    """By epochs the fit's update count is not known before training: the end of a fit that never reached
    start_update says so, and the average stays unusable (applied() refuses)."""
    swa = SWACallback(start_update=1000)
    trainer = trainer_with([swa])
    with pytest.warns(DeepEpochsWarning, match=r"SWACallback averaged nothing: the fit ended at epoch 3, update"
                                               r" \d+, before start_update=1000"):
        fit(trainer)
    assert swa.updates == 0 and trainer.loop.run.updates > 0
    with pytest.raises(ConfigError, match=r"SWACallback.applied\(\) needs an average"):
        with swa.applied(trainer):
            pass


def test_swa_from_an_update_equals_a_plain_loop_with_swalr_bit_for_bit():
    """start_update=5 under max_updates=20: updates 5 to 20 averaged, SWALR stepping after each, as
    AveragedModel and SWALR after each step of a plain loop from its 5th on."""
    swa = SWACallback(start_update=5, swa_lr=0.02, anneal_epochs=4, bn_update=False)
    trainer = trainer_with([swa], epochs=None, max_updates=20)
    fit(trainer)
    holder = {}

    class Late(AveragedModel):
        def update_parameters(self, model):
            holder["n"] = holder.get("n", 0) + 1
            if 5 <= holder["n"] <= 20:
                super().update_parameters(model)
                holder.setdefault("swalr", SWALR(holder["opt"], 0.02, anneal_epochs=4)).step()

    def averaged_of(model, opt):
        holder["opt"] = opt
        return Late(model)

    with pytest.warns(UserWarning, match="lr_scheduler.step"):  # SWALR made after the optimizer's steps
        _, averaged, _ = plain_loop(averaged_of)
    assert swa.updates == 16 and trainer.loop.run.updates == 20
    assert same(avg_state(swa), averaged.state_dict())


def test_a_model_without_parameters_is_refused():
    """A model with nothing to average is refused when the callback is attached."""
    model = make_model()
    trainer = Trainer(model, F.cross_entropy, make_opt(model), **QUIET)
    trainer.raw_model = nn.Identity()  # a Trainer refuses an optimizer without parameters before this
    with pytest.raises(ConfigError, match=r"EMACallback needs a model with parameters to average \(got a"
                                          r" Identity without any\)"):
        trainer.add_callbacks([EMACallback()])
