"""The engine names states, triggers and hooks by the spec's strings; every such name it uses must be one
the spec defines, so a rename in spec/loop.py fails here instead of at run time."""

import ast
from pathlib import Path

from deepepochs.engine import batches, compiled, driver, steps
from deepepochs.fsm.machine import load_spec

SPEC = load_spec()
ENGINE = Path(steps.__file__).resolve().parent
MOVES = {"hop", "fire", "fire_cold", "record"}


GENERATED = {"tables.py", "events.py"}  # deepepochs/fsm/: rendered from the spec
STATES = {s.name for s in SPEC.states}
TRIGGERS = {t.name for t in SPEC.triggers}
HOOKS = {h.name for h in SPEC.hooks}
REGISTRY_NAMES = {g.name for g in SPEC.guards} | {a.name for a in SPEC.actions}


def _moves(node):
    """Whether `node` calls a machine move or fires a hook."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in MOVES | {"emit"}


def _spec_literals(package):
    """(file, line, name) of string literals under `package` (the generated tables aside) that spell a spec
    state, trigger, hook, guard or action where they name one: given to a machine move or `emit`, compared
    with a machine state or a move's result, a registry or hook-table key; and a hook name or a layered
    state name (`window_open`) anywhere."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.parent.name == "fsm" and path.name in GENERATED:
            continue
        where = str(path.relative_to(package))
        for node in ast.walk(ast.parse(path.read_text())):
            named = []
            if _moves(node) and node.args:
                named.append(node.args[0])
            elif isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(_moves(s) or (isinstance(s, ast.Attribute) and s.attr == "state") for s in sides):
                    named += sides
            elif isinstance(node, ast.Subscript):
                table = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
                if table in ("ACTIONS", "GUARDS", "by_event", "hooks"):
                    named.append(node.slice)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    node.value in HOOKS or (node.value in STATES and "_" in node.value)):
                found.append((where, node.lineno, node.value))
            for arg in named:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and (
                        arg.value in STATES | TRIGGERS | HOOKS | REGISTRY_NAMES):
                    found.append((where, arg.lineno, arg.value))
    return sorted(set(found))


def test_the_package_names_spec_states_triggers_and_hooks_through_the_generated_enums():
    """No state, trigger, hook, guard or action name is a string literal where the package uses it as one:
    call sites take it from `StateName`, `TriggerName`, `Event`, `GuardName`, `ActionName` (a rename in
    spec/loop.py then fails at import, not at run time)."""
    assert _spec_literals(ENGINE.parent) == []


def test_the_literal_check_finds_a_trigger_a_state_a_hook_and_an_action(tmp_path):
    """The check above finds each kind of literal it looks for, and not a stage name (so its empty result
    means something)."""
    (tmp_path / "x.py").write_text(
        "machine.fire('begin_batch')\nif machine.state == 'idle': pass\nemit(ctx, 'on_before_fit')\n"
        "ACTIONS['reset_loop'](ctx)\nSTATE = 'window_open'\nstage = 'test'\n")
    found = [value for _, _, value in _spec_literals(tmp_path)]
    assert found == ["begin_batch", "idle", "on_before_fit", "reset_loop", "window_open"]


def test_every_trigger_and_state_the_engine_uses_is_one_of_the_spec():
    """The plain-string names the hot modules keep (an Enum member lookup costs ~0.5 us) and the compiled
    code's table come from the generated enums, so each is a spec name."""
    used = {steps.BACKWARD, steps.OPTIMIZE, steps.CLIP, steps.APPLY_UPDATE, steps.FINISH_UPDATE,
            batches.BEGIN_WINDOW, batches.BEGIN_BATCH, batches.END_BATCH, *compiled.STEP_CODE}
    assert used <= TRIGGERS
    assert {steps.OPTIMIZE_UNSCALED, compiled.ONE_BATCH_WINDOW, compiled.IN_WINDOW} <= STATES


def test_every_hook_the_engine_runs_is_a_spec_hook():
    """The engine's per-stage hook tables name hooks of the spec."""
    derived = {name for names in (*steps.STEP_HOOKS.values(), *driver.STAGE_HOOKS.values(),
                                  *batches.BATCH_HOOKS.values()) for name in names}
    assert len(derived) == 27 and derived <= HOOKS, sorted(derived - HOOKS)


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
