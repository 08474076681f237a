"""What one picture of the loop machine shows: a level's states, its edges grouped by label, and a path.

A *level* shows a few adjacent layers of the spec (`LEVELS`: names from `schema.LAYERS`, never state
names); the states of the other layers are folded: each connected group of them (connected by edges
between hidden states, interrupts aside) becomes one summary node standing for the whole group, and the
edges between shown states and the group are drawn to the summary node. The rollback layer is always
shown. `full` shows every layer.

Edges are grouped by drawn endpoints; inside a group there is one line per trigger (several spec edges
with the same trigger, e.g. `snapshot [!snapshot_due]` and `snapshot [snapshot_due, !stop_signalled]`,
share a line: the flight record tells which trigger was fired, not which of its guarded edges). A path
(the last transitions of a run) numbers the lines it took, 1 for the oldest; steps inside a folded group
are counted but not drawn. `render` turns a `Drawing` into DOT or Mermaid text.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import attrs

from deepepochs.errors import ConfigError
from deepepochs.fsm.schema import LAYERS, Spec

__all__ = ["LEVELS", "Drawing", "Group", "Line", "Node", "auto_level", "build_drawing"]

#: level -> the spec layers it shows in detail (the rollback layer is always shown), coarsest first.
LEVELS: dict[str, tuple[str, ...]] = {
    "fit": ("fit", "epoch"),                  # a fit as a cycle of epochs
    "epoch": ("epoch", "stage", "task"),      # inside an epoch: stages and their tasks
    "task": ("stage", "task", "window"),      # a task as windows of micro-batches
    "batch": ("window", "step", "optimize"),  # one micro-batch: accumulation, precision, the update
    "full": LAYERS,
}
ALWAYS = ("rollback",)


@attrs.frozen
class Node:
    """A drawn node: a state (`states` is its name alone) or a folded group of states (`summary`)."""

    id: str
    label: str
    states: tuple[str, ...]
    summary: bool = False
    doc: str = ""


@attrs.define
class Line:
    """One trigger on a group of edges: its guard alternatives, tags and the path steps that took it."""

    trigger: str
    alts: list[tuple] = attrs.Factory(list)   # (conditions, unless) per spec edge drawn
    fused: bool = False
    commit: bool = False
    error: bool = False
    steps: list[int] = attrs.Factory(list)    # 1-based path numbers
    edges: set = attrs.Factory(set)           # the (source, trigger, dest) triples of the spec it draws

    @property
    def guards(self) -> list[str]:
        """The guard alternatives as drawn, `[a, !b]` each; none when together they always hold (e.g.
        `[window_boundary]` or `[!window_boundary]`: the trigger takes this line whatever the guards say)."""
        used = sorted({g for conds, unless in self.alts for g in (*conds, *unless)})
        always = all(any(all(o[g] for g in c) and not any(o[g] for g in u) for c, u in self.alts)
                     for o in (dict(zip(used, v)) for v in itertools.product((False, True), repeat=len(used))))
        return [] if always else list(dict.fromkeys(_guards(c, u) for c, u in self.alts))

    @property
    def text(self) -> str:
        """`trigger [guards]`, guard alternatives joined by `or`."""
        return " ".join([self.trigger, " or ".join(self.guards)]).strip()


@attrs.define
class Group:
    """The lines drawn between two nodes (`source` may equal `dest`: a loop)."""

    source: str
    dest: str
    lines: list[Line] = attrs.Factory(list)
    synthetic: str | None = None  # "gap" (hops not recorded) or "resume" (rollback keeps work up to here)
    note: str = ""


@attrs.define
class Drawing:
    """One picture: nodes, edge groups, the path, the highlighted states and the legend's lines."""

    level: str
    nodes: list[Node]
    groups: list[Group]
    steps: list[tuple] = attrs.Factory(list)  # (n, epoch, batch, source, trigger, dest), oldest first
    current: str | None = None                # node id of the live trainer's state
    failed: str | None = None                 # node id of the state that failed
    hidden_steps: list[int] = attrs.Factory(list)
    legend: list[str] = attrs.Factory(list)
    heat: dict[str, float] = attrs.Factory(dict)  # node id -> its states' share of a profiled run's time


def _check_level(level: str) -> None:
    if level not in LEVELS:
        raise ConfigError(f"level must be one of {', '.join(map(repr, LEVELS))} (got {level!r}); 'fit' is the"
                          " overview, 'batch' one micro-batch, 'full' every state")


