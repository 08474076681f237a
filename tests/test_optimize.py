"""The optimize path: several optimizers, clipping, per-optimizer skips, and the transitions
real runs take through the machine's optimize layer."""

from __future__ import annotations

import collections
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, ConfigError, GradClipCallback, Optimizer, Trainer, TrainerBase
from deepepochs.fsm.machine import Record, load_spec

QUIET = dict(log_batch=False, show_info=False, device="cpu")
SCALE = 256.0


def make_dl(n=48, batch_size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def make_model(seed=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def set_scale(scaler, scale=SCALE):
    scaler.load_state_dict({"scale": scale, "growth_factor": 2.0, "backoff_factor": 0.5,
                            "growth_interval": 2000, "_growth_tracker": 0})


def two_halves(model, lr0=0.05, lr1=0.1, gammas=(0.9, 0.8)):
    """Two optimizers over the two layers, each with a step-wise scheduler."""
    opts = [torch.optim.SGD(model[0].parameters(), lr=lr0), torch.optim.SGD(model[2].parameters(), lr=lr1)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, g) for o, g in zip(opts, gammas)]
    return opts, scheds


def assert_same(model, ref, atol=1e-6):
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=atol)


def grad_norm(params):
    grads = [p.grad for p in params if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()


# ---- several optimizers ----
class IndexListUpdate(TrainerBase):
    """One loss, then both optimizers updated through an explicit optimize_index list."""

    def train_step(self, batch_x, batch_y, **step_args):
        with torch.autocast("cpu", dtype=torch.float16, enabled=self.config.precision == "fp16"):
            out = self.model(batch_x)  # a custom step's forward runs where the step puts it
        self.loss(out, batch_y, do_optimize=False)
        self.optimize(optimize_index=[0, 1])


@pytest.mark.parametrize("trainer_cls", [Trainer, IndexListUpdate])
def test_two_optimizers_with_step_schedulers_match_plain_pytorch(trainer_cls):
    """Two halves of a model, each with its own optimizer and step-wise scheduler, updated together by
    optimize_index=None or by an explicit index list."""
    dl = make_dl()
    model, ref = make_model(), make_model()
    opts, scheds = two_halves(model)
    trainer = trainer_cls(model, F.mse_loss, [Optimizer(o, s, sched_on="step") for o, s in zip(opts, scheds)],
                          epochs=2, **QUIET)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit(dl)
    ref_opts, ref_scheds = two_halves(ref)
    for _ in range(2):
        for x, y in dl:
            F.mse_loss(ref(x), y).backward()
            for o, s in zip(ref_opts, ref_scheds):
                o.step()
                s.step()
                o.zero_grad()
    assert_same(model, ref)
    assert [s.last_epoch for s in scheds] == [2 * len(dl)] * 2
    lrs = [o.param_groups[0]["lr"] for o in opts]
    assert lrs == pytest.approx([o.param_groups[0]["lr"] for o in ref_opts])


class GANLike(TrainerBase):
    """A discriminator-then-generator step: D's loss updates optimizer 0, G's loss optimizer 1."""

    def train_step(self, batch_x, batch_y, **step_args):
        noise, real = batch_x  # loss=None: every item of the batch is an input
        gen, disc = self.raw_model.gen, self.raw_model.disc
        with amp(self.config.precision):
            fake = gen(noise)
            d_loss = disc(real).mean() - disc(fake.detach()).mean()
        self.loss(d_loss, do_optimize=False)
        self.optimize(optimize_index=0)
        disc.requires_grad_(False)  # G's loss must not leave gradients in D
        try:
            with amp(self.config.precision):
                g_loss = disc(fake).mean()
            self.loss(g_loss, do_optimize=False)
        finally:
            disc.requires_grad_(True)
        self.optimize(optimize_index=1)


def amp(precision):
    return torch.autocast("cpu", dtype=torch.float16, enabled=precision == "fp16")


def make_gan(seed=3):
    torch.manual_seed(seed)
    model = nn.Module()
    model.gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model.disc = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
    return model


def gan_opts(model):
    sched = torch.optim.lr_scheduler
    opt_d = torch.optim.SGD(model.disc.parameters(), lr=0.05)
    opt_g = torch.optim.Adam(model.gen.parameters(), lr=1e-2)
    return [opt_d, opt_g], [sched.StepLR(opt_d, 2, 0.5), sched.ExponentialLR(opt_g, 0.95)]


def test_gan_like_step_with_optimize_index_matches_plain_pytorch():
    """D then G updates per batch through optimize_index, each with a step-wise scheduler."""
    dl = make_dl()
    model, ref = make_gan(), make_gan()
    opts, scheds = gan_opts(model)
    trainer = GANLike(model, None, [Optimizer(o, s, sched_on="step") for o, s in zip(opts, scheds)], epochs=2,
                      **QUIET)
    trainer.fit(dl)
    (opt_d, opt_g), (sched_d, sched_g) = gan_opts(ref)
    for _ in range(2):
        for x, y in dl:
            fake = ref.gen(x)
            opt_d.zero_grad()
            (ref.disc(y).mean() - ref.disc(fake.detach()).mean()).backward()
            opt_d.step()
            sched_d.step()
            opt_g.zero_grad()
            ref.disc(fake).mean().backward()
            opt_g.step()
            sched_g.step()
    assert_same(model, ref, atol=1e-5)
    assert [s.last_epoch for s in scheds] == [2 * len(dl)] * 2
    assert all(p.grad is None for p in model.parameters())

class SkipRecorder(Callback):
    """Writes the (epoch, batch) being trained into `now['at']` and records each skipped step in `skips`."""

    def __init__(self, now, skips):
        self.now, self.skips = now, skips

    def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
        self.now["at"] = (trainer.loop.epoch, batch_idx + 1)  # the hook's batch_idx is 0-based

    def on_skip_optimize(self, trainer, optimize_index):
        self.skips.append((self.now["at"], optimize_index))



def test_fp16_gan_with_accumulation_keeps_one_scale_per_iteration():
    """GAN step, k=2, fp16, D's gradients poisoned on some windows: D skips, and the scale must not change
    before G (which accumulated gradients scaled with the old scale over the window) is unscaled. Equals
    plain PyTorch with one scaler.update() per iteration."""
    dl = DataLoader(TensorDataset(torch.randn(48, 4), torch.randn(48, 1)), batch_size=8)
    model, ref = make_gan(), make_gan()
    poisoned = {(1, 2), (1, 6), (2, 4)}
    now = {}
    skips = []

    for m in (model, ref):
        m.disc[2].weight.register_hook(lambda g: torch.full_like(g, math.inf) if now["at"] in poisoned else g)
    opts, scheds = gan_opts(model)
    trainer = GANLike(model, None, [Optimizer(o, s, sched_on="step") for o, s in zip(opts, scheds)], epochs=2,
                      precision="fp16", gradient_accumulation_steps=2, callbacks=[SkipRecorder(now, skips)], **QUIET)
    set_scale(trainer.scaler)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit(dl)

    (opt_d, opt_g), (sched_d, sched_g) = gan_opts(ref)
    scaler = torch.amp.GradScaler("cpu")
    set_scale(scaler)

    def update(opt, sched):
        scaler.unscale_(opt)
        finite = all(torch.isfinite(p.grad).all() for g in opt.param_groups for p in g["params"])
        scaler.step(opt)
        if finite:
            sched.step()
        opt.zero_grad()

    for epoch in (1, 2):
        for batch, (noise, real) in enumerate(dl, 1):
            now["at"] = (epoch, batch)
            last = batch % 2 == 0
            with amp("fp16"):
                fake = ref.gen(noise)
                d_loss = ref.disc(real).mean() - ref.disc(fake.detach()).mean()
            scaler.scale(d_loss / 2).backward()
            if last:
                update(opt_d, sched_d)
            ref.disc.requires_grad_(False)
            with amp("fp16"):
                g_loss = ref.disc(fake).mean()
            scaler.scale(g_loss / 2).backward()
            ref.disc.requires_grad_(True)
            if last:
                update(opt_g, sched_g)
                scaler.update()  # once per iteration, after both optimizers
    assert sorted(skips) == sorted((p, 0) for p in poisoned)
    assert trainer.scaler.get_scale() == scaler.get_scale() == SCALE / 2 ** len(poisoned)
    assert [s.last_epoch for s in scheds] == [sched_d.last_epoch, sched_g.last_epoch] == [3, 6]
    assert_same(model, ref, atol=1e-5)


@pytest.mark.parametrize("trainer_cls", [Trainer, IndexListUpdate])
def test_fp16_skips_per_optimizer_and_keeps_the_other_optimizers_gradients_right(trainer_cls):
    """Inf only in optimizer 0's group: it skips (its scheduler stays), optimizer 1 steps with correctly
    unscaled gradients, as with torch's scaler.step(o0); scaler.step(o1); scaler.update()."""
    dl = make_dl()
    model, ref = make_model(), make_model()
    poisoned = {(1, 2), (1, 5), (2, 1)}
    now = {}
    skips = []

    model[0].weight.register_hook(lambda g: torch.full_like(g, math.inf) if now["at"] in poisoned else g)
    opts, scheds = two_halves(model)
    trainer = trainer_cls(model, F.mse_loss, [Optimizer(o, s, sched_on="step") for o, s in zip(opts, scheds)],
                          epochs=2, precision="fp16", callbacks=[SkipRecorder(now, skips)], **QUIET)
    set_scale(trainer.scaler)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.fit(dl)

    ref_opts, ref_scheds = two_halves(ref)
    scaler = torch.amp.GradScaler("cpu")
    set_scale(scaler)
    ref[0].weight.register_hook(lambda g: torch.full_like(g, math.inf) if now["at"] in poisoned else g)
    for epoch in (1, 2):
        for batch, (x, y) in enumerate(dl, 1):
            now["at"] = (epoch, batch)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.mse_loss(ref(x), y)
            scaler.scale(loss).backward()
            for o, s in zip(ref_opts, ref_scheds):
                scaler.unscale_(o)
                finite = all(torch.isfinite(p.grad).all() for g in o.param_groups for p in g["params"])
                scaler.step(o)
                if finite:
                    s.step()
            scaler.update()
            for o in ref_opts:
                o.zero_grad()

    assert sorted(skips) == sorted((p, 0) for p in poisoned)
    assert_same(model, ref)
    assert [s.last_epoch for s in scheds] == [2 * len(dl) - len(poisoned), 2 * len(dl)]
    assert [s.last_epoch for s in scheds] == [s.last_epoch for s in ref_scheds]
    assert trainer.scaler.get_scale() == scaler.get_scale() == SCALE / 2 ** len(poisoned)


def test_optimize_index_is_validated():
    """A wrong optimize_index names the accepted values and what was received."""

    class Bad(TrainerBase):
        def train_step(self, batch_x, batch_y, **step_args):
            self.loss(self.model(batch_x), batch_y, do_optimize=False)
            self.optimize(optimize_index=2)

    model = make_model()
    trainer = Bad(model, F.mse_loss, two_halves(model)[0], epochs=1, **QUIET)
    with pytest.raises(ConfigError, match=r"optimize_index must be None .* in 0\.\.1 \(got 2\)"):
        trainer.fit(make_dl())
    assert trainer.machine.state == "idle" and all(p.grad is None for p in model.parameters())


def test_a_scheduler_of_another_optimizer_is_rejected():
    """Optimizer(opt, scheduler) checks that the scheduler schedules opt."""
    a, b = (torch.optim.SGD(make_model().parameters(), lr=0.1) for _ in range(2))
    with pytest.raises(ConfigError, match="scheduler must schedule the optimizer it is wrapped with"):
        Optimizer(a, torch.optim.lr_scheduler.StepLR(b, 1))
    with pytest.raises(ConfigError, match=r"sched_on must be one of 'epoch', 'step' \(got 'batch'\)"):
        Optimizer(a, sched_on="batch")


# ---- clipping ----
@pytest.mark.parametrize("args, match", [
    ((0,), r"max_value must be a positive finite number \(got 0\)"),
    ((-1.0,), r"max_value must be a positive finite number \(got -1.0\)"),
    ((math.inf,), r"max_value must be a positive finite number \(got inf\)"),
    (("1",), r"max_value must be a positive finite number \(got '1'\)"),
    ((1.0, 0), r"norm_type must be None \(clip by value\), a positive number or 'inf' \(got 0\)"),
    ((1.0, "l2"), r"norm_type must be None \(clip by value\), a positive number or 'inf' \(got 'l2'\)"),
    ((1.0, True), r"norm_type must be None .*\(got True\)"),
])
def test_grad_clip_arguments_are_validated(args, match):
    """GradClipCallback names the argument, what it accepts and what it got."""
    with pytest.raises(ConfigError, match=match):
        GradClipCallback(*args)


def test_grad_clip_accepts_inf_norm():
    """norm_type='inf' and math.inf both mean the max-norm."""
    assert GradClipCallback(1.0, "inf").norm_type == GradClipCallback(1.0, math.inf).norm_type == math.inf


@pytest.mark.parametrize("norm_type", [None, 2, 1, "inf"])
def test_fp32_clipping_matches_torch_clip_utilities(norm_type):
    """By value and by norm, clipping equals torch's clip_grad_value_/clip_grad_norm_ before each step."""
    dl = make_dl()
    model, ref = make_model(), make_model()
    Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), epochs=2,
            callbacks=[GradClipCallback(0.3, norm_type)], **QUIET).fit(dl)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        for x, y in dl:
            opt.zero_grad()
            F.mse_loss(ref(x), y).backward()
            if norm_type is None:
                torch.nn.utils.clip_grad_value_(ref.parameters(), 0.3)
            else:
                torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3, norm_type=norm_type)
            opt.step()
    assert_same(model, ref)


