"""The compiled micro-batch: code generated from the spec's fused edges per configuration runs each fused
path's registry actions in spec order (less those the configuration leaves out, each named with why), and
its source is readable and shown in tracebacks."""

import collections
import linecache
import traceback

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from deepepochs import GradClipCallback, Trainer
from deepepochs.engine import actions, compiled
from deepepochs.fsm.machine import load_spec

SPEC = load_spec()
FUSED = {t.trigger: t for t in SPEC.transitions if t.fuses}


def _data(n, batch, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    y = (x[:, 0] > 0).long()
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, n, batch)]


def _trainer(poisoned=(), **kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.2), nn.Linear(8, 2))

    def loss_fn(out, y, t=None):
        loss = F.cross_entropy(out, y)
        return loss * float("nan") if (t.loop.epoch, t.loop.batch_idx) in poisoned else loss

    t = Trainer(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu", epochs=2,
                log_batch=False, show_info=False, nonfinite="skip", **kw)
    loss_fn.__defaults__ = (t,)
    t._console.enabled = False
    t.machine.history = collections.deque()
    return t


CONFIGURATIONS = {  # name: Trainer arguments
    "fp32-k1": {},
    "fp32-k3": {"gradient_accumulation_steps": 3},
    "bf16-k2-clip": {"precision": "bf16", "gradient_accumulation_steps": 2, "callbacks": [GradClipCallback(1.0)]},
    "fp16-k1-clip": {"precision": "fp16", "callbacks": [GradClipCallback(1.0)]},
    "fp16-k3": {"precision": "fp16", "gradient_accumulation_steps": 3},
}


def _path_actions(fused, left_out) -> list:
    """(action, state it runs in) along `fused`'s spec path, less the actions `left_out` and a commit action
    met again after it ran (the commit after an applied step makes the one at the update's end a repeat)."""
    commits = {a.name for a in SPEC.actions if a.commit}
    done, expected = set(), []
    for edge in SPEC.fused_path(fused):
        for name in edge.actions:
            if name in left_out or name in done:
                continue
            done |= {name} & commits
            expected.append((name, edge.dest))
    return expected


@pytest.mark.parametrize("name", list(CONFIGURATIONS))
def test_a_side_effect_added_to_any_action_reaches_every_compiled_path(name, monkeypatch):
    """Each registry action is given a new side effect (it records itself and the state it runs in)
    before the trainer is built; every fused edge the compiled run takes ran exactly its spec path's
    actions, in order, each in the state its edge leads to, less the actions the configuration leaves out
    and a commit action's second place on the path (an update commits once)."""
    seen = []
    trainer = None

    def with_side_effect(name, fn):
        def run(ctx):
            seen.append((name, ctx.machine.state))
            return fn(ctx)
        return run

    for action_name, fn in list(actions.ACTIONS.items()):
        monkeypatch.setitem(actions.ACTIONS, action_name, with_side_effect(action_name, fn))
    trainer = _trainer(poisoned=((1, 2), (2, 5)), **CONFIGURATIONS[name])
    left_out = actions.folded(trainer._ctx.parts)
    machine = trainer.machine
    taken = collections.Counter()
    marks = []  # (index into `seen` when each recorded edge was appended)
    record = machine.record

    def marked(source, trigger, dest):
        marks.append((len(seen), trigger))
        record(source, trigger, dest)

    monkeypatch.setattr(machine, "record", marked)
    for move in ("fire", "fire_cold"):  # edges fired one by one: their actions are not a fused edge's
        def fire(trigger, move=getattr(machine, move)):
            dest = move(trigger)
            marks.append((len(seen), None))
            return dest

        monkeypatch.setattr(machine, move, fire)
    trainer.fit(_data(56, 8))  # 7 batches: a ragged tail window for k=2 and k=3
    start = 0
    for end, trigger in marks:
        if trigger is not None:
            expected = _path_actions(FUSED[trigger], left_out)
            assert seen[start:end] == expected, trigger
            taken[trigger] += 1
        start = end
    k = CONFIGURATIONS[name].get("gradient_accumulation_steps", 1)
    assert set(taken) == ({"window_step", "window_skip_step"} if k == 1
                          else {"accumulate_step", "update_step", "skip_step"})
    assert bool(CONFIGURATIONS[name].get("callbacks")) != ("clip_gradients" in left_out)


