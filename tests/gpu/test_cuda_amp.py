"""CUDA mixed precision against plain PyTorch references; skipped without CUDA."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, ConfigError, GradClipCallback, Optimizer, Trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

QUIET = dict(log_batch=False, show_info=False, device="cuda")
SCALE = 1024.0


def make_dl(n=60, batch_size=8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)  # 8 batches, the last one of 4


def make_model(seed=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1)).cuda()


def total_norm(model):
    norms = [torch.linalg.vector_norm(p.grad) for p in model.parameters()]
    return torch.linalg.vector_norm(torch.stack(norms)).item()


def set_scale(scaler):
    scaler.load_state_dict({"scale": SCALE, "growth_factor": 2.0, "backoff_factor": 0.5,
                            "growth_interval": 2000, "_growth_tracker": 0})


class Poison(Callback):
    """Writes inf into the first layer's gradient on chosen (epoch, batch); records skips."""

    def __init__(self, model, poisoned):
        self.poisoned, self.now, self.skips = poisoned, None, []
        model[0].weight.register_hook(lambda g: g * math.inf if self.now in self.poisoned else g)

    def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
        self.now = (trainer.loop.epoch, batch_idx + 1)  # the hook's batch_idx is 0-based

    def on_skip_optimize(self, trainer, optimize_index):
        self.skips.append(self.now)


def reference_fp16(model, dl, epochs, poisoned, clip=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.95)
    scaler = torch.amp.GradScaler("cuda")
    set_scale(scaler)
    now = {}
    model[0].weight.register_hook(lambda g: torch.full_like(g, math.inf) if now.get("at") in poisoned else g)
    for epoch in range(1, epochs + 1):
        for batch, (x, y) in enumerate(dl, 1):
            now["at"] = (epoch, batch)
            x, y = x.cuda(), y.cuda()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.mse_loss(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            if scaler.get_scale() >= before:
                sched.step()
            opt.zero_grad(set_to_none=True)
    return sched.last_epoch


@pytest.mark.parametrize("clip", [None, 0.5])
def test_cuda_fp16_skips_poisoned_steps_and_matches_torch_grad_scaler(clip):
    """fp16 on CUDA: CUDA GradScaler, poisoned steps skipped (scale halved, scheduler held, no warning),
    clipping after unscale; weights equal the plain torch.amp loop."""
    dl = make_dl()
    model, ref = make_model(), make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.95)
    poisoned = {(1, 1), (1, 5), (2, 8)}
    poison = Poison(model, poisoned)
    callbacks = [poison] + ([GradClipCallback(clip, norm_type=2)] if clip else [])
    trainer = Trainer(model, F.mse_loss, Optimizer(opt, sched, sched_on="step"), epochs=2, precision="fp16",
                      callbacks=callbacks, **QUIET)
    assert trainer.scaler._device == "cuda"
    set_scale(trainer.scaler)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit(dl)
    ref_steps = reference_fp16(ref, dl, 2, poisoned, clip)
    assert sorted(poison.skips) == sorted(poisoned)
    assert sched.last_epoch == ref_steps == 2 * len(dl) - len(poisoned)
    assert trainer.scaler.get_scale() == SCALE / 2 ** len(poisoned)
    state = trainer._precision.state_dict()
    assert state["scale"] == SCALE / 2 ** len(poisoned)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_cuda_fp16_clipped_norm_is_computed_on_unscaled_gradients():
    """The clip sees unscaled gradients and leaves a joint norm <= max_norm before the step."""
    dl = make_dl()
    model = make_model()
    rows = []

    class Probe(Callback):
        def on_after_backward(self, trainer, loss):
            self.scaled = total_norm(model)

        def on_before_optimize(self, trainer, optimize_index):
            self.unscaled = total_norm(model)

        def clip(self, trainer, indices, finite):
            after = total_norm(model)
            rows.append((self.scaled, self.unscaled, after, trainer.scaler.get_scale()))

    trainer = Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.05), epochs=1,
                      precision="fp16", callbacks=[GradClipCallback(0.25, norm_type=2), Probe()], **QUIET)
    set_scale(trainer.scaler)
    trainer.fit(dl)
    assert len(rows) == len(dl)
    for scaled, unscaled, after, scale in rows:
        assert scaled == pytest.approx(unscaled * scale, rel=1e-3)
        assert after <= 0.25 * (1 + 1e-4)


def test_cuda_bf16_trains_or_is_rejected_clearly():
    """bf16 on a GPU with native bf16 lowers the loss without a scaler; elsewhere a ConfigError."""
    dl = make_dl(240)
    model = make_model()
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        with pytest.raises(ConfigError, match="precision='bf16' is not supported"):
            Trainer(model, F.mse_loss, precision="bf16", **QUIET)
        return
    trainer = Trainer(model, F.mse_loss, torch.optim.Adam(model.parameters(), lr=3e-3), epochs=6,
                      precision="bf16", **QUIET)
    assert trainer.scaler is None
    losses = trainer.fit(dl)["train"]["loss"]
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("k", [3, 5])
def test_cuda_fp32_accumulation_with_a_tail_window_equals_the_concatenated_step(k):
    """k-step accumulation on CUDA with a ragged last batch and a short tail window equals one SGD step
    per concatenated window."""
    dl = make_dl()
    model, ref = make_model(), make_model()
    Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.05), epochs=2,
            gradient_accumulation_steps=k, **QUIET).fit(dl)
    opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    batches = [(x.cuda(), y.cuda()) for x, y in dl]
    for _ in range(2):
        for s in range(0, len(batches), k):
            window = batches[s:s + k]
            opt.zero_grad()
            F.mse_loss(ref(torch.cat([b[0] for b in window])), torch.cat([b[1] for b in window])).backward()
            opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)
    assert all(p.grad is None for p in model.parameters())


def test_cuda_fp32_nonfinite_raise_reads_no_value_per_update_and_raises_at_the_task_end():
    """On CUDA, fp32 nonfinite='raise' flags an inf loss on the device and raises at the task's end."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    bad = {"n": 0}

    def loss(out, y):
        bad["n"] += 1
        value = F.cross_entropy(out, y)
        return value * float("inf") if bad["n"] == 2 else value

    x = torch.randn(32, 4)
    y = (x[:, 0] > 0).long()
    trainer = Trainer(model, loss, torch.optim.SGD(model.parameters(), lr=0.1), epochs=1, device="cuda",
                      log_batch=False, show_info=False)
    with pytest.raises(FloatingPointError, match="checks at the task's end"):
        trainer.fit(DataLoader(TensorDataset(x, y), batch_size=8))
    assert trainer.machine.state == "idle"