class NormProbe(Callback):
    """Reads gradient norms after backward (scaled), before clipping, and in a second clipper after the
    GradClipCallback, and what the optimizer finally sees (a pre-step hook)."""

    def __init__(self, trainer_params):
        self.params = trainer_params
        self.rows = []

    def on_after_backward(self, trainer, loss):
        self.row = {"scale": trainer.scaler.get_scale() if trainer.scaler else 1.0,
                    "backward": grad_norm(self.params)}

    def on_before_optimize(self, trainer, optimize_index):
        self.row["before_clip"] = grad_norm(self.params)

    def clip(self, trainer, indices, finite):  # registered after GradClipCallback: runs after it
        self.row["after_clip"] = grad_norm(self.params)
        self.rows.append(self.row)


def test_fp16_clipping_happens_after_unscale_and_before_the_step():
    """The clip sees unscaled gradients (norm = backward norm / scale) and leaves a norm <= max_norm, which
    is what the optimizer steps with."""
    dl = make_dl()
    model = make_model()
    params = list(model.parameters())
    stepped_norms = []
    opt = torch.optim.SGD(params, lr=0.05)
    opt.register_step_pre_hook(lambda o, args, kwargs: stepped_norms.append(grad_norm(params)))
    probe = NormProbe(params)
    clipper = GradClipCallback(0.5, norm_type=2)
    trainer = Trainer(model, F.mse_loss, opt, epochs=1, precision="fp16", callbacks=[clipper, probe], **QUIET)
    set_scale(trainer.scaler)
    trainer.fit(dl)
    assert len(probe.rows) == len(stepped_norms) == len(dl)
    for row, stepped in zip(probe.rows, stepped_norms):
        assert row["backward"] == pytest.approx(row["before_clip"] * row["scale"], rel=1e-5)  # unscaled first
        assert row["after_clip"] <= 0.5 * (1 + 1e-5)
        assert row["after_clip"] == pytest.approx(min(row["before_clip"], 0.5), rel=1e-5)
        assert stepped == pytest.approx(row["after_clip"], rel=1e-6)
    assert any(row["before_clip"] > 0.5 for row in probe.rows)  # the clip really did something
    assert clipper.last_norm.item() == pytest.approx(probe.rows[-1]["before_clip"])


