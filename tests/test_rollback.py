"""Interrupt-rollback of the optimize path: an exception or KeyboardInterrupt inside an
accumulation window keeps completed updates, drops the window, and a second fit ends where an
uninterrupted run ends (plain PyTorch references, SGD, shuffle=False)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, Trainer

QUIET = dict(log_batch=False, show_info=False, device="cpu")
SCALE = 256.0
EPOCHS = 3


class Boom(Exception):
    pass


def make_dl(n=60, batch_size=8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)  # 8 batches, the last one of 4


def make_model(seed=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def set_scale(scaler):
    scaler.load_state_dict({"scale": SCALE, "growth_factor": 2.0, "backoff_factor": 0.5,
                            "growth_interval": 2000, "_growth_tracker": 0})


def reference(dl, k, precision, stop=None):
    """Plain PyTorch accumulation: per window, backward each micro-batch's loss weighted by its share of the
    window's samples, one step. fp32 steps on the concatenated window instead. Stops before the window that
    holds `stop` = (epoch, batch). Returns the model and the per-epoch sample-weighted train losses."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    if scaler is not None:
        set_scale(scaler)
    batches = list(dl)
    losses = []
    for epoch in range(1, EPOCHS + 1):
        total, count = 0.0, 0
        for start in range(0, len(batches), k):
            window = batches[start:start + k]
            if stop is not None and stop[0] == epoch and start < stop[1] <= start + k:
                return model, losses
            n_window = sum(len(x) for x, _ in window)
            if scaler is None:
                x = torch.cat([b[0] for b in window])
                y = torch.cat([b[1] for b in window])
                loss = F.mse_loss(model(x), y)
                loss.backward()
                with torch.no_grad():
                    for xb, yb in window:
                        total += F.mse_loss(model(xb), yb).item() * len(xb)
                        count += len(xb)
            else:
                for xb, yb in window:
                    with torch.autocast("cpu", dtype=torch.float16):
                        loss = F.mse_loss(model(xb), yb)
                    scaler.scale(loss * len(xb) / n_window).backward()
                    total += loss.item() * len(xb)
                    count += len(xb)
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            opt.zero_grad(set_to_none=True)
        losses.append(total / count)
    return model, losses


def assert_same(model, ref, atol=1e-5):
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=atol)


def trainer_for(model, k, precision, callbacks, fuse_steps=True):
    trainer = Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.05), epochs=EPOCHS,
                      precision=precision, gradient_accumulation_steps=k, callbacks=callbacks,
                      fuse_steps=fuse_steps, **QUIET)
    if trainer.scaler is not None:
        set_scale(trainer.scaler)
    return trainer


class RaiseAfterBackward(Callback):
    """Raises `exc` once, after the backward of batch `at` = (epoch, batch)."""

    def __init__(self, at, exc):
        self.at, self.exc, self.armed = at, exc, True

    def on_after_backward(self, trainer, loss):
        if self.armed and (trainer.loop.epoch, trainer.loop.batch_idx) == self.at:
            self.armed = False
            raise self.exc


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("exc_type", [Boom, KeyboardInterrupt])
def test_an_interrupt_mid_window_keeps_completed_updates_and_a_second_fit_finishes_the_run(exc_type, k,
                                                                                           precision):
    """Interrupted after the backward of batch 5 of epoch 2 (the middle of window 4-6 when k=3): weights
    are those after the completed updates, no gradient is left, the error carries the flight record; the
    next fit restarts that window and ends with the weights and epoch losses of an uninterrupted run."""
    dl = make_dl()
    at = (2, 5)
    model = make_model()
    trainer = trainer_for(model, k, precision, [RaiseAfterBackward(at, exc_type("injected"))])
    with pytest.raises(exc_type) as info:
        trainer.fit(dl)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "last transitions of the deepepochs loop" in notes
    assert "epoch 2 batch 5: step_forward --backward--> step_backward" in notes
    assert "step_backward --interrupt--> rollback" in notes
    assert trainer.machine.state == "idle"
    assert all(p.grad is None for p in model.parameters())
    partial, _ = reference(dl, k, precision, stop=at)
    assert_same(model, partial)
    if trainer.scaler is not None:
        assert trainer.scaler._per_optimizer_states == {}  # no half-done unscale left behind

    records = trainer.fit(dl)
    full, full_losses = reference(dl, k, precision)
    assert_same(model, full)
    assert records["train"]["loss"] == pytest.approx(full_losses, rel=1e-5)  # the whole run: epoch 1 too
    assert records == trainer.history
    assert all(p.grad is None for p in model.parameters())


