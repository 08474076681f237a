"""Time per state: the accounting behind `deepepochs.ProfileCallback`.

The loop is always in one state of its spec, so a profile needs no markers placed by hand: a `Timeline`
charges every nanosecond between a run's start and its end to what runs now, `(state, part)`, where the
part is `None` for the state itself or names a piece that runs inside it (an action, a callback hook, the
DataLoader's fetch, a piece of the compiled micro-batch, a console line). What a row's time counts as
comes from the spec (`State.cost`, `Action.cost`), callbacks count as theirs (`profile_cost`, default
`'callbacks'`), console lines as `'logging'`.

Nothing here runs when no profiler is attached: `profiled` installs the timing for one run and takes it
away after it, by swapping what the loop already looks up, never by a branch on the hot path:

- the machine's compiled table for one whose edges first enter the state they lead to, then run the
  actions, those that count as something else than their state (a checkpoint write) timed apart
  (`LoopMachine.table`); for cold triggers the actions `transitions` finds by name on the
  machine's model, timed (each enters its edge's state first), and `fire_cold`, which enters the state an
  edge without actions leads to;
- the compiled micro-batch: `deepepochs.engine.compiled.bind` makes the profiled variant of the same
  generated code (one `enter_state` line after each state move, the forward and the loss and the actions
  that count apart timed);
- the hook table's handlers and the console's printing methods, timed;
- the batch loops wrap their batches' iterator in `Timeline.fetching` (asked once per task).

With `trace_window > 0` the timeline also keeps the visits themselves for a trace (`TraceWindow`), grouped
under their epoch and the update they lead to, the last `trace_window` updates at most. What runs once per
update (torch.profiler's step, reading a CUDA run's device times) hooks in through `Timeline.at_updates`, on
the one timeline that needs it.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time

from deepepochs.engine.context import Context
from deepepochs.engine.emit import wrap_handlers
from deepepochs.fsm.machine import compile_table, load_spec

__all__ = ["Timeline", "TraceWindow", "find", "profiled", "profiles"]

_now = time.perf_counter_ns
#: The most events one trace segment keeps (a run with no updates, e.g. test(), is one segment).
SEGMENT_EVENTS = 50_000


class TraceWindow:
    """The visits of the last `updates` segments of a run: a segment ends where an update commits or an
    epoch begins. Memory stays bounded by the window (and `SEGMENT_EVENTS` per segment)."""

    def __init__(self, updates: int):
        self.segments: collections.deque[list] = collections.deque(maxlen=updates)  # [name, t0, t1, events]
        self.epochs: list[list] = []  # [name, t0, t1]
        self.dropped_segments = 0
        self.dropped_events = 0

    def segment(self, name: str, now: int) -> None:
        """Close the running segment at `now` and open one called `name`."""
        if self.segments:
            self.segments[-1][2] = now
            if len(self.segments) == self.segments.maxlen:
                self.dropped_segments += 1
        self.segments.append([name, now, None, []])

    def epoch(self, name: str | None, now: int) -> None:
        """Close the running epoch's span at `now`; open one called `name` (None: none)."""
        if self.epochs and self.epochs[-1][2] is None:
            self.epochs[-1][2] = now
        if name is not None:
            self.epochs.append([name, now, None])
        first = self.segments[0][1] if self.segments else now
        while len(self.epochs) > 1 and self.epochs[0][2] is not None and self.epochs[0][2] <= first:
            self.epochs.pop(0)  # wholly before the window

    def add(self, name: str, cost: str, t0: int, t1: int) -> None:
        """One visit (a state's, or a part's inside it)."""
        events = self.segments[-1][3]
        if len(events) < SEGMENT_EVENTS:
            events.append((name, cost, t0, t1))
        else:
            self.dropped_events += 1

    def close(self, now: int) -> None:
        """The run ended at `now`."""
        self.epoch(None, now)
        if self.segments:
            self.segments[-1][2] = now