def test_norm_clipping_with_several_optimizers_uses_the_joint_norm_of_finite_groups():
    """Both groups finite: one coefficient from the joint norm of both. Group 0 inf: only group 1's norm
    counts and group 0 (which skips) is left untouched."""
    dl = make_dl()
    model = make_model()
    opts, _ = two_halves(model)
    groups = [list(model[0].parameters()), list(model[2].parameters())]
    poisoned = {2, 4}
    now = {}
    model[0].weight.register_hook(lambda g: torch.full_like(g, math.inf) if now.get("b") in poisoned else g)
    rows = []

    class Probe(Callback):
        def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
            now["b"] = batch_idx + 1  # the hook's batch_idx is 0-based

        def on_before_optimize(self, trainer, optimize_index):
            self.before = [[p.grad.clone() for p in g] for g in groups]

        def clip(self, trainer, indices, finite):
            rows.append((now["b"], dict(finite), self.before, [[p.grad.clone() for p in g] for g in groups]))

    trainer = Trainer(model, F.mse_loss, opts, epochs=1, precision="fp16",
                      callbacks=[GradClipCallback(0.2, norm_type=2), Probe()], **QUIET)
    set_scale(trainer.scaler)
    trainer.fit(dl)
    for batch, finite, before, after in rows:
        assert finite == {0: batch not in poisoned, 1: True}
        live = [0, 1] if finite[0] else [1]
        joint = math.sqrt(sum(torch.linalg.vector_norm(g).item() ** 2 for i in live for g in before[i]))
        coef = min(1.0, 0.2 / (joint + 1e-6))
        for i in live:
            for b, a in zip(before[i], after[i]):
                torch.testing.assert_close(a, b * coef, rtol=1e-5, atol=1e-7)
        if not finite[0]:
            # the skipping group is left untouched
            assert all(torch.equal(a, b) for a, b in zip(after[0], before[0]))
            assert torch.isinf(after[0][0]).all()


