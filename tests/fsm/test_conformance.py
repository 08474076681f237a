"""Real runs follow the spec. Each recorded transition is a table edge, and the whole recorded path
equals the trace the spec yields for the scenario (an independent walk over the spec's edges driven by the
loop grammar documented in spec/loop.py)."""

import collections

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from deepepochs import Callback, EpochTask, Optimizer, Trainer, TrainerBase
from deepepochs.engine import actions
from deepepochs.fsm.machine import load_spec

SPEC = load_spec()
EDGES = {(t.source, t.trigger, t.dest) for t in SPEC.transitions}


class SpecWalker:
    """Walks the spec's edges, choosing each edge by the guard outcomes the scenario implies."""

    def __init__(self):
        self.state = SPEC.initial
        self.trace = []

    def fire(self, trigger, **guards):
        edges = SPEC.edges(self.state, trigger)
        outcome = collections.defaultdict(bool, guards)
        edge = next(t for t in edges if t.matches(outcome))
        self.trace.append((self.state, trigger, edge.dest))
        self.state = edge.dest


def expected_fit(walker, epochs, train_batches, val_batches, k=1, updates=((None,),), val_freq=1, start=0,
                 fused=None):
    """The spec trace of `fit`: `train_batches`/`val_batches` are lists of batch counts per task;
    `updates` is, per step, the list of optimize calls (each a backward then an optimize); `fused`:
    'windows' (accumulate_step inside a window, update_step at its end) or 'plain' (one window_step per
    one-batch window, k=1)."""
    w = walker
    w.fire("fit")
    for epoch in range(start + 1, epochs + 1):
        w.fire("next_epoch", epochs_remaining=True)
        w.fire("begin_train")
        for n in train_batches:
            w.fire("begin_task")
            for b in range(n):
                pos = b % k
                boundary = pos == k - 1 or b == n - 1
                if fused == "plain":
                    w.fire("window_step")
                    continue
                if pos == 0:
                    w.fire("begin_window")
                if fused:
                    w.fire("update_step" if boundary else "accumulate_step")
                    continue
                w.fire("begin_batch", window_boundary=boundary)
                for _call in updates:
                    w.fire("backward")
                    w.fire("optimize", window_boundary=boundary)
                    if boundary:
                        w.fire("clip")
                        for _opt in _call:
                            w.fire("apply_update", grads_finite=True)
                        w.fire("finish_update")
                w.fire("end_batch", window_boundary=boundary)
            w.fire("end_task")
        w.fire("end_stage")
        due = bool(val_batches) and epoch % val_freq == 0
        w.fire("validate", val_due=due)
        if due:
            _eval_stage(w, val_batches)
        w.fire("end_epoch")
    w.fire("next_epoch", epochs_remaining=False)
    w.fire("finish")
    return w.trace


def _eval_stage(w, batches):
    """Tasks of an evaluation stage (validation or test), then the stage's end."""
    for n in batches:
        w.fire("begin_task")
        for _ in range(n):
            w.fire("begin_batch")
            w.fire("end_batch")
        w.fire("end_task")
    w.fire("end_stage")


def expected_test(walker, test_batches):
    walker.fire("test")
    _eval_stage(walker, test_batches)
    return walker.trace


def _data(n, batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] > 0).long()
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, n, batch)]


def _recorded(trainer):
    return [(r.source, r.trigger, r.dest) for r in trainer.machine.records()]


def _trainer(**kw):
    torch.manual_seed(0)
    model = nn.Linear(6, 2)
    t = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu",
                log_batch=False, show_info=False, **kw)
    t.machine.history = collections.deque()  # keep the whole path
    t._console.enabled = False
    return t