class Timeline:
    """Charges every nanosecond of a run to one `(state, part)` (see the module's docstring).

    Args:
        loop: the run's `LoopState` (its epoch and update count group a trace's visits).
        trace_window: how many updates a trace keeps (0: no trace).
    """

    def __init__(self, loop, trace_window: int = 0):
        spec = load_spec()
        self.loop = loop
        self.state_costs = {s.name: s.cost for s in spec.states}
        self.part_costs: dict[str, str] = {a.name: a.cost for a in spec.actions if a.cost is not None}
        self.totals: dict[tuple[str, str | None], list[int]] = {}  # (state, part) -> [visits, ns]
        self.state = spec.initial
        self.key: tuple[str, str | None] = (self.state, None)
        self.since = self.started = self.stopped = self.started_wall = 0
        self.visit_start = 0
        self.trace = TraceWindow(trace_window) if trace_window else None
        self.epoch = self.updates = None
        self.loaders: dict[str, set] = {}  # stage -> the num_workers of the DataLoaders fetched from
        self.marks: dict[str, collections.deque] = {}  # part -> when its last calls started (set before binding)

    # ---- the clock ----
    def _charge(self, now: int) -> None:
        slot = self.totals.get(self.key)
        if slot is None:
            slot = self.totals[self.key] = [0, 0]
        slot[1] += now - self.since
        self.since = now

    def _visit(self, key) -> None:
        slot = self.totals.get(key)
        if slot is None:
            slot = self.totals[key] = [0, 0]
        slot[0] += 1

    def start(self, state: str) -> None:
        """The run starts now, in `state`."""
        self.started = self.since = self.visit_start = _now()
        self.started_wall = time.time_ns()  # the host clock's start: ranks' traces line up by it
        self.state, self.key = state, (state, None)
        self._visit(self.key)
        if self.trace is not None:
            self._group(self.started)

    def stop(self) -> None:
        """The run ends now: the time since the last mark is charged, the last visit closed."""
        now = self.stopped = _now()
        self._charge(now)
        if self.trace is not None:
            self.trace.add(self.state, self.state_costs[self.state], self.visit_start, now)
            self.trace.close(now)

    def enter(self, state: str) -> None:
        """The machine entered `state` (a self-loop too: each entry is a visit)."""
        now = _now()
        totals, key = self.totals, self.key
        slot = totals.get(key)
        if slot is None:
            slot = totals[key] = [0, 0]
        slot[1] += now - self.since
        self.since = now
        if self.trace is not None:
            self.trace.add(self.state, self.state_costs[self.state], self.visit_start, now)
            self._group(now)
        self.visit_start = now
        self.state = state
        if key[1] is None:  # inside a part, the part goes on (and its end counts no visit)
            key = self.key = (state, None)
            slot = totals.get(key)
            if slot is None:
                slot = totals[key] = [0, 0]
            slot[0] += 1

    def _group(self, now: int) -> None:
        """Trace: a new epoch or a committed update starts a new segment here."""
        loop = self.loop
        epoch, updates = loop.epoch, loop.run.updates
        if epoch != self.epoch:
            self.trace.epoch(f"epoch {epoch}" if epoch else None, now)
        if epoch != self.epoch or updates != self.updates:
            self.trace.segment(f"update {updates + 1}", now)
        self.epoch, self.updates = epoch, updates

    def timed(self, name: str, fn, cost: str | None = None, model=None):
        """`fn` with its time charged to `(state, name)`; `cost`: what it counts as (default: the spec's
        cost of the action `name`, else its state's). `model`: the machine's model, whose state is entered
        first if the timeline has not seen it yet (an action of a cold trigger runs before the trigger
        returns)."""
        if cost is not None:
            self.part_costs.setdefault(name, cost)
        timeline, marks = self, self.marks.get(name)

        def run(*args, **kwargs):
            if model is not None and model.state != timeline.state:
                timeline.enter(model.state)
            start = _now()
            timeline._charge(start)
            if marks is not None:
                marks.append(start)
            outer = timeline.key
            key = timeline.key = (timeline.state, name)
            timeline._visit(key)
            try:
                return fn(*args, **kwargs)
            finally:
                end = _now()
                timeline._charge(end)
                state = timeline.state
                timeline.key = outer if outer[0] == state else (state, None)
                if timeline.trace is not None and key[0] == state:
                    timeline.trace.add(name, timeline.part_costs.get(name) or timeline.state_costs[state], start, end)

        run.__wrapped__, run.part = fn, name
        return run

    def at_updates(self, name: str, fn, cost: str = "other") -> None:
        """Call `fn()` at each update boundary of the run (the first state entered after an update commits, or
        after a rollback took updates back), its time charged as the part `name` of that state. It wraps this
        instance's `enter` (set up before the run binds it): a timeline without such a call runs as before."""
        enter, call, loop = self.enter, self.timed(name, fn, cost=cost), self.loop
        last = [loop.run.updates]

        def enter_at_updates(state: str) -> None:
            enter(state)
            if loop.run.updates != last[0]:
                last[0] = loop.run.updates
                call()

        self.enter = enter_at_updates

    def costs_apart(self, name: str) -> bool:
        """Whether the part `name` is timed apart: it counts as something else than its state (a checkpoint
        write, a hook), or the times it starts are kept (`marks`)."""
        return name in self.part_costs or name in self.marks

    def fetching(self, batches, stage: str, loader=None):
        """`batches` (an iterable) with each fetch timed as the part `fetch` of the state it runs in;
        `loader`: the DataLoader behind them (its `num_workers` is kept for the verdict)."""
        self.loaders.setdefault(stage, set()).add(getattr(loader, "num_workers", None))
        fetch = self.timed("fetch", iter(batches).__next__)
        while True:
            try:
                batch = fetch()
            except StopIteration:
                return
            yield batch

    # ---- the results ----
    def cost_of(self, key: tuple[str, str | None]) -> str:
        """What the time of row `key` counts as."""
        return (key[1] is not None and self.part_costs.get(key[1])) or self.state_costs[key[0]]

    @property
    def wall_ns(self) -> int:
        """The run's measured wall time (up to now while it runs)."""
        return (self.stopped or _now()) - self.started