# ---- trace coverage of the optimize path ----
SPEC = load_spec()
EDGES = {(t.source, t.trigger, t.dest) for t in SPEC.transitions if t.dest is not None}
HOT = {t.name for t in SPEC.triggers if t.hot}


class Boom(Exception):
    pass


def expected_hot(n_batches, k, n_opts, epochs, skipped_window_of=None):
    """The hot triggers the spec prescribes for the default step: per window `begin_window`, per
    micro-batch `begin_batch backward optimize`, on the window's last one `clip`, one `apply_update` per
    optimizer, `finish_update`; then `end_batch`; after the epoch's training stage `validate` (hot: the update
    clock fires it after every update). Items are (epoch, batch, trigger)."""
    out = []
    for epoch in range(1, epochs + 1):
        for start in range(1, n_batches + 1, k):
            out.append((epoch, start, "begin_window"))
            last = min(start + k - 1, n_batches)
            for b in range(start, last + 1):
                out += [(epoch, b, "begin_batch"), (epoch, b, "backward"), (epoch, b, "optimize")]
                if b == last:
                    out += [(epoch, b, "clip"), *[(epoch, b, "apply_update")] * n_opts,
                            (epoch, b, "finish_update")]
                out.append((epoch, b, "end_batch"))
        out.append((epoch, n_batches, "validate"))
    return out


