"""Precision: validation, fp16 with the CPU GradScaler, bf16, non-finite losses."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, ConfigError, Optimizer, Trainer
from deepepochs.training.precision import Precision

QUIET = dict(log_batch=False, show_info=False, device="cpu")
SCALE = 256.0  # small enough that the tiny model never overflows by itself: only poisoned steps skip


def make_data(n=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def make_model(seed=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def set_scale(scaler, scale=SCALE):
    scaler.load_state_dict({"scale": scale, "growth_factor": 2.0, "backoff_factor": 0.5,
                            "growth_interval": 2000, "_growth_tracker": 0})


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def poison_grads(param, should_poison):
    """Make `param`'s gradient inf whenever `should_poison()` is true (a backward hook)."""
    param.register_hook(lambda g: torch.full_like(g, math.inf) if should_poison() else g)


# ---- validation ----
def test_unknown_precision_is_rejected_with_the_accepted_values():
    """precision='half' names the argument, the choices, the value received and a fix."""
    with pytest.raises(ConfigError, match=r"precision must be one of 'fp32', 'fp16', 'bf16' \(got 'half'\);"
                                          r" use 'fp16'"):
        Trainer(make_model(), F.mse_loss, precision="half", **QUIET)


def test_bf16_on_a_cuda_gpu_without_native_bf16_is_a_config_error(monkeypatch):
    """bf16 where the GPU has no native bfloat16 fails at construction, naming the GPU and a fix."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(ConfigError, match=r"precision='bf16' is not supported on cuda \(Tesla T4.*use"
                                          r" precision='fp16'"):
        Precision("bf16", torch.device("cuda"))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_mixed_precision_on_a_device_without_autocast_is_a_config_error(precision):
    """A (device, dtype) pair autocast cannot run is an error, not a silent fp32 run."""
    with pytest.raises(ConfigError, match=rf"precision='{precision}' .*meta.*use precision='fp32'"):
        Precision(precision, torch.device("meta"))


def test_autocast_that_torch_would_disable_is_a_config_error(monkeypatch):
    """torch warns and disables autocast for an unsupported dtype; deepepochs turns that into an error."""
    real = torch.autocast

    def autocast(device_type, dtype=None, **kw):
        return real(device_type, dtype=torch.float64)  # CPU autocast warns "not supported" and disables

    monkeypatch.setattr(torch, "autocast", autocast)
    with pytest.raises(ConfigError, match=r"precision='fp16' is not supported by autocast on cpu"):
        Precision("fp16", torch.device("cpu"))


def test_fp16_on_cpu_uses_the_cpu_grad_scaler_and_bf16_none():
    """fp16 on CPU gets torch.amp.GradScaler('cpu'); bf16 and fp32 need no scaler."""
    scaler = Trainer(make_model(), F.mse_loss, precision="fp16", **QUIET).scaler
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.is_enabled() and scaler._device == "cpu"
    assert Trainer(make_model(), F.mse_loss, precision="bf16", **QUIET).scaler is None
    assert Trainer(make_model(), F.mse_loss, **QUIET).scaler is None


# ---- fp16 on CPU: overflow skips ----
def reference_fp16(model, dl, epochs, poisoned, lr=0.05, gamma=0.9, clip=None):
    """Plain PyTorch fp16 loop with torch's GradScaler; the scheduler steps only after real steps.

    Returns the (epoch, batch) of skipped steps.
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma)
    scaler = torch.amp.GradScaler("cpu")
    set_scale(scaler)
    where = {}
    poison_grads(model[0].weight, lambda: where["now"] in poisoned)
    skipped = []
    for epoch in range(1, epochs + 1):
        for batch, (x, y) in enumerate(dl, 1):
            where["now"] = (epoch, batch)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            if clip is not None:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if scaler.get_scale() < before:  # the scaler backs off exactly when it skipped the step
                skipped.append((epoch, batch))
            else:
                sched.step()
            opt.zero_grad(set_to_none=True)
    return skipped, sched.last_epoch


class PoisonAndWatch(Callback):
    """Poisons the first layer's gradient on chosen (epoch, batch) and records what each update did."""

    def __init__(self, model, poisoned):
        self.poisoned = poisoned
        self.now = None
        self.skips, self.changed, self.scales = [], {}, {}
        poison_grads(model[0].weight, lambda: self.now in self.poisoned)

    def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
        self.now = (trainer.loop.epoch, batch_idx + 1)  # the hook's batch_idx is 0-based
        self.before = snapshot(trainer.raw_model)
        self.scale_before = trainer.scaler.get_scale()

    def on_skip_optimize(self, trainer, optimize_index):
        self.skips.append((self.now, optimize_index))

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        after = snapshot(trainer.raw_model)
        self.changed[self.now] = any(not torch.equal(a, b) for a, b in zip(self.before, after))
        self.scales[self.now] = (self.scale_before, trainer.scaler.get_scale())