def find(callbacks):
    """The profiler among `callbacks` (the first with `profile_begin`), or None."""
    return next((cb for cb in callbacks if callable(getattr(cb, "profile_begin", None))), None)


def _install(ctx: Context, timeline: Timeline):
    """Time the machine's edges and actions, the callback hooks and the console for one run; returns what
    undoes it."""
    machine, hooks, console = ctx.machine, ctx.parts.hooks, ctx.parts.console
    model = machine.model
    names = [a.name for a in machine.spec.actions]
    actions = {name: model.__dict__[name] for name in names}
    for name in names:
        model.__dict__[name] = timeline.timed(name, actions[name], model=model)
    fire_cold = machine.fire_cold

    def timed_fire_cold(trigger):
        dest = fire_cold(trigger)
        if dest != timeline.state:  # an edge without actions (those with some entered it, see `timed`)
            timeline.enter(dest)
        return dest

    machine.fire_cold = timed_fire_cold
    table = machine.table
    plain = {id(fn): fn.__wrapped__ for fn in model.__dict__.values() if hasattr(fn, "__wrapped__")}
    machine.table = {  # hot edges: per batch, only the actions costed apart are timed (see `costs_apart`)
        key: tuple((pred, dest, (_entering(timeline, dest),
                                 *(act if timeline.costs_apart(act.part) else plain[id(act)] for act in acts)), error)
                   for pred, dest, acts, error in edges)
        for key, edges in compile_table(machine.machine).items()}
    by_event = hooks.by_event
    hooks.by_event = timed_hooks = wrap_handlers(by_event, functools.partial(_timed_hook, timeline))
    printing = [name for name in ("batch", "epoch", "start_task", "end_task", "test", "info", "decision")
                if callable(getattr(console, name, None)) and name not in vars(console)]
    for name in printing:
        setattr(console, name, timeline.timed(f"console.{name}", getattr(console, name), cost="logging"))

    def undo():
        model.__dict__.update(actions)
        del machine.fire_cold
        machine.table = table
        if hooks.by_event is timed_hooks:  # callbacks attached during the run recompiled it: keep theirs
            hooks.by_event = by_event
        for name in printing:
            delattr(console, name)

    return undo


def _entering(timeline: Timeline, dest: str):
    def enter():
        timeline.enter(dest)
    return enter


def _timed_hook(timeline: Timeline, event: str, handler):
    owner = getattr(getattr(handler, "__wrapped__", handler), "__self__", None)  # the callback, if a method
    name = f"{type(owner).__name__ if owner is not None else getattr(handler, '__qualname__', 'hook')}.{event}"
    return timeline.timed(name, handler, cost=getattr(owner, "profile_cost", "callbacks"))


@contextlib.contextmanager
def profiled(ctx: Context, run: str):
    """Profile the run `run` ('fit', 'test', 'predict') when a profiler is attached and none runs yet: its
    `profile_begin(ctx, run)` returns the `Timeline`, its `profile_end(ctx, run, timeline, failed)` gets it
    back after the run (`failed`: the run raised)."""
    profiler = find(ctx.parts.hooks.callbacks)
    if profiler is None or ctx.profiler is not None:
        yield
        return
    timeline = profiler.profile_begin(ctx, run)
    timeline.start(ctx.machine.state)
    undo = timeline.timed("profiler_setup", _install, cost="other")(ctx, timeline)  # its own cost, shown
    ctx.profiler = timeline
    failed = True
    try:
        yield
        failed = False
    finally:
        timeline.stop()
        ctx.profiler = None
        undo()
        profiler.profile_end(ctx, run, timeline, failed)


def profiles(run: str):
    """Decorate a `Trainer` method that runs `run` ('fit', 'test', 'predict'): the whole call is profiled
    (`profiled`), its argument checks and run lock included, so the table covers its wall time."""
    def decorate(method):
        @functools.wraps(method)
        def profiled_method(trainer, *args, **kwargs):
            with profiled(trainer._ctx, run):
                return method(trainer, *args, **kwargs)
        return profiled_method
    return decorate