@pytest.mark.parametrize("interrupt", [False, True], ids=["run", "interrupt"])
@pytest.mark.parametrize("n_opts", [1, 2])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_runs_follow_the_spec_edges_and_skip_exactly_on_poisoned_updates(precision, k, n_opts, interrupt):
    """AMP on/off x accumulation 1/k x one/two optimizers x interrupt: every recorded transition is an edge
    of the spec, the hot triggers follow the spec's order, and the skip edge (apply_update with the
    grads_finite guard false) is taken exactly for the poisoned updates. fp16 poisons gradients with inf;
    fp32 poisons the loss with NaN (nonfinite='skip', which skips every optimizer of the window)."""
    dl = make_dl(n=56)  # 7 batches: k=3 gives windows 3, 3, 1
    n_batches, epochs = len(dl), 2
    boundaries = [min(s + k - 1, n_batches) for s in range(1, n_batches + 1, k)]
    poisoned_windows = {(1, boundaries[0]), (2, boundaries[-1])}
    model = make_model()
    now = {}

    def poisoned_now():
        e, b = now["at"]
        return any(e == pe and (pb - 1) // k == (b - 1) // k for pe, pb in poisoned_windows)

    if precision == "fp16":
        model[0].weight.register_hook(lambda g: torch.full_like(g, math.inf) if poisoned_now() else g)
        expect_skip = {(e, b, 0) for e, b in poisoned_windows}

        def loss_fn(out, y):
            return F.mse_loss(out, y)
    else:
        expect_skip = {(e, b, i) for e, b in poisoned_windows for i in range(n_opts)}

        def loss_fn(out, y):
            return F.mse_loss(out, y) * (math.nan if poisoned_now() else 1.0)

    inject_at = (1, 5)  # inside the second window when k=3

    class Drive(Callback):
        armed = interrupt

        def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
            now["at"] = (trainer.loop.epoch, batch_idx + 1)  # the hook's batch_idx is 0-based

        def on_after_backward(self, trainer, loss):
            if self.armed and now["at"] == inject_at:
                self.armed = False
                raise Boom("injected")

    opt = two_halves(model)[0] if n_opts == 2 else torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = Trainer(model, loss_fn, opt, epochs=epochs, precision=precision, gradient_accumulation_steps=k,
                      nonfinite="skip", callbacks=[Drive()], **QUIET)
    if trainer.scaler is not None:
        set_scale(trainer.scaler)
    trainer.machine.history = collections.deque(maxlen=None)
    labelled = []  # (record, grads_finite) for every apply_update, read when it fired

    def probe(dest):
        rec = Record(*trainer.machine.history[-1])
        if rec.trigger == "apply_update":
            labelled.append((rec, trainer.loop.opt_index, trainer.loop.finite[trainer.loop.opt_index]))

    trainer.machine.probe = probe
    if interrupt:
        with pytest.raises(Boom):
            trainer.fit(dl)
        assert trainer.machine.state == "idle" and all(p.grad is None for p in model.parameters())
    trainer.fit(dl)

    history = trainer.machine.records()
    assert all((r.source, r.trigger, r.dest) in EDGES for r in history), \
        [r for r in history if (r.source, r.trigger, r.dest) not in EDGES]
    skips = {(r.epoch, r.batch, i) for r, i, finite in labelled if not finite}
    assert skips == expect_skip
    assert len([1 for _, _, finite in labelled if not finite]) == len(expect_skip)  # once each

    got = [(r.epoch, r.batch, r.trigger) for r in history if r.trigger in HOT | {"interrupt", "recover"}]
    full = expected_hot(n_batches, k, n_opts, epochs)
    # begin_window is recorded before the batch counter moves: compare triggers, and positions elsewhere
    strip = [(e, b, t) if t != "begin_window" else t for e, b, t in got]
    if not interrupt:
        assert strip == [x if x[2] != "begin_window" else x[2] for x in full]
    else:
        cut = full.index((*inject_at, "backward")) + 1
        resume = max(i for i, x in enumerate(full[:cut]) if x[2] == "begin_window")
        want = full[:cut] + ["interrupt", "recover"] + full[resume:]
        want = [x if isinstance(x, str) or x[2] != "begin_window" else x[2] for x in want]
        strip = [x if isinstance(x, str) or x[2] not in ("interrupt", "recover") else x[2] for x in strip]
        assert strip == want


@pytest.mark.parametrize("fuse_steps", [True, False])
def test_a_step_scheduler_advances_once_per_update_of_the_trainer_that_trains(fuse_steps):
    """The scheduler steps in the optimizer's post-hook only while its own trainer trains: not when user code
    steps the optimizer between fits, and not twice when an unclosed earlier trainer shares the optimizer."""
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
    first = Trainer(model, F.mse_loss, Optimizer(sgd, sched, sched_on="step"), epochs=1, fuse_steps=fuse_steps,
                    **QUIET)
    first.fit(make_dl(16))  # 2 updates
    assert sched.last_epoch == 2
    F.mse_loss(model(torch.randn(3, 4)), torch.randn(3, 1)).backward()
    sgd.step()  # user code between fits: the trainer's scheduler stays put
    sgd.zero_grad(set_to_none=True)
    assert sched.last_epoch == 2
    second = Trainer(model, F.mse_loss, Optimizer(sgd, sched, sched_on="step"), epochs=1, fuse_steps=fuse_steps,
                     **QUIET)  # `first` is not closed: its hook is still registered
    second.fit(make_dl(24))  # 3 updates
    assert sched.last_epoch == 5
    assert sgd.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 5)
    first.close()
    second.close()


