"""The paths added since the last GPU session, on CUDA, each against a plain PyTorch loop on the same device:
training by updates over a with-replacement sampler with validation every N updates and an EMA of the
weights; fp16 updates the GradScaler skips leaving the EMA untouched; a step with its own backward under
fp16 (`self.backward(loss)`) against torch's GradScaler recipe; an LBFGS closure step. Skipped without
CUDA."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from deepepochs import EMACallback, Trainer, TrainerBase

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the CPU tests' helpers
from callbacks.test_averaging import Watch  # noqa: E402  (the average after each batch, and the skipped ones)
from state_compare import plain_val_loss  # noqa: E402  (a plain loop's evaluation)
from test_own_backward import ManagedBackward  # noqa: E402  (self.backward(loss) then self.optimize())

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
QUIET = dict(log_batch=False, show_info=False, device="cuda")
UPDATES, EVERY, DECAY = 17, 5, 0.9


def dataset(n=48, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def stream():
    """A with-replacement sampler drawing from its own generator: endless in practice."""
    data = dataset()
    sampler = RandomSampler(data, replacement=True, num_samples=10**6, generator=torch.Generator().manual_seed(7))
    return DataLoader(data, batch_size=4, sampler=sampler)


def val_loader():
    return DataLoader(dataset(20, seed=2), batch_size=8)


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3)).to(CUDA)


def make_opt(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def assert_same(got: dict, want: dict):
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_training_by_updates_with_an_ema_on_cuda_equals_the_plain_update_loop():
    """UPDATES updates over the stream, validation after every EVERY-th and the last, an EMA moved after each
    step: the weights, the optimizer state and the average equal the plain CUDA loop's bit for bit, and each
    validation point's loss equals the plain evaluation's."""
    model = make_model()
    ema = EMACallback(DECAY)
    trainer = Trainer(model, F.cross_entropy, make_opt(model), max_updates=UPDATES, callbacks=[ema], **QUIET)
    records = trainer.fit(stream(), val_loader(), val_every_n_updates=EVERY)
    trainer.close()

    ref = make_model()
    opt = make_opt(ref)
    averaged = AveragedModel(ref, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=True)
    batches, points, losses = iter(stream()), [], []
    val = val_loader()
    for update in range(1, UPDATES + 1):
        x, y = next(batches)
        F.cross_entropy(ref(x.to(CUDA)), y.to(CUDA)).backward()
        opt.step()
        opt.zero_grad()
        averaged.update_parameters(ref)
        if update % EVERY == 0 or update == UPDATES:
            points.append(update)
            losses.append(plain_val_loss(ref, val, CUDA))

    assert trainer.loop.run.updates == UPDATES
    assert_same(trainer.raw_model.state_dict(), ref.state_dict())
    assert_same(ema.averaged.state_dict(), averaged.state_dict())
    assert records["val"]["updates"] == points
    assert records["val"]["loss"] == pytest.approx(losses, rel=1e-6)


class NanLoss:
    """cross_entropy, NaN on training call `bad` (1-based)."""

    def __init__(self, bad):
        self.bad, self.calls = bad, 0

    def __call__(self, out, y):
        loss = F.cross_entropy(out, y)
        if torch.is_grad_enabled():
            self.calls += 1
            if self.calls == self.bad:
                loss = loss * math.nan
        return loss


def test_fp16_updates_the_cuda_grad_scaler_skips_leave_the_ema_untouched():
    """fp16 on CUDA: an update skipped for a NaN loss leaves the average as it was; every applied one moves it."""
    model = make_model()
    ema = EMACallback(DECAY)
    watch = Watch(ema)
    trainer = Trainer(model, NanLoss(4), make_opt(model), epochs=1, precision="fp16", callbacks=[ema, watch], **QUIET)
    trainer.fit(DataLoader(dataset(), batch_size=4))
    trainer.close()
    assert 3 in watch.skipped and len(watch.states) == 12
    previous = None
    for i, state in enumerate(watch.states):
        if previous is not None:
            moved = any(not torch.equal(state[k], previous[k]) for k in state if k != "n_averaged")
            assert moved == (i not in watch.skipped), i
        previous = state
    assert ema.updates == 12 - len(watch.skipped)


def test_an_own_backward_step_under_cuda_fp16_equals_torchs_grad_scaler_loop():
    """self.backward(loss) under fp16 on CUDA: the weights, the optimizer state and the scale equal torch's
    recipe (autocast float16, scaler.scale(loss).backward(), scaler.step, scaler.update)."""
    model = make_model()
    opt = make_opt(model)
    trainer = ManagedBackward(model, F.cross_entropy, opt, epochs=2, precision="fp16", **QUIET)
    data = DataLoader(dataset(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    trainer.fit(data)
    trainer.close()

    ref = make_model()
    ref_opt = make_opt(ref)
    scaler = torch.amp.GradScaler("cuda")
    data = DataLoader(dataset(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))
    for _ in range(2):
        for x, y in data:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(ref(x.to(CUDA)), y.to(CUDA))
            scaler.scale(loss).backward()
            scaler.step(ref_opt)
            scaler.update()
            ref_opt.zero_grad()
    assert_same(trainer.raw_model.state_dict(), ref.state_dict())
    assert trainer.scaler.get_scale() == scaler.get_scale()
    for got, want in zip(opt.state_dict()["state"].values(), ref_opt.state_dict()["state"].values()):
        assert_same(got, want)


class ClosureStep(TrainerBase):
    """An LBFGS step: the closure zeroes the gradients, runs the model and backpropagates."""

    def train_step(self, batch_x, batch_y, **step_args):
        def closure():
            self.opt[0].opt.zero_grad()
            loss = F.mse_loss(self.model(batch_x), batch_y)
            loss.backward()
            return loss

        self.optimize(closure=closure)


def regression():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(32, 6, generator=g)
    return DataLoader(TensorDataset(x, x @ torch.randn(6, 1, generator=g)), batch_size=8, shuffle=True,
                      generator=torch.Generator().manual_seed(5))


def make_lbfgs_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 1)).to(CUDA)
    return model, torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3, history_size=2)


def test_an_lbfgs_closure_step_on_cuda_equals_the_plain_closure_loop():
    """Two epochs of LBFGS steps on CUDA (several closure evaluations a step, dropout drawing on the GPU):
    the weights equal the plain loop's `opt.step(closure)` bit for bit."""
    model, opt = make_lbfgs_model()
    trainer = ClosureStep(model, F.mse_loss, opt, epochs=2, **QUIET)
    trainer.fit(regression())
    trainer.close()

    ref, ref_opt = make_lbfgs_model()
    data = regression()
    for _ in range(2):
        for x, y in data:
            x, y = x.to(CUDA), y.to(CUDA)

            def closure(x=x, y=y):
                ref_opt.zero_grad()
                loss = F.mse_loss(ref(x), y)
                loss.backward()
                return loss

            ref_opt.step(closure)
    assert_same(trainer.raw_model.state_dict(), ref.state_dict())