@pytest.mark.parametrize("poisoned", [{(1, 1), (1, 4), (2, 6)}, {(1, 2), (1, 3), (2, 1)}])
def test_fp16_on_cpu_skips_every_poisoned_step_like_torchs_grad_scaler(poisoned):
    """Injected inf gradients: each poisoned update is skipped (weights unchanged, scale halved, step-wise
    scheduler not advanced, on_skip_optimize called, no warning), and the run equals plain PyTorch."""
    dl = make_data()
    model, ref = make_model(), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)
    watch = PoisonAndWatch(model, poisoned)
    trainer = Trainer(model, F.mse_loss, Optimizer(opt, sched, sched_on="step"), epochs=2, precision="fp16",
                      callbacks=[watch], **QUIET)
    set_scale(trainer.scaler)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would fail the test
        trainer.fit(dl)
    ref_skipped, ref_sched_steps = reference_fp16(ref, dl, 2, poisoned)

    assert sorted(now for now, _ in watch.skips) == sorted(poisoned) == sorted(ref_skipped)
    assert {i for _, i in watch.skips} == {0}
    for now, changed in watch.changed.items():
        assert changed == (now not in poisoned), now
        before, after = watch.scales[now]
        assert (after == before / 2) if now in poisoned else (after == before), now
    assert sched.last_epoch == 2 * len(dl) - len(poisoned) == ref_sched_steps
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_a_skipped_first_update_raises_no_scheduler_warning():
    """The very first update skipped: torch's scheduler counter on opt.step must not see a scheduler step
    without an optimizer step (its warning is an error here)."""
    dl = make_data()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    watch = PoisonAndWatch(model, {(1, 1), (1, 2)})
    trainer = Trainer(model, F.mse_loss, Optimizer(opt, sched, sched_on="step"), epochs=1, precision="fp16",
                      callbacks=[watch], **QUIET)
    set_scale(trainer.scaler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(dl)
    assert not [w for w in caught if "lr_scheduler" in str(w.message)]
    assert [now for now, _ in watch.skips] == [(1, 1), (1, 2)]
    assert sched.last_epoch == len(dl) - 2


def test_an_epoch_of_skipped_updates_steps_epoch_schedulers_without_warning():
    """Epoch-wise schedulers step after the epoch even when the scaler skipped all of its updates."""
    dl = make_data()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    watch = PoisonAndWatch(model, {(1, b) for b in range(1, len(dl) + 1)})
    trainer = Trainer(model, F.mse_loss, Optimizer(opt, sched), epochs=1, precision="fp16",
                      callbacks=[watch], **QUIET)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit(dl)
    assert len(watch.skips) == len(dl) and sched.last_epoch == 1
    assert opt.param_groups[0]["lr"] == pytest.approx(0.025)


def test_fp16_clipping_matches_unscale_then_clip_in_plain_pytorch():
    """GradClipCallback under fp16 equals scaler.unscale_ + clip_grad_norm_ + scaler.step in plain torch."""
    from deepepochs import GradClipCallback

    dl = make_data()
    model, ref = make_model(), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)
    poisoned = {(1, 3)}
    callbacks = [PoisonAndWatch(model, poisoned), GradClipCallback(0.5, norm_type=2)]
    trainer = Trainer(model, F.mse_loss, Optimizer(opt, sched, sched_on="step"), epochs=2, precision="fp16",
                      callbacks=callbacks, **QUIET)
    set_scale(trainer.scaler)
    trainer.fit(dl)
    reference_fp16(ref, dl, 2, poisoned, clip=0.5)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


@pytest.mark.parametrize("k", [1, 3])
def test_fp16_with_accumulation_scales_the_window_once(k):
    """Under accumulation the scale changes only at updates: every micro-batch of a window backpropagates
    with the same scale, and a poisoned window is skipped as a whole."""
    dl = make_data()
    model = make_model()
    scales = []

    class ScaleAtBackward(Callback):
        def on_before_backward(self, trainer, loss):
            scales.append((trainer.loop.batch_idx, trainer.scaler.get_scale()))

    poisoned = {(1, 3)}
    watch = PoisonAndWatch(model, poisoned)
    trainer = Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.05), epochs=1,
                      precision="fp16", gradient_accumulation_steps=k, callbacks=[watch, ScaleAtBackward()],
                      **QUIET)
    set_scale(trainer.scaler)
    trainer.fit(dl)
    window_of_3 = (3 - 1) // k
    for a, b in zip(scales, scales[1:]):
        if (a[0] - 1) // k == (b[0] - 1) // k:
            assert a[1] == b[1]
    assert [now for now, _ in watch.skips] == [(1, (window_of_3 + 1) * k)]
    assert trainer.scaler.get_scale() == SCALE / 2