def auto_level(spec: Spec, state: str | None) -> str:
    """The coarsest level that shows `state` in detail (`fit` when there is none): the failed state of a
    flight record, the hottest state of a profile."""
    if state is None:
        return "fit"
    layer = spec.state(state).layer
    return next(level for level, layers in LEVELS.items() if layer in layers or layer in ALWAYS)


def _fold(spec: Spec, shown: set[str]) -> list[Node]:
    """Nodes for the shown states, plus one summary node per connected group of hidden states."""
    hidden = [s.name for s in spec.states if s.name not in shown]
    parent = {s: s for s in hidden}

    def root(s):
        while parent[s] != s:
            s = parent[s]
        return s

    for t in spec.transitions:
        if t.trigger != spec.interrupt and t.dest in parent and t.source in parent:
            parent[root(t.source)] = root(t.dest)
    groups: dict[str, list[str]] = {}
    for s in hidden:
        groups.setdefault(root(s), []).append(s)
    nodes = [Node(s.name, s.name, (s.name,), doc=s.doc) for s in spec.states if s.name in shown]
    order = [s.name for s in spec.states]
    for members in groups.values():
        members.sort(key=order.index)
        # named after the states its edges enter from the shown ones (or the group's first state)
        entries = [s for s in members if any(t.dest == s and t.source in shown and t.trigger != spec.interrupt
                                             for t in spec.transitions)] or members[:1]
        entries.sort(key=lambda s: -LAYERS.index(spec.state(s).layer))  # the nearest layer first
        layers = list(dict.fromkeys(spec.state(s).layer for s in members))
        head = ", ".join(entries[:2]) + (" ..." if len(entries) > 2 else "")
        more = len(members) - min(len(entries), 2)
        label = head if not more else f"{head}\n+ {more} more ({'/'.join(layers)})"
        nodes.append(Node(f"group_{members[0]}", label, tuple(members), summary=True,
                          doc=f"folded: {', '.join(members)}"))
    return nodes


def _guards(conds: Sequence[str], unless: Sequence[str]) -> str:
    parts = [*conds, *(f"!{u}" for u in unless)]
    return f"[{', '.join(parts)}]" if parts else ""


def build_drawing(spec: Spec, edges: Sequence[tuple], level: str = "full", *, current: str | None = None,
                  path: Sequence[tuple] = (), show_interrupts: bool = False,
                  heat: Mapping[str, float] | None = None) -> Drawing:
    """The picture of `level`.

    Args:
        spec: the loop spec.
        edges: the machine's edges `(source, trigger, dest, conditions, unless, actions, error)`
            (`machine.machine_edges`: read back from the built machine).
        level: one of `LEVELS`.
        current: the live trainer's state, highlighted (ignored when the path holds a failure).
        path: the last transitions `(epoch, batch, source, trigger, dest)`, oldest first; numbered 1, 2, ...
            on the lines they took. An `interrupt` among them marks its source as the failed state.
        show_interrupts: draw every interrupt edge (else one legend line stands for them).
        heat: `{state: share of a profiled run's time}` (`ProfileCallback`): each node is shaded and labelled
            by its states' share (a folded box by the sum of its states').
    """
    _check_level(level)
    layers = set(LEVELS[level]) | set(ALWAYS)
    shown = {s.name for s in spec.states if s.layer in layers}
    nodes = _fold(spec, shown)
    node_of = {s: n.id for n in nodes for s in n.states}
    fused = {(t.source, t.trigger): t for t in spec.transitions if t.fuses}
    commit_actions = {a.name for a in spec.actions if a.commit}
    steps = [(i, *r) for i, r in enumerate(path, 1)]
    taken = {(s, t, d) for _, _, _, s, t, d in steps}
    groups: dict[tuple[str, str, bool], Group] = {}
    fused_triggers = {t.trigger for t in spec.transitions if t.fuses}

    def is_fused(trigger: str) -> bool:  # fused lines get a group of their own: a dashed edge
        return trigger in fused_triggers

    def line_for(src: str, dst: str, trigger: str) -> Line:
        group = groups.setdefault((src, dst, (is_fused(trigger))), Group(src, dst))
        line = next((x for x in group.lines if x.trigger == trigger), None)
        if line is None:
            line = Line(trigger)
            group.lines.append(line)
        return line

    for source, trigger, dest, conds, unless, actions, _error in edges:
        if trigger == spec.interrupt and not show_interrupts and (source, trigger, dest) not in taken:
            continue
        src = node_of[source]
        if dest is None:
            if src != source:  # an error edge inside a folded group is not drawn
                continue
            dst = "error"
        else:
            dst = node_of[dest]
        if src == dst and (source not in shown):  # inside one folded group
            continue
        line = line_for(src, dst, trigger)
        edge = fused.get((source, trigger))
        if edge is not None:
            used = sorted({g for e in spec.fused_path(edge) for g in (*e.conditions, *e.unless)})
            line.alts.append((tuple(g for g in used if g in edge.assuming),
                              tuple(g for g in used if g not in edge.assuming)))
            line.fused = True
            line.commit = line.commit or spec.commits(edge)
        else:
            line.alts.append((tuple(conds), tuple(unless)))
            line.commit = line.commit or any(a in commit_actions for a in actions)
        line.error = dest is None
        line.edges.add((source, trigger, dest))
    if any(g.dest == "error" for g in groups.values()):
        nodes.append(Node("error", "InvalidTransition\n(an error edge)", (), doc="an error edge raises"))

    drawing = Drawing(level, nodes, list(groups.values()), steps=steps)
    failed = [s for _, _, _, s, t, _ in steps if t == spec.interrupt]
    if failed:
        drawing.failed = node_of[failed[-1]]
    elif current is not None:
        drawing.current = node_of[current]
    _number(spec, drawing, node_of, steps)
    for state, share in (heat or {}).items():
        if state not in node_of:
            raise ConfigError(f"heat: {state!r} is no state of the loop (states: {', '.join(sorted(node_of))})")
        drawing.heat[node_of[state]] = drawing.heat.get(node_of[state], 0.0) + share
    drawing.legend = _legend(spec, drawing, show_interrupts)
    return drawing


