"""EMACallback's conventions of ema_pytorch (`update_every`, a copy until `update_after_step`, the power
warm-up computed in float32) and timm's `ModelEmaV3` (the same warm-up in float64, updated every step), bit
for bit against the formulas written out in plain PyTorch and, where the packages are installed, against
`ema_pytorch.EMA` and `timm.utils.model_ema.ModelEmaV3` themselves. A diffusion-shaped program (a denoiser
whose forward draws its own timesteps and noise, Adam, ema_pytorch's convention) trained by deepepochs equals
its plain loop, weights and average, also when SIGTERM stops it mid-run and a new trainer resumes it."""

from __future__ import annotations

import importlib.util
import os
import random
import signal

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from deepepochs import Callback, ConfigError, EMACallback, Preempted, SnapshotCallback, Trainer

QUIET = dict(log_batch=False, show_info=False, device="cpu")
STEPS, N, BATCH = 20, 40, 8  # diffusion timesteps, dataset size, batch size


class Denoiser(nn.Module):
    """A tiny denoiser: predicts the noise of `x` at timestep `t` (dropout, GroupNorm as diffusion nets)."""

    def __init__(self):
        super().__init__()
        self.time = nn.Embedding(STEPS, 16)
        self.inp = nn.Linear(16, 16)
        self.norm = nn.GroupNorm(2, 16)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(16, 16)

    def forward(self, x, t):
        h = self.norm(self.inp(x)) + self.time(t)
        return self.out(self.drop(F.silu(h)))


class Diffusion(nn.Module):
    """denoising-diffusion-pytorch's `GaussianDiffusion1D` shape: `forward(x0)` draws timesteps and noise from
    torch's generator and returns the loss of predicting the noise."""

    def __init__(self):
        super().__init__()
        self.denoiser = Denoiser()
        self.register_buffer("alphas_cumprod", torch.cumprod(1 - torch.linspace(1e-4, 0.2, STEPS), 0))

    def forward(self, x0):
        t = torch.randint(0, STEPS, (x0.shape[0],))
        noise = torch.randn_like(x0)
        a = self.alphas_cumprod[t][:, None]
        return F.mse_loss(self.denoiser(a.sqrt() * x0 + (1 - a).sqrt() * noise, t), noise)


