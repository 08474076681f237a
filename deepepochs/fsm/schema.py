"""Typed records the loop spec is written in.

`spec/loop.py` (not shipped) builds one `Spec` from these records; `deepepochs.fsm.codegen` renders it to
`deepepochs/fsm/tables.py`; `deepepochs.fsm.machine` builds the running machines from those tables. Every
record carries a one-line `doc`, which the generated tables, the graph and the docs reuse.
"""

from __future__ import annotations

import itertools

import attrs

__all__ = [
    "COSTS",
    "LAYERS",
    "Action",
    "Guard",
    "Hook",
    "Spec",
    "SpecError",
    "State",
    "Transition",
    "Trigger",
]

#: Layers of the loop, outermost first; every state belongs to one.
LAYERS = ("fit", "epoch", "stage", "task", "window", "step", "optimize", "rollback")

#: What the time spent in a state (or running an action) counts as when a fit is profiled
#: (`deepepochs.ProfileCallback`), with what each cost means to a user.
COSTS = {
    "data": "waiting for the training DataLoader and moving its batches to the device",
    "forward": "the model's forward pass and the loss",
    "backward": "backpropagation and the batch's metric patches",
    "optimizer": "unscaling, clipping, optimizer and scheduler steps, zeroing the gradients",
    "callbacks": "callback hooks (each by its class and hook)",
    "validation": "validation and test batches, their DataLoaders and metrics",
    "checkpoint": "writing and loading checkpoints and snapshots",
    "logging": "the console and the logging callbacks",
    "other": "the loop's own bookkeeping between the states above",
}


class SpecError(ValueError):
    """The spec is inconsistent (unknown name, duplicate, non-exclusive guards, ...)."""


def _identifier(_instance, attribute, value):
    if not (isinstance(value, str) and value.isidentifier()):
        raise SpecError(f"{attribute.name} must be a Python identifier (got {value!r})")


def _one_line(_instance, attribute, value):
    if not (isinstance(value, str) and value.strip() and "\n" not in value):
        raise SpecError(f"{attribute.name} must be one non-empty line (got {value!r})")


_names = attrs.field(converter=tuple, default=())


@attrs.frozen
class State:
    """A state of the loop machine.

    Attributes:
        name: identifier, unique in the spec.
        layer: one of `LAYERS`.
        doc: one line saying what is going on while the machine is in this state.
        idle: `fit`/`test` may be called from here (only the initial state and none else).
        running: the loop is running here, so an `interrupt` edge must lead to rollback.
        cost: what the time spent here counts as in a profile, one of `COSTS`.
    """

    name: str = attrs.field(validator=_identifier)
    layer: str = attrs.field(validator=attrs.validators.in_(LAYERS))
    doc: str = attrs.field(validator=_one_line)
    idle: bool = False
    running: bool = True
    cost: str = attrs.field(default="other", validator=attrs.validators.in_(COSTS))


@attrs.frozen
class Trigger:
    """An event that moves the machine.

    `hot` triggers fire once or more per micro-batch and run on the compiled table; cold ones (a few per
    epoch) run through `transitions`.
    """

    name: str = attrs.field(validator=_identifier)
    doc: str = attrs.field(validator=_one_line)
    hot: bool = False


@attrs.frozen
class Guard:
    """A named side-effect-free predicate over the loop state that selects between edges."""

    name: str = attrs.field(validator=_identifier)
    doc: str = attrs.field(validator=_one_line)


@attrs.frozen
class Action:
    """A named effect run when an edge is taken (after the state changes).

    A commit action (`commit=True`) marks the point after which the work done so far is committed: rollback
    never undoes it. Only actions marked `after_commit=True` may follow it on an edge, and those only follow
    one (checked by `Spec.validate`), so an edge either commits everything it did or, interrupted before its
    commit, nothing; an after-commit action (e.g. raising a Ctrl-C held during an update) finds it committed.
    `cost`: what its time counts as in a profile (one of `COSTS`) where that differs from its state's (a
    checkpoint write), else None.
    """

    name: str = attrs.field(validator=_identifier)
    doc: str = attrs.field(validator=_one_line)
    commit: bool = False
    after_commit: bool = False
    cost: str | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.in_(COSTS)))


