"""Every spec guard and action has exactly one implementation, in the engine's registry, and the
machine calls the registry's functions (no other implementation is reachable)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepepochs import Trainer
from deepepochs.engine import actions
from deepepochs.fsm.machine import load_spec

SPEC = load_spec()


def test_the_registry_implements_exactly_the_specs_guards_and_actions():
    """Registry names equal the spec's names, guard for guard and action for action."""
    assert set(actions.GUARDS) == {g.name for g in SPEC.guards}
    assert set(actions.ACTIONS) == {a.name for a in SPEC.actions}
    actions.check_registry(SPEC)


def test_a_spec_action_without_an_implementation_is_refused(monkeypatch):
    """Removing one implementation makes the registry check name it as missing."""
    monkeypatch.delitem(actions.ACTIONS, "open_window")
    with pytest.raises(RuntimeError, match=r"actions without an implementation: \['open_window'\]"):
        actions.check_registry(SPEC)


def test_an_implementation_the_spec_does_not_name_is_refused(monkeypatch):
    """An extra registered guard is reported as not in the spec."""
    monkeypatch.setitem(actions.GUARDS, "always", lambda ctx: True)
    with pytest.raises(RuntimeError, match=r"implemented but not in the spec: \['always'\]"):
        actions.check_registry(SPEC)


def test_registering_a_name_twice_fails():
    """A second implementation of an existing action is refused at registration."""
    def open_window(ctx):
        return None

    with pytest.raises(RuntimeError, match="'open_window' is implemented twice"):
        actions.action(open_window)
    assert actions.ACTIONS["open_window"] is not open_window


@pytest.mark.parametrize("fuse_steps", [True, False])
def test_a_side_effect_added_to_an_action_is_seen_by_every_path(monkeypatch, fuse_steps):
    """Wrapping `open_window` in the registry changes what fused and every-edge runs do alike: the machine
    has no other copy of it."""
    opened = []
    original = actions.ACTIONS["open_window"]
    monkeypatch.setitem(actions.ACTIONS, "open_window", lambda ctx: (opened.append(ctx.loop.batch_idx), original(ctx)))
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    data = [(torch.randn(8, 4), torch.randint(0, 2, (8,))) for _ in range(5)]
    t = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), epochs=1, device="cpu",
                log_batch=False, show_info=False, gradient_accumulation_steps=2, fuse_steps=fuse_steps)
    t.fit(data)
    assert opened == [0, 2, 4]  # three windows: batches 1-2, 3-4, 5


def test_no_guard_or_action_reads_the_machines_state():
    """What an action does depends on the edge only through which actions the spec puts on it: no registered
    guard or action (nor a helper it calls by name in this module) reads the machine or its state."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(actions))
    reads = [(node.lineno, node.attr) for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr in ("machine", "state")]
    assert reads == []