class Signals(Dataset):
    """Sequences whose loading draws an augmentation from NumPy's and Python's generators."""

    def __init__(self):
        self.x = torch.randn(N, 16, generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.x[i] * float(1 + 0.1 * np.random.rand()) + 0.01 * random.random()


def parts():
    """The program's model, optimizer and shuffled data, as the same seed makes them."""
    torch.manual_seed(0)
    model = Diffusion()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    data = DataLoader(Signals(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(2))
    return model, opt, data


def seed():
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)


class PlainEMA:
    """ema_pytorch's and timm's update rules written out: `update()` after each optimizer step; with `n`
    earlier calls, nothing unless `n % every == 0`, a copy while `n <= after`, else a lerp with the warm-up's
    decay `clamp(1 - (1 + (n - after) / gamma) ** -power, floor, beta)` (`float32`: on a float32 tensor)."""

    def __init__(self, model, beta, every=1, after=0, power=None, gamma=1.0, floor=0.0, float32=False):
        self.model, self.beta, self.every, self.after = model, beta, every, after
        self.power, self.gamma, self.floor, self.float32 = power, gamma, floor, float32
        self.ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.n = 0

    def decay(self) -> float:
        if self.power is None:
            return self.beta
        steps = self.n - self.after
        if self.float32:
            value = 1 - (1 + torch.tensor(float(steps)) / self.gamma) ** -self.power
            return value.clamp(min=self.floor, max=self.beta).item()
        return max(min(1 - (1 + steps / self.gamma) ** -self.power, self.beta), self.floor)

    @torch.no_grad()
    def update(self):
        if self.n % self.every == 0:
            for key, value in self.model.state_dict().items():
                if self.n <= self.after or not value.is_floating_point():
                    self.ema[key].copy_(value)
                else:
                    self.ema[key].lerp_(value, 1 - self.decay())
        self.n += 1

    def state_dict(self):
        return {"ema": self.ema, "n": self.n}

    def load_state_dict(self, state):
        for key, value in state["ema"].items():
            self.ema[key].copy_(value)
        self.n = state["n"]


def plain_loop(updates, make_ema):
    """The program as its author wrote it: cycle through the data, `loss = model(x0)`, backward, Adam's step,
    zero_grad, the EMA's update."""
    model, opt, data = parts()
    ema = make_ema(model)
    seed()
    done = 0
    while done < updates:
        for x0 in data:
            loss = model(x0)
            loss.backward()
            opt.step()
            opt.zero_grad()
            ema.update()
            done += 1
            if done == updates:
                break
    return model, opt, ema


def fit(updates, callbacks, seeded=True, **kw):
    model, opt, data = parts()
    trainer = Trainer(model, None, opt, max_updates=updates, callbacks=callbacks, **QUIET, **kw)
    if seeded:
        seed()
    trainer.fit(data)
    return trainer


def floats(state: dict) -> dict:
    """The floating tensors of a state dict (the ones an EMA averages)."""
    return {k: v for k, v in state.items() if v.is_floating_point()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def averaged(ema: EMACallback) -> dict:
    return floats(ema.averaged.module.state_dict())


CONVENTIONS = {
    "ema_pytorch": (dict(decay=0.995, update_every=3, start_update=7, power=2 / 3, decay_dtype=torch.float32),
                    dict(beta=0.995, every=3, after=7, power=2 / 3, float32=True)),
    "timm warm-up": (dict(decay=0.99, start_update=4, power=0.75, inv_gamma=2.5, min_decay=0.3),
                     dict(beta=0.99, after=4, power=0.75, gamma=2.5, floor=0.3)),
    "a copy, then a fixed decay": (dict(decay=0.9, start_update=5), dict(beta=0.9, after=5)),
}


@pytest.mark.parametrize("name", CONVENTIONS)
def test_each_convention_equals_its_update_rule_written_out_in_plain_pytorch(name):
    """ema_pytorch's (every 3rd update, a copy until 7, float32 warm-up), timm's (a copy until 4, float64
    warm-up with a floor) and a plain copy-then-decay: the average and the weights bit for bit."""
    ours, theirs = CONVENTIONS[name]
    ema = EMACallback(**ours)
    trainer = fit(30, [ema])
    model, _, plain = plain_loop(30, lambda m: PlainEMA(m, **theirs))
    assert same(trainer.raw_model.state_dict(), model.state_dict())
    assert same(averaged(ema), floats(plain.ema))


def test_the_decays_equal_the_formulas_written_out_over_a_long_run():
    """The warm-up's decays after 0 to 300,000 earlier updates, in float32 and float64, past the clamp."""
    for dtype, float32 in ((torch.float32, True), (torch.float64, False)):
        ours = EMACallback(0.9999, start_update=100, power=2 / 3, inv_gamma=7.3, min_decay=0.1, decay_dtype=dtype)
        plain = PlainEMA(nn.Linear(1, 1), 0.9999, after=100, power=2 / 3, gamma=7.3, floor=0.1, float32=float32)
        for n in range(101, 300_000, 997):
            plain.n = n
            assert ours.decay_at(n) == plain.decay(), (dtype, n)


def _timm_model_ema():
    """timm's `model_ema` module, loaded from its file (importing `timm` itself needs torchvision); None when
    timm is not installed."""
    found = importlib.util.find_spec("timm")
    if found is None or not found.submodule_search_locations:
        return None
    path = os.path.join(found.submodule_search_locations[0], "utils", "model_ema.py")
    spec = importlib.util.spec_from_file_location("timm_model_ema", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_ema_pytorch_convention_equals_ema_pytorch_itself():
    """`ema_pytorch.EMA(beta, update_after_step, update_every, inv_gamma, power, min_value)`, its `update()`
    after each step: its average bit for bit."""
    ema_pytorch = pytest.importorskip("ema_pytorch")
    kw = dict(beta=0.995, update_after_step=7, update_every=3, inv_gamma=2.0, power=0.7, min_value=0.2)
    ema = EMACallback(kw["beta"], update_every=kw["update_every"], start_update=kw["update_after_step"],
                      power=kw["power"], inv_gamma=kw["inv_gamma"], min_decay=kw["min_value"],
                      decay_dtype=torch.float32)
    trainer = fit(40, [ema])
    model, _, theirs = plain_loop(40, lambda m: ema_pytorch.EMA(m, **kw))
    assert same(trainer.raw_model.state_dict(), model.state_dict())
    assert same(averaged(ema), floats(theirs.ema_model.state_dict()))


def test_the_timm_convention_equals_timms_model_ema_v3_itself():
    """`timm.utils.model_ema.ModelEmaV3(decay, min_decay, update_after_step, use_warmup=True, warmup_gamma,
    warmup_power)` updated with `step=num_updates` after each step: its average bit for bit."""
    timm_ema = _timm_model_ema()
    if timm_ema is None:
        pytest.skip("timm is not installed")
    kw = dict(decay=0.99, min_decay=0.3, update_after_step=4, use_warmup=True, warmup_gamma=2.5, warmup_power=0.75)

    class Stepped:  # timm's train.py: `num_updates += 1` after the step, then `model_ema.update(model, step=...)`
        def __init__(self, model):
            self.model, self.ema, self.updates = model, timm_ema.ModelEmaV3(model, **kw), 0

        def update(self):
            self.updates += 1
            self.ema.update(self.model, step=self.updates)

    ema = EMACallback(kw["decay"], start_update=kw["update_after_step"], power=kw["warmup_power"],
                      inv_gamma=kw["warmup_gamma"], min_decay=kw["min_decay"])
    trainer = fit(30, [ema])
    model, _, theirs = plain_loop(30, Stepped)
    assert same(trainer.raw_model.state_dict(), model.state_dict())
    assert same(averaged(ema), floats(theirs.ema.module.state_dict()))


class TermAt(Callback):
    """Sends SIGTERM to this process after committed update `update` of the run."""

    def __init__(self, update):
        self.update = update

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if trainer.loop.run.updates == self.update:
            os.kill(os.getpid(), signal.SIGTERM)


class FirstUpdate(Callback):
    """Notes the run's committed updates at its first training batch."""

    def __init__(self):
        self.updates = None

    def on_before_train_forward(self, trainer):
        if self.updates is None:
            self.updates = trainer.loop.run.updates


def diffusion_ema() -> EMACallback:
    """ema_pytorch's defaults as the diffusion trainer uses them: every 10 updates, a copy until 100, then the
    warm-up towards 0.995."""
    return EMACallback(0.995, update_every=10, start_update=100, power=2 / 3, decay_dtype=torch.float32)


def diffusion_reference(updates):
    return plain_loop(updates, lambda m: PlainEMA(m, 0.995, every=10, after=100, power=2 / 3, float32=True))


@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name == "nt", reason="POSIX signals")
def test_a_diffusion_program_with_ema_pytorchs_convention_equals_its_plain_loop_also_resumed_after_sigterm(
        tmp_path):
    """A diffusion-shaped program (130 updates): the weights, Adam's state and the average equal the plain
    loop's; SIGTERM after update 117 (past the copies, between two moves) and a new trainer resuming the
    snapshot end the same."""
    model, opt, plain = diffusion_reference(130)
    ema = diffusion_ema()
    trainer = fit(130, [ema])
    assert same(trainer.raw_model.state_dict(), model.state_dict())
    assert same(averaged(ema), floats(plain.ema))

    with pytest.raises(Preempted):
        fit(130, [SnapshotCallback(tmp_path), diffusion_ema(), TermAt(117)], running_id="run")
    again, first = diffusion_ema(), FirstUpdate()
    torch.manual_seed(1234)  # what this process drew before must not matter: the snapshot's generators count
    resumed = fit(130, [SnapshotCallback(tmp_path), again, first], seeded=False, running_id="run", resume=True)
    assert first.updates == 117 and again.updates == 130
    assert same(resumed.raw_model.state_dict(), model.state_dict())
    assert same(averaged(again), floats(plain.ema))
    ours, theirs = resumed.opt[0].opt.state_dict()["state"], opt.state_dict()["state"]
    assert all(same(ours[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize("make,message", [
    (lambda: EMACallback(update_every=0), "update_every must be an int >= 1"),
    (lambda: EMACallback(start_update=-1), "start_update must be an int >= 0"),
    (lambda: EMACallback(power=0), "power must be a number in"),
    (lambda: EMACallback(power=0.5, warmup=True), "warmup=True or power, not both"),
    (lambda: EMACallback(0.99, power=0.5, min_decay=0.995), r"min_decay must be a number in \[0, decay=0.99\]"),
    (lambda: EMACallback(power=0.5, inv_gamma=0), "inv_gamma must be a number in"),
    (lambda: EMACallback(power=0.5, decay_dtype=torch.float16), "decay_dtype must be torch.float32"),
])
def test_bad_convention_arguments_are_refused_naming_them(make, message):
    """Each new option's bad value is refused, naming the option and what it accepts."""
    with pytest.raises(ConfigError, match=message):
        make()


class ProgramEMA(Callback):
    """The program's own EMA object (`PlainEMA`, ema_pytorch's rule) kept in a callback, updated as the
    program updates it (after the optimizer's step); its state is the object's, nothing else is written."""

    def __init__(self):
        self.ema = None

    def on_attach(self, trainer):
        self.ema = PlainEMA(trainer.raw_model, 0.995, every=10, after=100, power=2 / 3, float32=True)

    def on_after_optimize(self, trainer, optimize_index):
        self.ema.update()

    def state_dict(self):
        return self.ema.state_dict()

    def load_state_dict(self, state):
        self.ema.load_state_dict(state)


@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name == "nt", reason="POSIX signals")
def test_the_programs_own_ema_object_in_a_callback_resumes_exactly_after_sigterm(tmp_path):
    """The diffusion program keeping its own EMA object in a callback: stopped by SIGTERM after update 117
    and resumed by a new trainer, its EMA (the object's tensors and step count) equals the plain loop's."""
    model, _, plain = diffusion_reference(130)
    with pytest.raises(Preempted):
        fit(130, [SnapshotCallback(tmp_path), ProgramEMA(), TermAt(117)], running_id="run")
    again = ProgramEMA()
    torch.manual_seed(1234)
    resumed = fit(130, [SnapshotCallback(tmp_path), again], seeded=False, running_id="run", resume=True)
    assert same(resumed.raw_model.state_dict(), model.state_dict())
    assert again.ema.n == plain.n == 130
    assert same(again.ema.ema, plain.ema)