@pytest.mark.parametrize("name", list(CONFIGURATIONS))
def test_the_compiled_source_names_every_hop_and_every_action_left_out(name):
    """The source `explain` returns has, for every fused edge of the spec, a comment per hop naming its
    trigger and states, and per action either a call or a comment saying it is left out and why."""
    trainer = _trainer(**CONFIGURATIONS[name])
    text = compiled.explain(trainer._ctx)
    left_out = actions.folded(trainer._ctx.parts)
    for fused in FUSED.values():
        assert f"'{fused.trigger}'" in text
        for hop in SPEC.fused_path(fused):
            assert f"# {hop.trigger}" in text and f"model.state = {hop.dest!r}" in text
            for action in hop.actions:
                if action in left_out:
                    assert f"# {action}(ctx): left out ({left_out[action]})" in text
                else:
                    assert f"\n{' ' * 8}{action}(ctx)" in text or f"    {action}(ctx)\n" in text
    assert ("with autocast():" in text) == (CONFIGURATIONS[name].get("precision", "fp32") != "fp32")


def test_an_error_inside_a_compiled_micro_batch_shows_the_generated_line_and_rolls_back(monkeypatch):
    """A traceback through a compiled micro-batch shows its generated source line (registered in
    linecache); the fit rolls back to idle as from any other state."""
    def failing(ctx):
        raise RuntimeError("boom")

    monkeypatch.setitem(actions.ACTIONS, "zero_grad", failing)
    trainer = _trainer()
    with pytest.raises(RuntimeError, match="boom") as info:
        trainer.fit(_data(24, 8))
    frames = [f for f in traceback.extract_tb(info.value.__traceback__) if "compiled micro-batch" in f.filename]
    assert frames and frames[-1].line == "zero_grad(ctx)"
    assert linecache.getline(frames[-1].filename, frames[-1].lineno).strip() == "zero_grad(ctx)"
    assert trainer.machine.state == "idle"


def test_compiling_is_off_where_a_hook_observes_a_micro_batch():
    """A callback hook inside a micro-batch turns the compiled path off: every edge is recorded."""
    from deepepochs import Callback

    class Watch(Callback):
        def on_after_backward(self, trainer, loss):
            pass

    trainer = _trainer(callbacks=[Watch()])
    trainer.fit(_data(24, 8))
    triggers = {r.trigger for r in trainer.machine.records()}
    assert not triggers & set(FUSED) and "backward" in triggers


def test_the_micro_batch_page_shows_the_code_a_default_trainer_runs():
    """docs/micro-batch.md (rendered by `make gen`) holds, verbatim, the compiled source `explain` gives
    for a default trainer (fp32, one process, no clipper)."""
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "micro-batch.md"
    if not page.exists():
        pytest.skip("no docs/ beside the package (an installed copy)")
    model = nn.Linear(2, 2)
    trainer = Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu", show_info=False,
                      log_batch=False)
    assert compiled.explain(trainer._ctx) in page.read_text()


@pytest.mark.parametrize("name, options", [("fp32-k1", {}), ("bf16-k2-clip", {"precision": "bf16", "clipper": True}),
                                          ("fp16-k1-clip", {"precision": "fp16", "clipper": True})])
def test_trainer_explain_is_the_code_its_batches_run_and_what_the_loop_command_prints(name, options):
    """`trainer.explain()` ends with the source its training batches run (the generated line a failing
    action raises from is in it), which is what `python -m deepepochs loop` prints for the same options."""
    trainer = _trainer(**CONFIGURATIONS[name])
    text = trainer.explain()
    assert text.endswith("\n" + compiled.describe(**options))
    calls = []
    original = actions.ACTIONS["zero_grad"]

    def spy(ctx):
        calls.append(traceback.extract_stack()[-2])
        return original(ctx)

    actions.ACTIONS["zero_grad"] = spy
    try:
        trainer.fit(_data(24, 8))
    finally:
        actions.ACTIONS["zero_grad"] = original
    compiled_frames = [f for f in calls if "compiled micro-batch" in f.filename]
    assert compiled_frames, "the default configuration runs the compiled micro-batch"
    source = "".join(linecache.getlines(compiled_frames[0].filename))
    assert source and source in text
