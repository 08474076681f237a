"""Structure of the generated tables and agreement of the two runtimes."""

import collections
import itertools
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from deepepochs.engine.context import LoopState, RunState
from deepepochs.errors import InvalidTransition
from deepepochs.fsm import codegen, tables
from deepepochs.fsm.events import ActionName, Event, GuardName, StateName, TriggerName
from deepepochs.fsm.machine import LoopMachine, build_machine, compile_table, load_spec, machine_edges
from deepepochs.fsm.schema import LAYERS, Action, Guard, Spec, SpecError, State, Transition, Trigger

ROOT = Path(__file__).resolve().parents[2]
SPEC = load_spec()


def _graph():
    out = collections.defaultdict(set)
    for t in SPEC.transitions:
        if t.dest is not None:
            out[t.source].add(t.dest)
    return out


def _reachable(start):
    graph, seen, todo = _graph(), {start}, [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_generated_tables_match_the_spec():
    """`python -m spec --check` passes: the committed tables are what the spec renders."""
    result = subprocess.run([sys.executable, "-m", "spec", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_files_carry_the_do_not_edit_header():
    """Both generated modules start with the header naming the command that made them."""
    for name in ("tables.py", "events.py"):
        text = (ROOT / "deepepochs" / "fsm" / name).read_text()
        assert text.startswith('"""GENERATED from spec/loop.py by `make gen`'), name


def test_tables_round_trip_to_the_source_spec():
    """spec/loop.py -> tables.py -> Spec gives back exactly the records of the source spec."""
    sys.path.insert(0, str(ROOT))
    try:
        from spec.loop import SPEC as SOURCE
    finally:
        sys.path.remove(str(ROOT))
    assert SPEC == SOURCE


def test_check_mode_reports_a_stale_file(tmp_path):
    """write_or_check with check=True lists files that differ and writes nothing."""
    (tmp_path / "fsm").mkdir()
    (tmp_path / "fsm" / "tables.py").write_text("stale\n")
    stale = codegen.write_or_check(SPEC, tmp_path, check=True)
    assert {p.name for p in stale} == {"tables.py", "events.py"}
    assert (tmp_path / "fsm" / "tables.py").read_text() == "stale\n"


def test_every_state_has_a_layer_and_a_doc_and_every_name_a_one_line_doc():
    """States are named by layer; every trigger, guard and action has a one-line description."""
    assert {s.layer for s in SPEC.states} <= set(LAYERS)
    for record in (*SPEC.states, *SPEC.triggers, *SPEC.guards, *SPEC.actions, *SPEC.transitions, *SPEC.hooks):
        assert record.doc and "\n" not in record.doc


def test_every_state_is_reachable_from_the_initial_state():
    """No dead states."""
    assert _reachable(SPEC.initial) == {s.name for s in SPEC.states}


def test_every_non_final_state_has_an_exit():
    """Every state has at least one edge to another state (the loop has no final state)."""
    graph = _graph()
    for state in SPEC.states:
        assert graph[state.name] - {state.name}, state.name


def test_guards_are_exclusive_and_total_for_every_state_and_trigger():
    """For each (state, trigger), exactly one edge matches every guard outcome."""
    pairs = {(t.source, t.trigger) for t in SPEC.transitions}
    for source, trigger in pairs:
        guards = SPEC.guards_of(source, trigger)
        for values in itertools.product((False, True), repeat=len(guards)):
            outcome = dict(zip(guards, values))
            assert sum(t.matches(outcome) for t in SPEC.edges(source, trigger)) == 1, (source, trigger, outcome)


def test_every_running_state_has_an_interrupt_edge_to_rollback():
    """An interrupt edge leads from every running state to rollback."""
    for state in SPEC.states:
        edges = SPEC.edges(state.name, SPEC.interrupt)
        if state.running:
            assert [t.dest for t in edges] == [SPEC.rollback], state.name
        else:
            assert edges == [], state.name


def test_rollback_always_returns_to_an_idle_state_that_accepts_fit_and_test():
    """Rollback leads only to idle states, from which fit and test can be called."""
    dests = {t.dest for t in SPEC.transitions if t.source == SPEC.rollback}
    assert dests and all(SPEC.state(d).idle for d in dests)
    for d in dests:
        assert {"fit", "test"} <= {t.trigger for t in SPEC.transitions if t.source == d}


def test_hot_triggers_are_the_per_batch_ones():
    """Exactly the window/step/optimize triggers (and the fused batch, the per-window snapshot commit point
    and the update clock's per-update `validate`) are hot; fit/epoch/stage/task ones are cold."""
    hot = {t.name for t in SPEC.triggers if t.hot}
    assert hot == {"begin_window", "begin_batch", "backward", "optimize", "clip", "apply_update",
                   "finish_update", "end_batch", "accumulate_step", "update_step", "skip_step", "window_step",
                   "window_skip_step", "snapshot", "validate"}


def test_only_one_module_imports_transitions():
    """Deepepochs/fsm/machine.py is the single adapter over `transitions`."""
    importers = [p.relative_to(ROOT).as_posix() for p in (ROOT / "deepepochs").rglob("*.py")
                 if "import transitions" in p.read_text() or "from transitions" in p.read_text()]
    assert importers == ["deepepochs/fsm/machine.py"]


def _machine_with(outcome):
    guards = {g.name: (lambda name=g.name: outcome[name]) for g in SPEC.guards}
    actions = {a.name: (lambda: None) for a in SPEC.actions}
    return build_machine(SPEC, guards, actions)


def test_machine_edges_equal_the_spec_edges():
    """The built transitions machine holds exactly the spec's edges (read back from its own structures)."""
    got = sorted(machine_edges(_machine_with({})), key=repr)
    want = sorted(((t.source, t.trigger, t.dest, t.conditions, t.unless, t.actions,
                    f"_error_{t.source}_{t.trigger}_{n}" if t.error else None)
                   for n, t in enumerate(SPEC.transitions)), key=repr)
    assert got == want


def test_compiled_table_agrees_with_transitions_on_every_state_trigger_and_guard_outcome():
    """Exhaustive comparison of accept/reject/error and the resulting state: for every state and trigger,
    every outcome of the guards its edges read (the other guards cannot change that pair's result; all of
    them at once would be 2**guards machines)."""
    outcome = {g.name: False for g in SPEC.guards}
    machine = _machine_with(outcome)
    model = machine.models[0]
    table = compile_table(machine)
    for state, trigger in itertools.product([s.name for s in SPEC.states], [t.name for t in SPEC.triggers]):
        read = sorted({g for t in SPEC.transitions if (t.source, t.trigger) == (state, trigger)
                       for g in (*t.conditions, *t.unless)})
        for values in itertools.product((False, True), repeat=len(read)):
            outcome.update(dict.fromkeys(outcome, False))
            outcome.update(zip(read, values))
            model.state = state
            try:
                ok = model.trigger(trigger)
                via_transitions = ("moved", model.state) if ok else ("refused", state)
            except InvalidTransition:
                via_transitions = ("error", state)
            except Exception as e:  # transitions' MachineError: no edge
                assert type(e).__name__ == "MachineError"
                via_transitions = ("invalid", state)
            edges = table.get((state, trigger))
            if edges is None:
                via_table = ("invalid", state)
            else:
                pred, dest, _acts, err = next(e for e in edges if e[0] is None or e[0]())
                via_table = ("error", state) if err is not None else ("moved", dest)
            assert via_transitions == via_table, (state, trigger, dict(zip(read, values)))


def test_invalid_trigger_names_the_state_the_trigger_and_the_allowed_triggers():
    """The error says where the machine is, what was fired and what would have been accepted."""
    guards = {g.name: (lambda: False) for g in SPEC.guards}
    actions = {a.name: (lambda: None) for a in SPEC.actions}
    m = LoopMachine(guards, actions, LoopState())
    with pytest.raises(InvalidTransition, match=r"'optimize' in state 'idle'.*allowed in 'idle': \['fit', 'test'\]"):
        m.fire("optimize")
    with pytest.raises(InvalidTransition, match=r"'finish' in state 'idle'"):
        m.fire_cold("finish")


def test_error_edge_raises_its_reason():
    """The explicit error edge (a window closed with unapplied gradients) raises its documented text."""
    outcome = {g.name: True for g in SPEC.guards}
    guards = {g: (lambda g=g, outcome=outcome: outcome[g]) for g in outcome}
    actions = {a.name: (lambda: None) for a in SPEC.actions}
    m = LoopMachine(guards, actions, LoopState(run=RunState(epoch=1), batch_idx=1))
    m.model.state = "step_backward"
    with pytest.raises(InvalidTransition, match="must call self.optimize"):
        m.fire("end_batch")
    assert m.state == "step_backward"


def test_each_error_edge_of_one_state_and_trigger_raises_its_own_reason():
    """(step_forward, optimize) has several error edges; each guard outcome raises its own edge's text."""
    errors = [t for t in SPEC.edges("step_forward", "optimize") if t.dest is None]
    assert len(errors) > 1
    actions = {a.name: (lambda: None) for a in SPEC.actions}
    for edge in errors:
        outcome = {g.name: g.name in edge.conditions for g in SPEC.guards}
        guards = {g: (lambda g=g, outcome=outcome: outcome[g]) for g in outcome}
        m = LoopMachine(guards, actions, LoopState(run=RunState(epoch=1), batch_idx=1))
        m.model.state = "step_forward"
        with pytest.raises(InvalidTransition) as raised:
            m.fire("optimize")
        assert str(raised.value) == f"state 'step_forward', trigger 'optimize': {edge.error}"


def test_an_edge_taken_by_compiled_code_is_recorded_once_and_probed_once():
    """`LoopMachine.record` (what a compiled micro-batch calls at its end) adds one flight-record entry with
    the loop's epoch and batch, and calls the probe once with the state reached."""
    guards = {g.name: (lambda: True) for g in SPEC.guards}
    loop = LoopState(run=RunState(epoch=2), batch_idx=7)
    m = LoopMachine(guards, {a.name: (lambda: None) for a in SPEC.actions}, loop)
    probed = []
    m.probe = probed.append
    m.record("window_open", "update_step", "task_train")
    assert [tuple(r) for r in m.records()] == [(2, 7, "window_open", "update_step", "task_train")]
    assert probed == ["task_train"]


def test_spec_validation_rejects_overlapping_guards():
    """A spec whose edges both match one guard outcome is refused with the offending pair."""
    states = [State("idle", "fit", "Idle.", idle=True, running=False), State("a", "fit", "A."),
              State("rollback", "rollback", "R.", running=False)]
    triggers = [Trigger("go", "Go."), Trigger("interrupt", "I."), Trigger("recover", "R.")]
    edges = [Transition("go", "idle", "a", "One."), Transition("go", "idle", "idle", "Two.")]
    with pytest.raises(SpecError, match=r"\(idle, go\).*2 edges match"):
        Spec(states, triggers, [], [], edges, []).validate()


def test_fused_edges_stand_for_whole_micro_batches():
    """accumulate_step is an inner micro-batch; update_step/skip_step a window's last micro-batch whose
    update is applied/skipped; window_step a one-batch window that updated: exactly the hot edges the
    unfused loop takes for them."""
    fused = {t.trigger: [(e.source, e.trigger, e.dest) for e in SPEC.fused_path(t)]
             for t in SPEC.transitions if t.fuses}
    assert fused["accumulate_step"] == [
        ("window_open", "begin_batch", "step_forward"), ("step_forward", "backward", "step_backward"),
        ("step_backward", "optimize", "step_backward"), ("step_backward", "end_batch", "window_open")]
    head = [("window_open", "begin_batch", "step_forward"), ("step_forward", "backward", "step_backward"),
            ("step_backward", "optimize", "optimize_unscaled"), ("optimize_unscaled", "clip", "optimize_clipped")]
    assert fused["update_step"] == [*head, ("optimize_clipped", "apply_update", "optimize_clipped"),
                                    ("optimize_clipped", "finish_update", "step_optimized"),
                                    ("step_optimized", "end_batch", "task_train")]
    assert fused["skip_step"] == [*head, ("optimize_clipped", "apply_update", "optimize_skipped"),
                                  ("optimize_skipped", "finish_update", "step_optimized"),
                                  ("step_optimized", "end_batch", "task_train")]
    assert fused["window_step"] == [("task_train", "begin_window", "window_open"), *fused["update_step"]]
    actions = {trigger: [a for t in SPEC.transitions if t.trigger == trigger and t.fuses
                         for e in SPEC.fused_path(t) for a in e.actions] for trigger in fused}
    assert actions["accumulate_step"] == ["count_micro_batch", "skip_gradient_sync"]
    assert "step_optimizer" in actions["update_step"] and "skip_optimizer" not in actions["update_step"]
    assert "skip_optimizer" in actions["skip_step"] and "step_optimizer" not in actions["skip_step"]


def _fused_spec(**edge):
    states = [State("idle", "fit", "Idle.", idle=True, running=False), State("a", "step", "A."),
              State("b", "step", "B."), State("rollback", "rollback", "R.", running=False)]
    triggers = [Trigger("go", "Go.", hot=True), Trigger("on", "On.", hot=True), Trigger("both", "Both.", hot=True),
                Trigger("interrupt", "I."), Trigger("recover", "R.")]
    edges = [Transition("go", "idle", "a", "Go."), Transition("on", "a", "b", "On.", conditions=["ok"]),
             Transition("on", "a", "a", "Stay.", unless=["ok"]), Transition("both", "idle", "b", "Both.", **edge)]
    return Spec(states, triggers, [Guard("ok", "Ok.")], [Action("x", "X.")], edges, [])


def test_spec_validation_walks_fused_edges():
    """A fused edge must reach its destination along its path with its assumed guards, and do nothing else."""
    assert _fused_spec(fuses=["go", "on"], assuming=["ok"]).validate()
    with pytest.raises(SpecError, match="its path ends in 'a'"):
        _fused_spec(fuses=["go", "on"]).validate()  # with ok false the path stays in a
    with pytest.raises(SpecError, match="no edge for 'go' from 'a'"):
        _fused_spec(fuses=["go", "go"], assuming=["ok"]).validate()
    with pytest.raises(SpecError, match="no guards, actions or error"):
        _fused_spec(fuses=["go", "on"], assuming=["ok"], actions=["x"]).validate()
    with pytest.raises(SpecError, match="assuming needs fuses"):
        _fused_spec(assuming=["ok"]).validate()


def _runs_commit(edge):
    return any(a.name in edge.actions for a in SPEC.actions if a.commit)


def test_commit_actions_are_last_on_the_edges_that_commit_updates_and_epochs():
    """A commit action ends every edge that runs it, but for after-commit actions (a held Ctrl-C raised once
    the update is committed): the stepping apply_update edges and finish_update edges end with
    commit_update, the end_epoch edges with commit_epoch, the end_stage edges leaving a validation point of
    the update clock with commit_val_point, the end_statistics edge leaving the BatchNorm pass with
    commit_statistics; no other edge commits."""
    commit = {a.name for a in SPEC.actions if a.commit}
    after = {a.name for a in SPEC.actions if a.after_commit}
    assert commit == {"commit_update", "commit_epoch", "commit_val_point", "commit_statistics"}
    assert after == {"release_interrupts"}
    for t in SPEC.transitions:
        body = [a for a in t.actions if a not in after]
        assert not set(body[:-1]) & commit, (t.source, t.trigger, t.actions)
        assert t.actions[:len(body)] == tuple(body), (t.source, t.trigger, t.actions)
    ends = {(t.source, t.trigger, t.actions) for t in SPEC.transitions if _runs_commit(t)}
    optimizing = ("optimize_clipped", "optimize_skipped")
    finish = ("update_scaler", "zero_grad", "remember_position", "average_update", "commit_update",
              "release_interrupts")
    assert ends == {
        *((source, "apply_update", ("step_optimizer", "commit_update")) for source in optimizing),
        *((source, "finish_update", finish) for source in optimizing),
        ("epoch_end", "end_epoch", ("step_epoch_schedulers", "average_epoch", "save_checkpoints", "commit_epoch")),
        ("epoch_end", "end_epoch", ("step_epoch_schedulers", "average_epoch", "commit_epoch")),
        ("stage_val", "end_stage", ("step_epoch_schedulers", "save_checkpoints", "commit_val_point")),
        ("fit_statistics", "end_statistics", ("commit_statistics",)),
    }


def test_commit_edges_list_every_edge_and_every_fused_edge_whose_path_commits():
    """`Spec.commit_edges()` holds the edges running a commit action and each fused edge with such an edge on
    its path (every fused edge that ends a window), and no other edge."""
    want = [t for t in SPEC.transitions
            if _runs_commit(t) or (t.fuses and any(_runs_commit(e) for e in SPEC.fused_path(t)))]
    assert SPEC.commit_edges() == want
    assert {t.trigger for t in want if t.fuses} == {"update_step", "skip_step", "window_step", "window_skip_step"}
    assert all(SPEC.commits(t) == (t in want) for t in SPEC.transitions)


def test_spec_validation_rejects_a_commit_action_that_is_not_last():
    """A commit action followed by another action on its edge is refused, naming the action and the edge."""

    def spec(edge_actions):
        return attrs.evolve(_fused_spec(actions=edge_actions), actions=[Action("x", "X."),
                                                                         Action("c", "C.", commit=True)])

    assert spec(["x", "c"]).validate().commit_edges()[0].trigger == "both"
    with pytest.raises(SpecError, match=r"edge idle --both--> b: commit action 'c' must be the edge's last action"
                                        r" but for after-commit ones \(got actions \['c', 'x'\]\)"):
        spec(["c", "x"]).validate()


def test_an_after_commit_action_may_only_follow_a_commit_action():
    """An action marked after_commit may end an edge after its commit action, and nowhere else."""

    def spec(edge_actions):
        return attrs.evolve(_fused_spec(actions=edge_actions), actions=[
            Action("x", "X."), Action("c", "C.", commit=True), Action("r", "R.", after_commit=True)])

    assert spec(["x", "c", "r"]).validate().commit_edges()[0].trigger == "both"
    with pytest.raises(SpecError, match="after-commit action 'r' must follow a commit action"):
        spec(["x", "r"]).validate()
    with pytest.raises(SpecError, match="after-commit action 'r' must follow the edge's commit action"):
        spec(["r", "c"]).validate()
    with pytest.raises(SpecError, match="commit action 'c' must be the edge's last action"):
        spec(["c", "x", "r"]).validate()


def test_name_enums_list_the_spec_names_in_spec_order():
    """StateName, TriggerName, GuardName and ActionName hold the spec's names in order as values, each under
    its upper-case name; Event holds the hook names in order."""
    for enum_type, records in ((StateName, SPEC.states), (TriggerName, SPEC.triggers), (GuardName, SPEC.guards),
                               (ActionName, SPEC.actions)):
        assert [m.value for m in enum_type] == [r.name for r in records], enum_type.__name__
        assert [m.name for m in enum_type] == [r.name.upper() for r in records], enum_type.__name__
        assert all(isinstance(m, str) for m in enum_type)
    assert [e.value for e in Event] == [h.name for h in SPEC.hooks]


def test_hook_names_come_from_the_spec():
    """Event values, Callback methods and spec hooks are the same set, with the spec's args."""
    import inspect

    from deepepochs import Callback, Event

    hooks = {h.name: h for h in SPEC.hooks}
    assert {e.value for e in Event} == set(hooks)
    methods = {n for n in dir(Callback) if n.startswith("on_") and n not in ("on_attach", "on_close")}
    assert methods == set(hooks)
    for name, hook in hooks.items():
        params = list(inspect.signature(getattr(Callback, name)).parameters)
        assert params == ["self", "trainer", *hook.args], name


def test_hook_names_keep_the_06_api():
    """The deepepochs 0.6 hook names users' callbacks rely on all exist."""
    names = {h.name for h in SPEC.hooks}
    for stage in ("train", "val", "test"):
        for pattern in ("on_before_{}_epochs", "on_before_{}_epoch", "on_before_{}_batch",
                        "on_before_{}_forward", "on_after_{}_forward", "on_{}_metrics", "on_after_{}_batch",
                        "on_after_{}_epoch", "on_after_{}_epochs"):
            assert pattern.format(stage) in names
    assert {"on_before_fit", "on_before_epoch", "on_before_backward", "on_after_backward", "on_before_optimize",
            "on_after_optimize", "on_after_epoch", "on_after_fit"} <= names


def test_raw_tables_have_the_documented_shapes():
    """The generated literals keep the column order documented in their comments."""
    assert all(len(row) == 6 for row in tables.STATES)
    assert all(len(row) == 5 and isinstance(row[1], bool) and isinstance(row[2], bool) for row in tables.ACTIONS)
    assert all(len(row) == 10 for row in tables.TRANSITIONS)
    assert all(len(row) == 6 for row in tables.HOOKS)