@attrs.frozen
class Transition:
    """An edge `source --trigger [conditions, not unless]--> dest / actions`.

    `dest=None` marks an explicit error edge: taking it raises `InvalidTransition` with `error` as the
    reason, so a (state, trigger) pair can be total over its guards and still refuse some outcomes.

    A fused edge (`fuses` non-empty) stands for a path of hot edges: firing `fuses` in order from `source`,
    with the guards in `assuming` true and every other guard false, must lead to `dest` (checked by
    `Spec.validate`). Where nothing can observe the path's inner states the engine runs code compiled from
    the path (`deepepochs.engine.compiled`), which calls the path's actions and records the fused edge;
    the fused edge has no guards or actions of its own.
    """

    trigger: str = attrs.field(validator=_identifier)
    source: str = attrs.field(validator=_identifier)
    dest: str | None
    doc: str = attrs.field(validator=_one_line)
    conditions: tuple[str, ...] = _names
    unless: tuple[str, ...] = _names
    actions: tuple[str, ...] = _names
    error: str | None = None
    fuses: tuple[str, ...] = _names
    assuming: tuple[str, ...] = _names

    def matches(self, outcome: dict[str, bool]) -> bool:
        """Whether this edge is taken when the guards evaluate to `outcome`."""
        return all(outcome[g] for g in self.conditions) and not any(outcome[g] for g in self.unless)

    @property
    def guard_label(self) -> str:
        """The guards as drawn on the edge: `[a, !b]`, or an empty string."""
        parts = [*self.conditions, *(f"!{g}" for g in self.unless)]
        return f"[{', '.join(parts)}]" if parts else ""


@attrs.frozen
class Hook:
    """A callback hook (loop event) with the 0.6 name and arguments.

    Attributes:
        name: method name on `Callback`, e.g. `on_before_fit`.
        args: argument names after `trainer`.
        states: the states the machine may be in when the hook runs (checked by conformance tests).
        doc: one line.
        after: the trigger whose edge the hook runs after (the last edge taken when it runs), or None.
        before: the trigger whose edge the hook runs before (the next edge taken after it), or None;
            exactly one of `after` and `before` is given (checked by `Spec.validate`; the conformance test
            checks real runs against it).
    """

    name: str = attrs.field(validator=_identifier)
    args: tuple[str, ...] = attrs.field(converter=tuple)
    states: tuple[str, ...] = attrs.field(converter=tuple)
    doc: str = attrs.field(validator=_one_line)
    after: str | None = None
    before: str | None = None

    @property
    def place(self) -> str:
        """Where the hook fires, in words: `after begin_batch`, `before end_task`."""
        return f"after {self.after}" if self.after is not None else f"before {self.before}"

    @property
    def is_after(self) -> bool:
        """`after` hooks run callbacks in reverse registration order."""
        return self.name.startswith("on_after_")


