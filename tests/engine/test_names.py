"""The engine names states, triggers and hooks by the spec's strings; every such name it uses must be one
the spec defines, so a rename in spec/loop.py fails here instead of at run time."""

import ast
from pathlib import Path

from deepepochs.engine import batches, driver, steps
from deepepochs.fsm.machine import load_spec

SPEC = load_spec()
ENGINE = Path(steps.__file__).resolve().parent
MOVES = {"hop", "fire", "fire_cold", "record"}


def _literals(kind):
    """(file, line, name) of string literals the engine passes to a machine move (`kind='trigger'`) or
    uses to index the hook table (`kind='hook'`)."""
    found = []
    for path in sorted(ENGINE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if kind == "trigger" and isinstance(node, ast.Call) and node.args:
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                arg = node.args[0]
                if name in MOVES and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.append((path.name, node.lineno, arg.value))
            if kind == "hook" and isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                value = node.slice.value
                if isinstance(value, str) and value.startswith("on_"):
                    found.append((path.name, node.lineno, value))
    return found


def test_every_trigger_the_engine_fires_is_a_spec_trigger():
    """Each literal trigger given to fire/hop/fire_cold/record is a spec trigger."""
    triggers = {t.name for t in SPEC.triggers}
    used = _literals("trigger")
    assert len(used) > 15, used
    assert [u for u in used if u[2] not in triggers] == []


def test_every_hook_the_engine_runs_is_a_spec_hook():
    """The engine's per-stage hook tables name hooks of the spec, and no hook name is a literal there."""
    hooks = {h.name for h in SPEC.hooks}
    assert _literals("hook") == []
    derived = {name for names in (*steps.STEP_HOOKS.values(), *driver.STAGE_HOOKS.values(),
                                  *batches.BATCH_HOOKS.values()) for name in names}
    assert len(derived) == 27 and derived <= hooks, sorted(derived - hooks)


def test_the_fused_observers_are_the_hooks_of_the_fused_paths_inner_states():
    """FUSED_OBSERVERS comes from the hook table: the hooks that may run in a window/step/optimize state."""
    inner = {"window_open", "step_forward", "step_backward", "step_optimized", "optimize_unscaled",
             "optimize_clipped", "optimize_skipped", "task_train"}
    expected = {h.name for h in SPEC.hooks
                if {s for s in h.states if SPEC.state(s).layer in ("window", "step", "optimize")} & inner}
    assert set(batches.FUSED_OBSERVERS) == expected
    assert "on_before_backward" in expected and "on_after_train_epoch" not in expected


def test_hooks_are_fired_only_by_the_emit_function():
    """No module of the package loops over a hook table's handlers but `engine.emit`: every hook is fired by
    `emit`, where the spec says it fires."""
    package = ENGINE.parent
    loops = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "emit.py" and path.parent == ENGINE:
            continue
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.For, ast.comprehension)):
                text = ast.get_source_segment(source, node.iter) or ""
                if "by_event" in text or ("hooks[" in text and "spec" not in text):
                    loops.append((str(path.relative_to(package)), getattr(node, "lineno", None), text))
    assert loops == []


def test_the_engine_modules_import_each_other_without_a_cycle():
    """The engine's modules form no import cycle (imports inside functions counted): the random-state helpers
    and the non-finite check live below the registry, which alone imports `position`."""
    graph = {}
    for path in ENGINE.glob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "deepepochs.engine":
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("deepepochs.engine."):
                found.add(node.module.rsplit(".", 1)[1])
        graph[path.stem] = found

    def reaches(start, target, seen=()):
        return any(m == target or (m not in seen and reaches(m, target, (*seen, m))) for m in graph.get(start, ()))

    assert [m for m in graph if reaches(m, m)] == []
    assert "actions" not in graph["position"]
