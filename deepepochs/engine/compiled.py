"""The compiled micro-batch: Python source generated from the spec's fused edges for one configuration.

A fused edge (`Transition.fuses` in `spec/loop.py`) stands for a path of hot edges that nothing outside the
engine observes. For each state such edges leave (`task_train`: a one-batch window; `window_open`: a
micro-batch of a k-batch window), `generate` writes one function as straight-line code: per hop a comment
naming the spec edge, the state it moves to, and its actions called directly from the registry
(`deepepochs.engine.actions`, the one implementation of each); between the hops the default step's own
pieces (`deepepochs.engine.steps`: read and count the batch, forward, loss, backward, metric patches).
Where the fused paths part, on a guard that varies per batch (`window_boundary`, `grads_finite`), the
code has a plain `if` on the registry's guard; where they meet again the code continues once. The fused
edge taken is recorded at the end (`LoopMachine.record`), as one flight-record entry.

What the configuration fixes is decided at generation, not per batch, and said in a comment: actions that
do nothing here (`actions.FOLDS`: one process, no clipper, no GradScaler) are left out, and the step's
`with autocast():` is written only when the precision autocasts. A commit action runs once per path: where
one already committed the update on the path (`commit_update` after `step_optimizer`), its second place
(at the update's end, where it would set the same fields again) is left out with a comment, and the paths
that commit at different hops are written out each on its own. Sources are cached per configuration;
the functions are made per trainer from the registry as it is then (a test may wrap its entries first).
The source is registered in `linecache` under a file name that names the configuration, so tracebacks
and `inspect.getsource` show the generated lines; `explain` returns it for people to read.

Compiled functions run only where `batches.fuses` (the one statement of the fusing condition) allows;
every other micro-batch fires its edges one by one (`LoopMachine.fire`), calling the same registry and the
same step pieces. The states they start in (`ONE_BATCH_WINDOW`, `IN_WINDOW`) are read from the fused edges.
"""

from __future__ import annotations

import functools
import linecache
import types
from collections.abc import Callable

from deepepochs.engine import actions, steps
from deepepochs.engine.context import Context
from deepepochs.fsm.events import TriggerName
from deepepochs.fsm.machine import load_spec
from deepepochs.fsm.schema import Transition

__all__ = ["IN_WINDOW", "ONE_BATCH_WINDOW", "PROFILED_PIECES", "STEP_CODE", "STEP_HELPERS", "bind", "configuration",
           "describe", "explain", "function_name", "generate", "generate_all"]

#: The default training step's code around the hops, by trigger: (lines before the hop, lines after it).
#: The same calls the hand-fired path makes (`steps.default_step`, `steps.loss`, `steps.optimize`,
#: `batches.train_batches`), in the same order.
STEP_CODE: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    TriggerName.BEGIN_BATCH.value: (("batch_x, batch_y, n = read_batch(ctx, split, batch, is_last)"
                     "  # count it in its window and task; split it",), ()),
    TriggerName.BACKWARD.value: (("model_out = forward(ctx, batch_x, 'train')",
                  "value = loss_value(ctx, model_out, batch_y, 1.0)  # also the batch's reported loss"),
                 ("backpropagate(ctx, value, 1.0)  # the micro-batch's share of its window",)),
    TriggerName.OPTIMIZE.value: (("patches = step_patches(ctx, 'train', batch_x, model_out, batch_y, value)"
                  "  # before the update, which commits them",
                  "select_update(ctx, None)  # the one optimizer"), ()),
    TriggerName.APPLY_UPDATE.value: (("loop.opt_index = loop.update_indices[0]",), ()),
    TriggerName.END_BATCH.value: (("value, patches = count_batch(ctx, meters, patches, n)"
                                   "  # into the task's meters",), ()),
}
#: The step runs (under autocast, when the precision has one) from the code before this trigger's hop ...
STEP_OPENS = TriggerName.BACKWARD.value
#: ... to the code before this one's.
STEP_CLOSES = TriggerName.END_BATCH.value
#: The step pieces a profiled micro-batch times apart (the forward and the loss run in one state, `step_forward`);
#: the time of the others is their state's (`deepepochs.engine.profiling`).
PROFILED_PIECES = ("forward", "loss_value")
#: The functions of `deepepochs.engine.steps` that `STEP_CODE` calls (looked up when a trainer binds).
STEP_HELPERS = ("read_batch", "forward", "loss_value", "backpropagate", "step_patches", "select_update", "count_batch")