class RaiseInState(Callback):
    """Raises once when the machine enters `state` at batch `at` (through the machine's probe)."""

    def __init__(self, state, at):
        self.state, self.at, self.armed = state, at, True

    def on_attach(self, trainer):
        def probe(dest):
            if self.armed and dest == self.state and (trainer.loop.epoch, trainer.loop.batch_idx) == self.at:
                self.armed = False
                raise Boom(f"injected in {dest}")

        trainer.machine.probe = probe


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
@pytest.mark.parametrize("state, batch", [
    ("step_forward", 5), ("step_backward", 5), ("window_open", 5),  # inside the window 4-6
    ("step_forward", 6), ("step_backward", 6),  # the window's last micro-batch, before its update
    ("optimize_unscaled", 6), ("optimize_clipped", 6),  # half-way through the update
    ("step_optimized", 6), ("task_train", 6),  # the update is done: it must not be repeated
])
@pytest.mark.parametrize("fuse_steps", [False, True])
def test_an_interrupt_in_any_optimize_path_state_resumes_to_the_uninterrupted_run(precision, state, batch,
                                                                                 fuse_steps):
    """An exception raised on entering each state of the window/step/optimize layers (k=3): the second fit
    ends with the uninterrupted run's weights and epoch losses, whether the window's update had happened
    (the window is then complete and kept) or not (it is dropped and repeated). Fused edges enter only
    window_open and task_train."""
    if fuse_steps and state not in ("window_open", "task_train"):
        pytest.skip("not entered on the fused edges")
    dl = make_dl()
    model = make_model()
    trainer = trainer_for(model, 3, precision, [RaiseInState(state, (2, batch))], fuse_steps)
    with pytest.raises(Boom) as info:
        trainer.fit(dl)
    assert f"raised in state {state!r}" in "\n".join(info.value.__notes__)
    assert all(p.grad is None for p in model.parameters())
    updated = state in ("step_optimized", "task_train")
    partial, _ = reference(dl, 3, precision, stop=(2, 7) if updated else (2, batch))
    assert_same(model, partial)
    trainer.fit(dl)
    full, full_losses = reference(dl, 3, precision)
    assert_same(model, full)
    assert trainer.history["train"]["loss"] == pytest.approx(full_losses, rel=1e-5)


def test_an_interrupted_fp16_update_does_not_change_the_scale():
    """Interrupted between unscale and step: the update's inf records are dropped (the scale is as before)
    and the retried window unscales again without torch's 'unscale_() has already been called' error."""
    dl = make_dl()
    model = make_model()

    class RaiseBeforeOptimize(Callback):
        armed = True

        def on_before_optimize(self, trainer, optimize_index):
            if self.armed and trainer.loop.batch_idx == 3:
                self.armed = False
                self.scale = trainer.scaler.get_scale()
                raise Boom("injected")

    cb = RaiseBeforeOptimize()
    trainer = trainer_for(model, 3, "fp16", [cb])
    with pytest.raises(Boom):
        trainer.fit(dl)
    assert trainer.scaler.get_scale() == cb.scale == SCALE
    trainer.fit(dl)
    assert_same(model, reference(dl, 3, "fp16")[0])