@attrs.frozen
class Spec:
    """The whole machine. `validate()` checks names, guard exclusivity, fused paths and that commit actions
    come last; `SpecError` on failure."""

    states: tuple[State, ...] = attrs.field(converter=tuple)
    triggers: tuple[Trigger, ...] = attrs.field(converter=tuple)
    guards: tuple[Guard, ...] = attrs.field(converter=tuple)
    actions: tuple[Action, ...] = attrs.field(converter=tuple)
    transitions: tuple[Transition, ...] = attrs.field(converter=tuple)
    hooks: tuple[Hook, ...] = attrs.field(converter=tuple)
    initial: str = "idle"
    rollback: str = "rollback"
    interrupt: str = "interrupt"

    def state(self, name: str) -> State:
        """The state called `name`."""
        return next(s for s in self.states if s.name == name)

    def edges(self, source: str, trigger: str) -> list[Transition]:
        """All edges for one (state, trigger) pair, in spec order."""
        return [t for t in self.transitions if t.source == source and t.trigger == trigger]

    def fused_path(self, edge: Transition) -> list[Transition]:
        """The hot edges a fused edge stands for, in order (see `Transition`)."""
        outcome = {g.name: g.name in edge.assuming for g in self.guards}
        state, path = edge.source, []
        for trigger in edge.fuses:
            taken = [t for t in self.edges(state, trigger) if t.matches(outcome)]
            if len(taken) != 1 or taken[0].dest is None:
                raise SpecError(f"fused edge {edge.source} --{edge.trigger}-->: no edge for {trigger!r} from"
                                f" {state!r} with {sorted(edge.assuming)} true")
            path.append(taken[0])
            state = taken[0].dest
        if state != edge.dest:
            raise SpecError(f"fused edge {edge.source} --{edge.trigger}--> {edge.dest}: its path ends in {state!r}")
        return path

    def commits(self, edge: Transition) -> bool:
        """Whether taking `edge` commits (see `Action`).

        A plain edge commits when it runs a commit action, a fused edge when its path takes such an edge.
        """
        if edge.fuses:
            return any(self.commits(e) for e in self.fused_path(edge))
        commit = {a.name for a in self.actions if a.commit}
        return any(a in commit for a in edge.actions)

    def commit_edges(self) -> list[Transition]:
        """The edges that commit (`commits`), fused ones included, in spec order."""
        return [t for t in self.transitions if self.commits(t)]

    def guards_of(self, source: str, trigger: str) -> list[str]:
        """Guard names the edges of (state, trigger) depend on, sorted."""
        return sorted({g for t in self.edges(source, trigger) for g in (*t.conditions, *t.unless)})

    def validate(self) -> Spec:
        """Check the spec is well formed; returns self so it can be chained."""
        for kind, records in (
            ("state", self.states), ("trigger", self.triggers), ("guard", self.guards),
            ("action", self.actions), ("hook", self.hooks),
        ):
            names = [r.name for r in records]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise SpecError(f"duplicate {kind} names: {dupes}")
        states = {s.name for s in self.states}
        known = {
            "trigger": {t.name for t in self.triggers},
            "guard": {g.name for g in self.guards},
            "action": {a.name for a in self.actions},
        }
        commit = {a.name for a in self.actions if a.commit}
        if self.initial not in states or self.rollback not in states:
            raise SpecError(f"initial {self.initial!r} and rollback {self.rollback!r} must be states")
        for t in self.transitions:
            where = f"edge {t.source} --{t.trigger}--> {t.dest}"
            if t.source not in states or (t.dest is not None and t.dest not in states):
                raise SpecError(f"{where}: unknown state")
            if (t.dest is None) != (t.error is not None):
                raise SpecError(f"{where}: an error edge needs dest=None and an error text, and only it")
            for kind, names in (("trigger", (t.trigger,)), ("guard", (*t.conditions, *t.unless)),
                                ("action", t.actions)):
                unknown = [n for n in names if n not in known[kind]]
                if unknown:
                    raise SpecError(f"{where}: unknown {kind} {unknown}; known: {sorted(known[kind])}")
            after = {a.name for a in self.actions if a.after_commit}
            tail = len(t.actions)
            while tail and t.actions[tail - 1] in after:  # the after-commit actions that end the edge
                tail -= 1
            early = [a for a in t.actions[:tail - 1] if a in commit]
            if early:
                raise SpecError(f"{where}: commit action {early[0]!r} must be the edge's last action but for"
                                f" after-commit ones (got actions {list(t.actions)}); move it to the end so that"
                                " nothing runs after the commit")
            if tail < len(t.actions) and (not tail or t.actions[tail - 1] not in commit):
                raise SpecError(f"{where}: after-commit action {t.actions[tail]!r} must follow a commit action"
                                f" (got actions {list(t.actions)})")
            misplaced = [a for a in t.actions[:tail] if a in after]
            if misplaced:
                raise SpecError(f"{where}: after-commit action {misplaced[0]!r} must follow the edge's commit"
                                f" action (got actions {list(t.actions)})")
        hot = {t.name for t in self.triggers if t.hot}
        for t in self.transitions:
            if t.fuses:
                where = f"fused edge {t.source} --{t.trigger}--> {t.dest}"
                if t.conditions or t.unless or t.actions or t.dest is None:
                    raise SpecError(f"{where}: a fused edge has no guards, actions or error of its own")
                if not set((t.trigger, *t.fuses)) <= hot or not set(t.assuming) <= known["guard"]:
                    raise SpecError(f"{where}: it and the triggers it fuses must be hot; assuming names guards")
                self.fused_path(t)
            elif t.assuming:
                raise SpecError(f"edge {t.source} --{t.trigger}--> {t.dest}: assuming needs fuses")
        for h in self.hooks:
            if not h.name.startswith("on_") or not set(h.states) <= states:
                raise SpecError(f"hook {h.name}: name must start with on_ and states must exist")
            edge = [name for name in (h.after, h.before) if name is not None]
            if len(edge) != 1 or edge[0] not in known["trigger"]:
                raise SpecError(f"hook {h.name}: give exactly one of after= and before=, naming a trigger (got"
                                f" after={h.after!r}, before={h.before!r})")
        pairs = sorted({(t.source, t.trigger) for t in self.transitions})
        for source, trigger in pairs:
            self._check_exclusive(source, trigger)
        return self

    def _check_exclusive(self, source: str, trigger: str) -> None:
        edges = self.edges(source, trigger)
        guards = self.guards_of(source, trigger)
        for values in itertools.product((False, True), repeat=len(guards)):
            outcome = dict(zip(guards, values))
            taken = [t for t in edges if t.matches(outcome)]
            if len(taken) != 1:
                raise SpecError(
                    f"({source}, {trigger}) with guards {outcome}: {len(taken)} edges match; guards of one"
                    " (state, trigger) must be mutually exclusive and total (add an error edge if needed)"
                )