@pytest.mark.parametrize("fuse_steps", [True, False])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("k", [1, 3])
def test_fit_and_test_follow_the_spec_trace(precision, k, fuse_steps):
    """Single process, AMP on/off, accumulation 1/k with a tail window, validation every second epoch; with
    k=1 every precision takes one fused window_step per batch, with k=3 the window edges, unless
    fuse_steps=False."""
    train, val = _data(40, 8), _data(20, 8)  # 5 train batches (tail window for k=3), 3 val batches
    t = _trainer(precision=precision, gradient_accumulation_steps=k, epochs=3, fuse_steps=fuse_steps)
    t.fit(train, val, val_freq=2)
    t.test(val)
    walker = SpecWalker()
    fused = None if not fuse_steps else "plain" if k == 1 else "windows"
    expected_fit(walker, 3, [5], [3], k=k, val_freq=2, fused=fused)
    expected_test(walker, [3])
    recorded = _recorded(t)
    assert set(recorded) <= EDGES
    assert recorded == walker.trace


def _expand_fused(trace):
    fused = {(t.source, t.trigger, t.dest): [(e.source, e.trigger, e.dest) for e in SPEC.fused_path(t)]
             for t in SPEC.transitions if t.fuses}
    return [edge for step in trace for edge in fused.get(step, [step])]


class Accuracy:
    __name__ = "acc"

    def __call__(self, preds, targets):
        return (preds.argmax(1) == targets).float().mean()


FUSED_CASES = {  # name: (precision, k, nonfinite, poisoned (epoch, batch) positions)
    "fp32-k1": ("fp32", 1, "raise", ()),
    "bf16-k1": ("bf16", 1, "raise", ()),
    "fp32-k3-tail": ("fp32", 3, "raise", ()),
    "bf16-k2": ("bf16", 2, "raise", ()),
    "fp16-k1-overflow": ("fp16", 1, "raise", ((1, 2), (2, 5))),
    "fp16-k3-overflow": ("fp16", 3, "raise", ((1, 2), (2, 6))),
    "fp32-k2-nan-skip": ("fp32", 2, "skip", ((1, 3),)),
    "fp32-k1-nan-skip": ("fp32", 1, "skip", ((1, 3), (2, 1))),
    "fp16-k1": ("fp16", 1, "raise", ()),
    "fp16-k3": ("fp16", 3, "raise", ()),
    "bf16-k1-nan-skip": ("bf16", 1, "skip", ((1, 2),)),
    "bf16-k3-nan-skip": ("bf16", 3, "skip", ((2, 4),)),
}


def _spy_on_registry(monkeypatch):
    """Wrap every registered action and guard so that each call is recorded as ('action', name) or
    ('guard', name, outcome) into the list returned (swap its contents between runs). A guard asked again
    with the same outcome right after itself is recorded once: how many of an edge pair's candidates are
    tried before the one taken is the dispatcher's business, the outcomes are the spec's."""
    calls = []

    def spy(kind, name, fn):
        def recorded(ctx):
            out = fn(ctx)
            entry = (kind, name) if kind == "action" else (kind, name, out)
            if kind == "action" or not calls or calls[-1] != entry:
                calls.append(entry)
            return out
        return recorded

    for kind, table in (("action", actions.ACTIONS), ("guard", actions.GUARDS)):
        for name, fn in list(table.items()):
            monkeypatch.setitem(table, name, spy(kind, name, fn))
    return calls


def _one_commit_per_update(calls: list) -> list:
    """`calls` (action calls of a run taking every edge) without a `commit_update` repeated inside one
    update (an update begins at `unscale_gradients`): the spec commits an applied update after its step and
    again at the update's end, where it sets the same fields."""
    kept, committed = [], False
    for call in calls:
        if call[1] == "unscale_gradients":
            committed = False
        if call[1] == "commit_update":
            if committed:
                continue
            committed = True
        kept.append(call)
    return kept


