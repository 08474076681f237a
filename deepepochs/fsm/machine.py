"""The running loop machine: a `transitions` machine plus a table compiled from it.

This is the only module that imports `transitions`. Cold triggers (a few per epoch: fit, epoch, stage,
task, interrupt) go through `transitions.Machine`, which also validates the tables and is what the state
graph is drawn from. Hot triggers (several per micro-batch) run on a dict compiled from that same machine:
a `transitions` trigger makes dozens of Python calls where a dict dispatch makes a few, which per batch
would cost more than the whole overhead budget (benchmarks/fsm_dispatch.py measures both). Both paths
write the same `state` attribute, so a cold trigger from a hot state sees the true state. A fused
micro-batch runs code generated from the spec (`deepepochs.engine.compiled`), which moves the same
`state` attribute itself and records the fused edge it took (`record`).
"""

from __future__ import annotations

import collections
import functools
import logging
from collections.abc import Callable, Mapping

from transitions import Machine, MachineError

from deepepochs.errors import InvalidTransition
from deepepochs.fsm import tables
from deepepochs.fsm.schema import Action, Guard, Hook, Spec, State, Transition, Trigger

__all__ = ["Edge", "LoopMachine", "Record", "build_machine", "compile_table", "load_spec", "machine_edges"]

# A user's logging.basicConfig(level=INFO) would otherwise make transitions log every trigger (~3x cost).
logging.getLogger("transitions").setLevel(logging.WARNING)

Edge = tuple  # (source, trigger, dest, conditions, unless, actions, error)
Record = collections.namedtuple("Record", "epoch batch source trigger dest")
Record.__doc__ = "One recorded transition: 1-based epoch and batch indices (0 = none), states, trigger."


@functools.cache
def load_spec() -> Spec:
    """The loop spec as loaded from the generated tables (no dependency on `spec/`)."""
    return Spec(
        states=[State(n, layer, doc, idle=idle, running=running, cost=cost)
                for n, layer, idle, running, cost, doc in tables.STATES],
        triggers=[Trigger(n, doc, hot=hot) for n, hot, doc in tables.TRIGGERS],
        guards=[Guard(n, doc) for n, doc in tables.GUARDS],
        actions=[Action(n, doc, commit=commit, after_commit=after, cost=cost)
                 for n, commit, after, cost, doc in tables.ACTIONS],
        transitions=[
            Transition(trig, src, dst, doc, conditions=c, unless=u, actions=a, error=err, fuses=f, assuming=g)
            for trig, src, dst, c, u, a, err, f, g, doc in tables.TRANSITIONS
        ],
        hooks=[Hook(n, args, states, doc, after=after, before=before)
               for n, args, states, after, before, doc in tables.HOOKS],
        initial=tables.INITIAL,
        rollback=tables.ROLLBACK,
        interrupt=tables.INTERRUPT,
    ).validate()


class _Model:
    """The object `transitions` drives: holds `state` and exposes guards/actions as attributes by name."""

    def __init__(self, guards: Mapping[str, Callable[[], bool]], actions: Mapping[str, Callable[[], None]]):
        self.__dict__.update(guards)
        self.__dict__.update(actions)


def _error_raiser(source: str, trigger: str, error: str) -> Callable[[], None]:
    def raise_error():
        raise InvalidTransition(f"state {source!r}, trigger {trigger!r}: {error}")

    return raise_error


def build_machine(spec: Spec, guards: Mapping[str, Callable[[], bool]],
                  actions: Mapping[str, Callable[[], None]]) -> Machine:
    """A `transitions.Machine` over the whole spec, its model holding `guards` and `actions` by name.

    Error edges become internal transitions whose `before` callback raises `InvalidTransition`; each has a
    callback of its own (numbered), since one (state, trigger) may refuse several guard outcomes.
    """
    missing = sorted({g.name for g in spec.guards} - set(guards))
    missing += sorted({a.name for a in spec.actions} - set(actions))
    if missing:
        raise ValueError(f"build_machine: no callable given for {missing}")
    model = _Model(guards, dict(actions))
    edges = []
    for n, t in enumerate(spec.transitions):
        edge = {"trigger": t.trigger, "source": t.source, "dest": t.dest, "conditions": list(t.conditions),
                "unless": list(t.unless), "after": list(t.actions)}
        if t.dest is None:
            name = f"_error_{t.source}_{t.trigger}_{n}"
            setattr(model, name, _error_raiser(t.source, t.trigger, t.error))
            edge["before"] = [name]
        edges.append(edge)
    return Machine(model=model, states=[s.name for s in spec.states], initial=spec.initial, transitions=edges,
                   auto_transitions=False, send_event=False, ignore_invalid_triggers=False)