def _entry_states(spec) -> tuple[str, str]:
    """The states compiled micro-batches start in, from the spec's fused edges: `(one-batch window, inside a
    window)`: the source of the fused edges whose path opens the window (`begin_window`: with k=1 every
    micro-batch is a whole window), and the source of the others (a micro-batch of a k-batch window, whose
    window the batch loop opens on its own edge)."""
    opening = {f.source for f in spec.transitions if f.fuses and f.fuses[0] == TriggerName.BEGIN_WINDOW.value}
    inner = {f.source for f in spec.transitions if f.fuses and f.fuses[0] != TriggerName.BEGIN_WINDOW.value}
    assert len(opening) == len(inner) == 1, (opening, inner)
    return opening.pop(), inner.pop()


#: The state the compiled function of a one-batch window starts in, and that of a k-batch window's micro-batch.
ONE_BATCH_WINDOW, IN_WINDOW = _entry_states(load_spec())


def function_name(source: str) -> str:
    """The generated function for micro-batches starting in state `source`."""
    return f"micro_batch_from_{source}"


def configuration(ctx: Context) -> tuple[tuple[tuple[str, str], ...], bool]:
    """What the generated code depends on: the actions folded away (with why), and whether the step runs
    under autocast."""
    return tuple(sorted(actions.folded(ctx.parts).items())), ctx.parts.precision.dtype is not None


def _fused_paths(spec) -> dict[str, list[tuple[Transition, tuple[Transition, ...]]]]:
    """Per source state, the fused edges leaving it with their resolved paths, in spec order."""
    paths: dict[str, list] = {}
    for f in spec.transitions:
        if f.fuses:
            paths.setdefault(f.source, []).append((f, tuple(spec.fused_path(f))))
    return paths


def _guards(edge: Transition) -> str:
    names = [*edge.conditions, *(f"!{u}" for u in edge.unless)]
    return f" [{', '.join(names)}]" if names else ""


def _deciding_guard(a: Transition, b: Transition) -> str:
    """The guard that tells edge `a` from edge `b` (one requires it, the other its negation)."""
    for first, second in ((a, b), (b, a)):
        for name in first.conditions:
            if name in second.unless:
                return name
    raise ValueError(f"no guard tells {a.trigger} {a.source}->{a.dest} from {b.source}->{b.dest}")


class _Writer:
    """Collects the generated lines with their indentation."""

    def __init__(self, folded: dict[str, str], autocast: bool, commits: frozenset[str], profiled: bool = False):
        self.lines: list[str] = []
        self.folded, self.autocast, self.commits, self.profiled = folded, autocast, commits, profiled

    def line(self, depth: int, text: str) -> None:
        self.lines.append("    " * depth + text)

    def hop(self, depth: int, edges: list[Transition], known: dict[str, bool], done: frozenset[str]) -> frozenset[str]:
        """One hop: its edge as a comment, the state move, the actions (folded ones, and commit actions
        `done` already on this path, as comments). Returns the commit actions done after it."""
        edge = edges[0]
        sources = "|".join(dict.fromkeys(e.source for e in edges))
        self.line(depth, f"# {edge.trigger}{_guards(edge)}: {sources} -> {edge.dest}")
        for name in [*edge.conditions, *edge.unless]:
            if name in known:
                self.line(depth, f"#   {name} is {str(known[name]).lower()} here (asked above; it holds for"
                                 " the whole micro-batch)")
        self.line(depth, f"model.state = {edge.dest!r}")
        if self.profiled:
            self.line(depth, f"enter_state({edge.dest!r})  # profiled: the time from here on is {edge.dest}'s")
        for name in edge.actions:
            if name in self.folded:
                self.line(depth, f"# {name}(ctx): left out ({self.folded[name]})")
            elif name in done:
                self.line(depth, f"# {name}(ctx): left out (it ran above on this path; again it would set the"
                                 " same fields)")
            else:
                self.line(depth, f"{name}(ctx)")
        return done | (set(edge.actions) & self.commits)

    def step_code(self, depth: int, trigger: str, after: bool) -> int:
        """The step's code before (or after) a hop of `trigger`; returns the depth that follows (the step's
        `with autocast():` opens before the forward and closes before the batch is counted)."""
        if not after and trigger == STEP_CLOSES and self.autocast:
            depth -= 1
        if not after and trigger == STEP_OPENS:
            if self.autocast:
                self.line(depth, "with autocast():  # forward, loss, backward and update, as every step runs")
                depth += 1
            else:
                self.line(depth, "# no autocast: fp32")
        for text in STEP_CODE.get(trigger, ((), ()))[after]:
            self.line(depth, text)
        return depth