@pytest.mark.parametrize("case", list(FUSED_CASES))
def test_a_fused_run_is_the_unfused_run_with_each_fused_edge_expanded(case, monkeypatch):
    """Each fused edge is its path in one: the same trace once expanded; the same registry actions called in
    the same order, less those the configuration leaves out, with the same guard outcomes (a spy on every
    action and guard, wrapped before the compiled micro-batch is made); and bit-identical
    weights, learning rates, optimizer state, GradScaler scale and per-epoch metrics as a run taking every
    edge; with ragged tail windows, fp16 overflow skips (inf gradients) and fp32 NaN-loss skips."""
    precision, k, nonfinite, poisoned = FUSED_CASES[case]
    runs, calls = {}, _spy_on_registry(monkeypatch)
    spied = {}
    for fuse in (True, False):
        calls.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
        sgd = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        opt = Optimizer(sgd, torch.optim.lr_scheduler.StepLR(sgd, step_size=3, gamma=0.5), sched_on="step")

        def loss_fn(out, y, t=None):
            loss = F.cross_entropy(out, y)
            bad = precision != "fp16" and (t.loop.epoch, t.loop.batch_idx) in poisoned
            return loss * float("nan") if bad else loss

        t = Trainer(model, loss_fn, opt, device="cpu", epochs=2, log_batch=False, show_info=False,
                    metrics=[Accuracy()], precision=precision, gradient_accumulation_steps=k, nonfinite=nonfinite,
                    fuse_steps=fuse)
        loss_fn.__defaults__ = (t,)
        if precision == "fp16":  # inf gradients (a torch tensor hook, which does not stop fusing)
            t.scaler.load_state_dict({"scale": 256.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                                      "growth_interval": 2000, "_growth_tracker": 0})
            model[0].weight.register_hook(
                lambda g, t=t: g * float("inf") if (t.loop.epoch, t.loop.batch_idx) in poisoned else g)
        t._console.enabled = False
        t.machine.history = collections.deque()
        records = t.fit(_data(52, 8), _data(20, 8, seed=1))  # 7 batches, the last one ragged
        runs[fuse] = (t, records, t.test(_data(20, 8, seed=2)))
        spied[fuse] = list(calls)
    (fused, fused_records, fused_test), (plain, plain_records, plain_test) = runs[True], runs[False]
    fused_trace, plain_trace = _recorded(fused), _recorded(plain)
    fused_triggers = {trigger for _, trigger, _ in fused_trace}
    assert ("window_step" if k == 1 else "update_step") in fused_triggers
    assert ("accumulate_step" in fused_triggers) == (k > 1)
    assert (("window_skip_step" if k == 1 else "skip_step") in fused_triggers) == bool(poisoned)
    assert not {t.trigger for t in SPEC.transitions if t.fuses} & {t for _, t, _ in plain_trace}
    assert _expand_fused(fused_trace) == plain_trace
    assert {c[1] for c in spied[True] if c[0] == "action"} >= {"open_window", "unscale_gradients",
                                                              "step_optimizer", "commit_update", "close_window"}
    # The compiled micro-batch calls the same actions in the same order, less those the configuration makes
    # do nothing (named in its source) and less the second commit of an update that committed when its
    # optimizer stepped (it commits each update once), and asks each guard where the fused paths part: a
    # subsequence of the guard outcomes of the run taking every edge.
    left_out = set(actions.folded(fused._ctx.parts))
    assert left_out == {"sync_gradients", "skip_gradient_sync", "clip_gradients", "average_update"} | (
        set() if precision == "fp16" else {"update_scaler"})
    plain_actions = [c for c in spied[False] if c[0] == "action" and c[1] not in left_out]
    assert [c for c in spied[True] if c[0] == "action"] == _one_commit_per_update(plain_actions)
    assert plain_actions.count(("action", "commit_update")) > spied[True].count(("action", "commit_update"))
    assert spied[True].count(("action", "commit_update")) == spied[True].count(("action", "unscale_gradients"))
    guards = iter([c for c in spied[False] if c[0] == "guard"])
    assert all(c in guards for c in spied[True] if c[0] == "guard")  # in order
    assert ("guard", "grads_finite", True) in spied[True]
    np.testing.assert_equal(fused_records, plain_records)  # NaN-aware: a skipped NaN loss still counts
    np.testing.assert_equal(fused_test, plain_test)
    assert fused.opt.lrs() == plain.opt.lrs()
    for p, q in zip(fused.raw_model.parameters(), plain.raw_model.parameters()):
        assert torch.equal(p, q)
    for a, b in zip(fused.opt[0].opt.state.values(), plain.opt[0].opt.state.values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
    if precision == "fp16":
        assert fused.scaler.get_scale() == plain.scaler.get_scale()
        assert (fused.scaler.get_scale() < 256.0) == bool(poisoned)  # halved on overflow, else kept


class TwoOptimizerTrainer(TrainerBase):
    """A custom step with two losses and two optimizers, each optimizing its own half."""

    def train_step(self, batch_x, batch_y, **step_args):
        out = self.model(batch_x)
        self.loss(out, batch_y, do_optimize=False)
        self.optimize(optimize_index=0)
        out = self.model(batch_x)
        self.loss(out, batch_y, do_optimize=False)
        self.optimize(optimize_index=1)


def test_two_optimizers_and_several_tasks_follow_the_spec_trace():
    """Multi-optimizer custom steps and two training tasks produce the spec's trace."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 2))
    opts = [torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[1].parameters(), lr=0.1)]
    t = TwoOptimizerTrainer(model, F.cross_entropy, opts, device="cpu", epochs=2, log_batch=False,
                            show_info=False, gradient_accumulation_steps=2)
    t._console.enabled = False
    t.machine.history = collections.deque()
    t.fit(train_tasks=[EpochTask(_data(24, 8)), EpochTask(_data(16, 8, seed=1))])
    walker = SpecWalker()
    expected_fit(walker, 2, [3, 2], [], k=2, updates=((0,), (1,)))
    assert _recorded(t) == walker.trace


class FailAt(Callback):
    def __init__(self, batch):
        self.batch = batch

    def on_after_backward(self, trainer, loss):
        if trainer.loop.batch_idx == self.batch and trainer.loop.epoch == 1:
            raise RuntimeError("injected")


def test_an_interrupted_fit_follows_the_interrupt_and_recover_edges():
    """An error in a step leads through interrupt -> rollback -> recover -> idle, all spec edges."""
    t = _trainer(epochs=1, callbacks=[FailAt(2)])
    with pytest.raises(RuntimeError, match="injected"):
        t.fit(_data(24, 8))
    recorded = _recorded(t)
    assert set(recorded) <= EDGES
    assert recorded[-2:] == [("step_backward", "interrupt", "rollback"), ("rollback", "recover", "idle")]
    assert t.machine.state == "idle"


class HookRecorder(Callback):
    """Records (hook, machine state) for every hook of the spec."""

    def __init__(self):
        self.seen = []

    def __getattribute__(self, name):
        if name.startswith("on_") and name not in ("on_attach", "on_close"):
            seen = object.__getattribute__(self, "seen")

            def record(trainer, *args):
                seen.append((name, trainer.machine.state))

            return record
        return object.__getattribute__(self, name)


for _hook in SPEC.hooks:  # make every hook count as overridden
    setattr(HookRecorder, _hook.name, lambda self, trainer, *args: None)


def test_every_hook_runs_in_a_state_the_spec_allows():
    """Each hook fires while the machine is in one of the states its spec record names."""
    rec = HookRecorder()
    t = _trainer(epochs=2, callbacks=[rec], gradient_accumulation_steps=2)
    t.fit(_data(24, 8), _data(16, 8))
    t.test(_data(16, 8))
    allowed = {h.name: set(h.states) for h in SPEC.hooks}
    assert rec.seen, "no hooks recorded"
    for name, state in rec.seen:
        assert state in allowed[name], (name, state)
    names = [n for n, _ in rec.seen]
    assert names[0] == "on_before_fit" and "on_after_fit" in names and names[-1] == "on_after_test_epochs"


def test_on_an_accelerator_the_finite_check_stays_on_the_device_until_the_task_ends(monkeypatch):
    """Where a value read per update would sync a device (CUDA), nonfinite='raise' keeps the finite check on
    the device and reads it once per task. Forced here on the CPU: fused and every-edge runs give
    the same weights and loss, and an inf loss raises at the task's end instead of at its update."""
    from deepepochs.engine import finite

    def run(fuse, bad_batch=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))

        def loss_fn(out, y, t=None):
            loss = F.cross_entropy(out, y)
            return loss * float("inf") if t.loop.batch_idx == bad_batch else loss

        t = Trainer(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.2), device="cpu", epochs=2,
                    log_batch=False, show_info=False, gradient_accumulation_steps=2, fuse_steps=fuse)
        loss_fn.__defaults__ = (t,)
        t._console.enabled = False
        return t

    monkeypatch.setattr(finite, "reads_on_host", lambda value: False)
    device_sums, plain = run(True), run(False)
    records, plain_records = device_sums.fit(_data(52, 8)), plain.fit(_data(52, 8))
    assert isinstance(device_sums.history["train"]["loss"][0], float)
    assert records == plain_records
    for p, q in zip(device_sums.raw_model.parameters(), plain.raw_model.parameters()):
        assert torch.equal(p, q)
    flagged = run(True, bad_batch=3)
    with pytest.raises(FloatingPointError, match="checks at the task's end"):
        flagged.fit(_data(52, 8))
    assert flagged.machine.state == "idle"