# ---- bf16 ----
def test_bf16_on_cpu_trains():
    """bf16 autocast on CPU (no scaler) lowers the loss; the forward really runs in bfloat16."""
    dl = make_data(96)
    model = make_model()
    dtypes = set()

    class OutDtype(Callback):
        def on_after_train_forward(self, trainer, model_out):
            dtypes.add(model_out.dtype)

    trainer = Trainer(model, F.mse_loss, torch.optim.Adam(model.parameters(), lr=1e-2), epochs=8,
                      precision="bf16", callbacks=[OutDtype()], **QUIET)
    losses = trainer.fit(dl)["train"]["loss"]
    assert dtypes == {torch.bfloat16}
    assert losses[-1] < 0.5 * losses[0]
    assert all(p.dtype == torch.float32 for p in model.parameters())


# ---- fp32 non-finite losses ----
class NanLossOn:
    """An MSE loss that returns NaN on chosen (epoch, batch) positions of a trainer."""

    def __init__(self, where):
        self.where = where
        self.trainer = None

    def __call__(self, out, y):
        loss = F.mse_loss(out, y)
        loop = self.trainer.loop
        return loss * math.nan if (loop.epoch, loop.batch_idx) in self.where else loss


@pytest.mark.parametrize("fuse_steps", [True, False])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nonfinite_loss_raises_with_the_flight_record_by_default(precision, fuse_steps):
    """nonfinite='raise' (default, fp32 and bf16): FloatingPointError naming the position, with the
    transitions in its notes, before the NaN update is applied (on the fused edge too); the NaN window's
    gradients are dropped and the trainer is usable again."""
    dl = make_data()
    model = make_model()
    reference = make_model()  # plain PyTorch: the two updates before the NaN batch
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)
    for (x, y), _ in zip(dl, range(2)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    loss = NanLossOn({(1, 3)})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = Trainer(model, loss, opt, epochs=1, precision=precision, fuse_steps=fuse_steps, **QUIET)
    loss.trainer = trainer
    with pytest.raises(FloatingPointError, match=rf"epoch 1 batch 3 \(precision='{precision}'\);"
                                                 r" pass nonfinite='skip'") as info:
        trainer.fit(dl)
    notes = "\n".join(info.value.__notes__)
    # the state the check runs in, fused or not (a fused micro-batch walks the same states)
    state = "optimize_unscaled"
    assert "last transitions of the deepepochs loop" in notes and f"raised in state '{state}'" in notes
    assert all(p.grad is None for p in model.parameters())
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
    assert trainer.machine.state == "idle"
    trainer.fit(make_data(16))  # usable again: the next fit finishes the run
    assert trainer.loop.completed_epochs == 1


@pytest.mark.parametrize("k", [1, 2])
def test_fp32_nonfinite_skip_leaves_the_weights_of_that_update_unchanged(k):
    """nonfinite='skip': the window with a NaN loss is not applied, its step-wise scheduler does not
    advance, on_skip_optimize is called; every other window updates."""
    dl = make_data()
    model = make_model()
    loss = NanLossOn({(1, 3)})
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)
    skips, changed = [], {}

    class Watch(Callback):
        def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
            self.before = snapshot(trainer.raw_model)

        def on_skip_optimize(self, trainer, optimize_index):
            skips.append(trainer.loop.batch_idx)

        def on_after_train_batch(self, trainer, metrics, batch_idx):
            after = snapshot(trainer.raw_model)
            changed[batch_idx + 1] = any(not torch.equal(a, b) for a, b in zip(self.before, after))

    trainer = Trainer(model, loss, Optimizer(opt, sched, sched_on="step"), epochs=1, nonfinite="skip",
                      gradient_accumulation_steps=k, callbacks=[Watch()], **QUIET)
    loss.trainer = trainer
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit(dl)
    skipped_batch = 3 if k == 1 else 4  # the boundary of the window holding batch 3
    assert skips == [skipped_batch]
    assert changed == {b: b % k == 0 and b != skipped_batch for b in range(1, len(dl) + 1)}
    assert sched.last_epoch == len(dl) // k - 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_nonfinite_must_be_raise_or_skip():
    """nonfinite is validated like every choice."""
    with pytest.raises(ConfigError, match=r"nonfinite must be one of 'raise', 'skip' \(got 'ignore'\)"):
        Trainer(make_model(), F.mse_loss, nonfinite="ignore", **QUIET)