def machine_edges(machine: Machine) -> list[Edge]:
    """The edges of a built machine, read back from `transitions`' own structures, in trigger order."""
    edges = []
    for trigger, event in machine.events.items():
        for source, transitions in list(event.transitions.items()):  # never index: it is a defaultdict
            for t in transitions:
                conds = tuple(c.func for c in t.conditions if c.target)
                unless = tuple(c.func for c in t.conditions if not c.target)
                error = None
                if t.dest is None:
                    error = next(b for b in t.before if b.startswith("_error_"))
                edges.append((source, trigger, t.dest, conds, unless, tuple(t.after), error))
    return edges


def _predicate(model: _Model, conditions: tuple[str, ...], unless: tuple[str, ...]) -> Callable[[], bool]:
    """One callable for an edge's guards, specialised for the common shapes (no guard, one guard)."""
    conds = [getattr(model, c) for c in conditions]
    negs = [getattr(model, u) for u in unless]
    if not conds and not negs:
        return None
    if len(conds) == 1 and not negs:
        return conds[0]
    if not conds and len(negs) == 1:
        neg = negs[0]
        return lambda: not neg()
    # the update clock's `validate` edges, asked once per update: no generator expression for two guards
    if len(conds) == 1 and len(negs) == 1:
        cond, neg = conds[0], negs[0]
        return lambda: cond() and not neg()
    if not conds and len(negs) == 2:
        first, second = negs
        return lambda: not (first() or second())
    return lambda: all(c() for c in conds) and not any(n() for n in negs)


def compile_table(machine: Machine) -> dict[tuple[str, str], tuple]:
    """Compile a built machine into `{(state, trigger): ((predicate|None, dest, actions, error), ...)}`.

    The edges of one (state, trigger) are mutually exclusive and total (the spec checks it for every outcome
    of their guards), so the last one is taken when every other refused: its predicate is None, and a hot
    trigger that falls through (the update clock's `validate` between validation points) asks no guard twice.
    """
    model = machine.models[0]
    table = collections.defaultdict(list)
    for source, trigger, dest, conds, unless, actions, error in machine_edges(machine):
        pred = _predicate(model, conds, unless)
        acts = tuple(getattr(model, a) for a in actions)
        err = getattr(model, error) if error else None
        table[(source, trigger)].append((pred, dest, acts, err))
    return {key: (*edges[:-1], (None, *edges[-1][1:])) for key, edges in table.items()}