class PlaceRecorder(HookRecorder):
    """Records (hook, how many transitions were recorded when it fired)."""

    def __getattribute__(self, name):
        if name.startswith("on_") and name not in ("on_attach", "on_close"):
            seen = object.__getattribute__(self, "seen")

            def record(trainer, *args):
                seen.append((name, len(trainer.machine.history)))

            return record
        return object.__getattribute__(self, name)


def _check_places(trainer, seen):
    """Each hook fired right after the edge its spec record names (`after`), or right before it (`before`)."""
    history = list(trainer.machine.history)
    hooks = {h.name: h for h in SPEC.hooks}
    assert seen
    for name, at in seen:
        hook = hooks[name]
        if hook.after is not None:
            assert at > 0 and history[at - 1][3] == hook.after, (name, history[at - 1] if at else None)
        else:
            assert at < len(history) and history[at][3] == hook.before, (name, history[at:at + 1])


@pytest.mark.parametrize("k", [1, 2])
def test_every_hook_fires_at_the_edge_the_spec_names(k):
    """Each hook fires after (or before) the edge its spec record names, in fit, validation and test."""
    rec = PlaceRecorder()
    t = _trainer(epochs=2, callbacks=[rec], gradient_accumulation_steps=k)
    t.fit(_data(24, 8), _data(16, 8))
    t.test(_data(16, 8))
    _check_places(t, rec.seen)
    assert {h.name for h in SPEC.hooks} - {n for n, _ in rec.seen} == {"on_skip_optimize", "on_rollback",
                                                                       "on_interrupted"}


def test_the_skip_and_rollback_hooks_fire_at_the_edges_the_spec_names():
    """A skipped update fires its hook after apply_update; a fault fires on_rollback after interrupt and
    on_interrupted after recover."""
    rec = PlaceRecorder()
    t = _trainer(epochs=1, callbacks=[rec], nonfinite="skip")
    loss_fn = t.loss_fn
    t.loss_fn = lambda out, y: loss_fn(out, y) * (float("nan") if t.loop.batch_idx == 2 else 1.0)

    def fail(module, args):
        if t.loop.batch_idx == 3:
            raise KeyError("injected")

    t.raw_model.register_forward_pre_hook(fail)
    with pytest.raises(KeyError):
        t.fit(_data(32, 8))
    _check_places(t, rec.seen)
    names = [n for n, _ in rec.seen]
    assert {"on_skip_optimize", "on_rollback", "on_interrupted"} <= set(names)