@pytest.mark.parametrize("fuse_steps", [True, False])
def test_the_step_scheduler_is_stepped_by_the_update_itself_not_by_an_optimizer_hook(fuse_steps):
    """With the trainer's optimizer hooks removed, a step-wise scheduler still advances once per update
    (the `step_optimizer` action steps it): after 2 epochs of 7 batches in windows of 2, 8 updates."""
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.9)
    t = Trainer(model, F.mse_loss, Optimizer(sgd, sched, sched_on="step"), epochs=2, fuse_steps=fuse_steps,
                gradient_accumulation_steps=2, **QUIET)
    t.opt.unbind_updates()
    t.fit(make_dl(56))
    updates = 2 * math.ceil(7 / 2)
    assert sched.last_epoch == updates
    assert sgd.param_groups[0]["lr"] == pytest.approx(0.1 * 0.9 ** updates)


def test_a_post_hook_failing_after_the_update_still_steps_the_scheduler_once_and_keeps_the_update():
    """A user's optimizer post-hook that raises after the update was applied: the update and its scheduler
    step count as one (kept by the rollback); the refit continues to the same learning rate as a clean run."""
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=0.5)
    t = Trainer(model, F.mse_loss, Optimizer(sgd, sched, sched_on="step"), epochs=1, fuse_steps=False, **QUIET)
    calls = []

    def fail_once(*_):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("post-hook failed")

    sgd.register_step_post_hook(fail_once)
    with pytest.raises(RuntimeError, match="post-hook failed"):
        t.fit(make_dl(48))
    assert sched.last_epoch == 2 and t.loop.resume.batches_done == 2
    t.fit(make_dl(48))
    assert sched.last_epoch == 6
    assert sgd.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 6)


def _decay_groups(model, lr=0.01):
    """AdamW as nanoGPT builds it: matrices decay, biases do not, so the groups list the parameters in
    another order than model.parameters()."""
    params = list(model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr)


def test_norm_clipping_takes_the_models_parameter_order_whatever_the_optimizers_groups():
    """With AdamW's decay/no-decay groups, GradClipCallback's update equals a plain loop's
    clip_grad_norm_(model.parameters()) bit for bit: the norm is summed in model.parameters() order."""
    def model_of():
        torch.manual_seed(5)
        return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(16, 16), nn.Tanh())], nn.Linear(16, 1))

    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(160, 16, generator=g), torch.randn(160, 1, generator=g)
    dl = DataLoader(TensorDataset(x, y), batch_size=8)
    model, ref = model_of(), model_of()
    Trainer(model, F.mse_loss, _decay_groups(model), epochs=2, callbacks=[GradClipCallback(0.05, norm_type=2)],
            **QUIET).fit(dl)
    opt = _decay_groups(ref)
    for _ in range(2):
        for xb, yb in dl:
            opt.zero_grad()
            F.mse_loss(ref(xb), yb).backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