def _emit(w: _Writer, paths: list, i: int, depth: int, known: dict[str, bool], done: frozenset[str]) -> None:
    """Write the hops from `i` on of `paths` (fused edges whose first `i` hops are shared); `done`: the
    commit actions the shared hops ran."""
    while True:
        ended = [p for p in paths if i >= len(p[1])]
        if ended:
            assert len(ended) == len(paths) == 1, "fused paths that end together are one path"
            fused = ended[0][0]
            w.line(depth, f"machine.record({fused.source!r}, {fused.trigger!r}, {fused.dest!r})"
                          f"  # recorded as one edge: {fused.trigger}")
            w.line(depth, "return value, patches")
            return
        edges = [p[1][i] for p in paths]
        trigger = edges[0].trigger
        assert all(e.trigger == trigger for e in edges), "fused paths part only on a guard"
        distinct = list(dict.fromkeys((e.source, e.dest, e.conditions, e.unless) for e in edges))
        depth = w.step_code(depth, trigger, after=False)
        if len(distinct) == 1:
            done = w.hop(depth, edges, known, done)
            for name in edges[0].conditions:
                known[name] = True
            for name in edges[0].unless:
                known[name] = False
            depth = w.step_code(depth, trigger, after=True)
            i += 1
            continue
        first = edges[0]
        other = next(e for e in edges if (e.source, e.dest, e.conditions, e.unless) != distinct[0])
        guard = _deciding_guard(first, other)
        groups = {True: [p for p in paths if guard in p[1][i].conditions],
                  False: [p for p in paths if guard in p[1][i].unless]}
        assert len(groups[True]) + len(groups[False]) == len(paths), f"{guard} does not part every path"
        tails = {outcome: {tuple((e.trigger, e.dest, e.actions) for e in p[1][i + 1:]) for p in group}
                 for outcome, group in groups.items()}
        if len(groups[True]) == len(groups[False]) == 1 and tails[True] == tails[False]:
            # the paths part on this hop only: branch here, name the edge taken, and go on once. A commit
            # action one branch ran keeps the hops up to that action's next place inside each branch (left
            # out in the one, run in the other): each update commits once.
            commits = {outcome: set(group[0][1][i].actions) & w.commits for outcome, group in groups.items()}
            differ = commits[True] ^ commits[False]
            paths_on = groups[True][0][1]
            until = max([j for j in range(i + 1, len(paths_on)) if differ & set(paths_on[j].actions)], default=i)
            ends = []
            for outcome, keyword in ((True, f"if {guard}(ctx):"), (False, "else:")):
                path = groups[outcome][0]
                w.line(depth, keyword)
                branch_done = w.hop(depth + 1, [path[1][i]], known, done)
                inner = w.step_code(depth + 1, trigger, after=True) if until > i else depth + 1
                for j in range(i + 1, until + 1):
                    assert path[1][j].trigger != STEP_CLOSES, "the step's code closes after the branch"
                    inner = w.step_code(inner, path[1][j].trigger, after=False)
                    branch_done = w.hop(inner, [path[1][j]], known, branch_done)
                    inner = w.step_code(inner, path[1][j].trigger, after=True)
                w.line(depth + 1, f"fused = {path[0].trigger!r}")
                ends.append(branch_done)
            if until == i:
                depth = w.step_code(depth, trigger, after=True)
            rest = [(None, p[1]) for p in groups[True] + groups[False]]
            _emit_rest(w, rest, [groups[True][0][0], groups[False][0][0]], until + 1, depth, known,
                       ends[0] & ends[1])
            return
        for outcome, keyword in ((True, f"if {guard}(ctx):"), (False, "else:")):
            w.line(depth, keyword)
            branch_known = {**known, guard: outcome}
            sub = groups[outcome]
            edge = sub[0][1][i]
            branch_done = w.hop(depth + 1, [edge], branch_known, done)
            for name in edge.conditions:
                branch_known[name] = True
            for name in edge.unless:
                branch_known[name] = False
            inner = w.step_code(depth + 1, trigger, after=True)
            _emit(w, sub, i + 1, inner, branch_known, branch_done)
        return


def _emit_rest(w: _Writer, paths: list, fused: list[Transition], i: int, depth: int, known: dict,
               done: frozenset[str]) -> None:
    """After a one-hop branch: the shared rest of the paths (same triggers, states reached and actions,
    from different states), then the fused edge named in the branch is recorded."""
    for j in range(i, len(paths[0][1])):
        edges = [p[1][j] for p in paths]
        depth = w.step_code(depth, edges[0].trigger, after=False)
        done = w.hop(depth, edges, known, done)
        depth = w.step_code(depth, edges[0].trigger, after=True)
    sources, dests = {f.source for f in fused}, {f.dest for f in fused}
    assert len(sources) == len(dests) == 1
    names = " | ".join(f.trigger for f in fused)
    w.line(depth, f"machine.record({fused[0].source!r}, fused, {fused[0].dest!r})  # recorded as one edge: {names}")
    w.line(depth, "return value, patches")