def _number(spec: Spec, drawing: Drawing, node_of: dict[str, str], steps: list[tuple]) -> None:
    """Put each path step on the line it took; add the gap edges (hops a fused micro-batch took unrecorded)
    and the rollback's edge back to the last commit point."""
    lines = [line for g in drawing.groups for line in g.lines]
    for n, _epoch, _batch, source, trigger, dest in steps:
        line = next((x for x in lines if (source, trigger, dest) in x.edges), None)
        if line is None:  # both ends in one folded group
            drawing.hidden_steps.append(n)
        else:
            line.steps.append(n)
    for (n, *_, dest), (_m, _e, _b, source, _t, _d) in zip(steps, steps[1:]):
        if dest != source and node_of[dest] != node_of[source]:
            drawing.groups.append(Group(node_of[dest], node_of[source], synthetic="gap",
                                        note=f"after {n}: the hops of a fused micro-batch, not recorded"))
    commits = {(t.source, t.trigger, t.dest) for t in spec.commit_edges()}
    if any(t == spec.interrupt for *_, t, _d in steps):
        last = [(n, e, b, d) for n, e, b, s, t, d in steps if (s, t, d) in commits]
        if last:
            n, epoch, batch, dest = last[-1]
            drawing.groups.append(Group(node_of[spec.rollback], node_of[dest], synthetic="resume",
                                        note=f"kept: the work up to {n} (last commit, epoch {epoch} batch {batch})"))


def _legend(spec: Spec, drawing: Drawing, show_interrupts: bool) -> list[str]:
    lines = []
    if not show_interrupts:
        lines.append(f"every running state --{spec.interrupt}--> {spec.rollback} (not drawn)")
    if any(line.fused for g in drawing.groups for line in g.lines):
        lines.append("dashed: a fused edge, one micro-batch in one step (--level batch shows its hops)")
    if any(line.commit for g in drawing.groups for line in g.lines):
        lines.append("green: commits; rollback never undoes its work")
    if any(n.summary for n in drawing.nodes):
        lines.append("dashed box: states of other levels, folded")
    if drawing.heat:
        lines.append("shaded: the share of the profiled run's time spent in the state (darker: more)")
    if drawing.steps:
        lines.append("blue numbers: the last transitions, 1 = oldest")
        if drawing.failed:
            lines.append("red: the state that failed")
        if drawing.hidden_steps:
            lines.append(f"steps {_ranges(drawing.hidden_steps)} ran inside a folded box")
    return lines


def _ranges(numbers: Sequence[int]) -> str:
    """`1-3, 5` for [1, 2, 3, 5]."""
    out, start, prev = [], None, None
    for n in [*numbers, None]:
        if start is not None and n != prev + 1:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = None
        if start is None and n is not None:
            start = n
        prev = n
    return ", ".join(out)