class LoopMachine:
    """Drives the loop: `fire(trigger)` for hot triggers, `fire_cold(trigger)` for cold ones.

    Args:
        guards: guard name -> zero-argument callable returning a real bool.
        actions: action name -> zero-argument callable.
        loop: an object with `epoch` and `batch_idx` attributes, read for the flight record.
        history: how many transitions the flight recorder keeps.

    The probe attribute, when set, is called as `probe(state)` after every transition; tests use it to
    inject faults at each state.

    Paths since an agreement: the ranks of a distributed run compare the transitions they took since they last
    agreed (`agreed`; `path` lists them), to name the first one where their paths part. `taken` counts every
    transition (an attribute increment, no call, on the hot path); the hot ones are read back from the flight
    record, the cold ones are also kept apart (`cold_path`), since a rank may legitimately take more hot ones
    than its peers (a longer evaluation shard).
    """

    def __init__(self, guards, actions, loop, history: int = 64):
        self.spec = load_spec()
        self.machine = build_machine(self.spec, guards, actions)
        self.model = self.machine.models[0]
        self.table = compile_table(self.machine)
        # Plain tuples (epoch, batch, source, trigger, dest): cheaper to make than namedtuples per trigger.
        self.history: collections.deque[tuple] = collections.deque(maxlen=history)
        self.loop = loop
        self.probe: Callable[[str], None] | None = None
        self._cold = frozenset(t.name for t in self.spec.triggers if not t.hot)
        self.taken = 0  # transitions taken since the machine was built
        self.mark = 0  # `taken` when the ranks last agreed on their paths
        # The cold transitions since then: (index since the mark, epoch, batch, source, trigger, dest).
        self.cold_path: collections.deque[tuple] = collections.deque(maxlen=history)
        self.waiting_at: str | None = None  # the point where this rank waits for its peers' paths, if it does

    @property
    def state(self) -> str:
        """The current state's name."""
        return self.model.state

    def _take(self, source: str, trigger: str) -> tuple[str, tuple]:
        """The edge the table takes for `trigger` in `source` now, as `(dest, actions)`; its guards are
        asked in spec order (the last edge's never: `compile_table`), and an error edge raises here."""
        edges = self.table.get((source, trigger))
        if edges is None:
            self._invalid(source, trigger)
        for pred, dest, actions, error in edges:
            if pred is None or pred():
                if error is not None:
                    error()
                return dest, actions
        raise AssertionError(f"no edge matched ({source}, {trigger})")  # unreachable: the last has no guard

    def fire(self, trigger: str) -> str:
        """Fire a hot trigger on the compiled table (recorded, then probed); returns the new state."""
        model = self.model
        source = model.state
        dest, actions = self._take(source, trigger)
        model.state = dest
        loop = self.loop
        self.history.append((loop.epoch, loop.batch_idx, source, trigger, dest))
        self.taken += 1
        for action in actions:
            action()
        if self.probe is not None:
            self.probe(dest)
        return dest

    def record(self, source: str, trigger: str, dest: str) -> None:
        """Record an edge the caller took itself (a compiled micro-batch's fused edge), then probe."""
        loop = self.loop
        self.history.append((loop.epoch, loop.batch_idx, source, trigger, dest))
        self.taken += 1
        if self.probe is not None:
            self.probe(dest)

    def fire_cold(self, trigger: str) -> str:
        """Fire a cold trigger through `transitions`; returns the new state."""
        source = self.model.state
        if trigger not in self._cold:
            self._invalid(source, trigger, reason=f"{trigger!r} is a hot trigger; use fire()")
        try:
            self.model.trigger(trigger)
        except MachineError:
            self._invalid(source, trigger)
        dest = self.model.state
        name = getattr(trigger, "value", trigger)  # a TriggerName member is recorded by its plain name
        entry = (self.loop.epoch, self.loop.batch_idx, source, name, dest)
        self.history.append(entry)
        self.cold_path.append((self.taken - self.mark, *entry))
        self.taken += 1
        if self.probe is not None:
            self.probe(dest)
        return dest

    def agreed(self) -> None:
        """The ranks agree on their paths here: the next transition is the first of a new path."""
        self.mark = self.taken
        self.cold_path.clear()

    def path(self) -> dict:
        """The transitions since the last agreement, as JSON-able lists `[index since the agreement, epoch,
        batch, source, trigger, dest]`: `entries` (those the flight record still holds), `cold` (the cold ones),
        `count` (how many were taken) and `waiting_at` (where this rank waits for its peers, or None)."""
        for _ in range(3):  # another thread may read while the loop moves: read until both reads agree
            taken, history, cold = self.taken, list(self.history), list(self.cold_path)
            if taken == self.taken:
                break
        first = taken - len(history) - self.mark
        entries = [[first + n, *record] for n, record in enumerate(history) if first + n >= 0]
        return {"entries": entries, "cold": [list(record) for record in cold], "count": taken - self.mark,
                "waiting_at": self.waiting_at}

    def allowed(self, state: str | None = None) -> list[str]:
        """Triggers that have an edge from `state` (default: the current state)."""
        state = self.model.state if state is None else state
        return sorted({trigger for source, trigger in self.table if source == state})

    def _invalid(self, source: str, trigger: str, reason: str | None = None):
        reason = reason or f"no edge for trigger {trigger!r} in state {source!r}"
        raise InvalidTransition(f"{reason}; triggers allowed in {source!r}: {self.allowed(source)}")

    def reset(self) -> None:
        """Force the initial state (used only after a rollback failed half-way)."""
        self.model.state = self.spec.initial

    def records(self) -> list[Record]:
        """The recorded transitions, oldest first, as `Record`s."""
        return [Record(*r) for r in self.history]

    def flight_record(self, last: int = 12) -> str:
        """The last transitions as text, newest last, one per line."""
        lines = [f"  epoch {r.epoch} batch {r.batch}: {r.source} --{r.trigger}--> {r.dest}"
                 for r in self.records()[-last:]]
        return "\n".join(["last transitions of the deepepochs loop (newest last):", *lines])