def generate(source: str, folded: dict[str, str], autocast: bool, spec=None, profiled: bool = False) -> str:
    """The Python source of the compiled micro-batch starting in state `source`, for a configuration whose
    `folded` actions do nothing (`{action: why}`) and whose step does (not) run under autocast. `spec`: the
    loop spec (default: the package's, `load_spec()`; `python -m spec` passes the one it renders).
    `profiled`: the variant a profiled fit runs, the same code with an `enter_state(state)` line after each
    state move (`deepepochs.engine.profiling`)."""
    spec = load_spec() if spec is None else spec
    paths = _fused_paths(spec)[source]
    w = _Writer(folded, autocast, frozenset(a.name for a in spec.actions if a.commit), profiled)
    names = ", ".join(f"`{f.trigger}`" for f, _ in paths)
    w.line(0, f"def {function_name(source)}(ctx, meters, split, batch, is_last):")
    w.line(1, f'"""A micro-batch from `{source}`, one of {names}. Returns (loss value, patches)."""')
    w.line(1, "loop, machine = ctx.loop, ctx.machine")
    w.line(1, "model = machine.model")
    w.line(1, "# no callback hook runs inside a compiled micro-batch (one that would turns compiling off)")
    _emit(w, paths, 0, 1, {}, frozenset())
    return "\n".join(w.lines) + "\n"


def generate_all(folded: dict[str, str], autocast: bool, spec=None, profiled: bool = False) -> str:
    """`generate` for every state fused edges leave, as one module's source."""
    spec = load_spec() if spec is None else spec
    return "\n\n".join(generate(source, folded, autocast, spec, profiled) for source in _fused_paths(spec))


@functools.cache
def _compiled(key: tuple, profiled: bool = False) -> tuple[str, object]:
    """`(source text, code object)` of every compiled micro-batch for configuration `key` (`profiled`: its
    profiled variant, see `generate`)."""
    folded, autocast = dict(key[0]), key[1]
    text = generate_all(folded, autocast, profiled=profiled)
    what = ", ".join([f"{name} left out" for name in folded] + ["autocast" if autocast else "no autocast"]
                     + ["profiled"] * profiled)
    filename = f"<deepepochs compiled micro-batch: {what}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    return text, compile(text, filename, "exec")


def bind(ctx: Context) -> dict[str, Callable]:
    """The compiled micro-batch functions for `ctx`'s configuration, by the state they start in, calling
    the registry's guards and actions as they are now. In a profiled run (`ctx.profiler`) the profiled
    variant, calling the same functions, those whose time its state's would not tell apart timed."""
    timeline = ctx.profiler
    _, code = _compiled(configuration(ctx), timeline is not None)
    namespace: dict = {**actions.GUARDS, **actions.ACTIONS}
    assert not set(namespace) & set(STEP_HELPERS), "a step helper is named like a spec guard or action"
    namespace.update({name: getattr(steps, name) for name in STEP_HELPERS}, autocast=ctx.parts.precision.autocast)
    if timeline is not None:  # what a state's row would not tell apart: the forward from the loss, a write
        timed = [*PROFILED_PIECES, *(name for name in actions.ACTIONS if timeline.costs_apart(name))]
        namespace.update({name: timeline.timed(name, namespace[name]) for name in timed}, enter_state=timeline.enter)
    exec(code, namespace)  # noqa: S102 (our own generated source, see `generate`)
    return {source: namespace[function_name(source)] for source in _fused_paths(load_spec())}


def describe(precision: str = "fp32", processes: int = 1, clipper: bool = False) -> str:
    """The compiled micro-batch a trainer with these options runs (`python -m deepepochs loop`): the same
    source `explain` gives for such a trainer, made without building one."""
    if precision not in ("fp32", "fp16", "bf16"):
        raise ValueError(f"precision must be one of 'fp32', 'fp16', 'bf16' (got {precision!r})")
    if not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes must be a whole number >= 1 (got {processes!r})")
    parts = types.SimpleNamespace(dist=types.SimpleNamespace(world_size=processes),
                                  clippers=[clipper] if clipper else [], averagers=[],
                                  precision=types.SimpleNamespace(scaler=precision if precision == "fp16" else None))
    return generate_all(actions.folded(parts), precision != "fp32")


def explain(ctx: Context) -> str:
    """The code a fused training micro-batch runs for `ctx`'s configuration, with the spec edge of each line."""
    text, _ = _compiled(configuration(ctx))
    return text
