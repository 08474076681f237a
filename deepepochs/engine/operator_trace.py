"""torch's operator trace for a window of a fit's updates, on the profile's clock
(`ProfileCallback(torch_profiler=...)`).

torch.profiler runs with a schedule counted in updates: its `step()` is called at each update boundary (the
first state the loop enters after an update commits, `Timeline.at_updates`), never per micro-batch. Each
window it records is exported as a Chrome trace into a temporary file and read back at once; the events are
kept on the timeline's clock (`time.perf_counter_ns`), so that the profile's trace file shows each operator
under the state it ran in. Nothing here is imported or run unless `torch_profiler` asks for it.

The two clocks: torch stamps its events with a clock of its own. Right after a window opens and right before
it closes, a few empty `record_function` marks are recorded, each between two readings of our clock; a mark's
start and end bound the offset between the clocks, and the bounds of all of a window's marks together give it
to a few microseconds.
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
import threading
import time
import warnings

__all__ = ["CLOCK_MARK", "OperatorTrace", "clock_offset", "default_schedule", "is_schedule"]

_now = time.perf_counter_ns
#: The name of the marks that line torch's clock up with ours (left out of the merged trace).
CLOCK_MARK = "deepepochs.clock"
#: How many marks at each end of a window.
MARKS = 6
#: torch's events left out of the merged trace: our marks, and the profiler's own step spans, which run from
#: one update boundary to the next across the loop's states.
_LEFT_OUT = (CLOCK_MARK, "ProfilerStep#")


def default_schedule():
    """`torch_profiler=True`'s window: skip the first update (its one-time costs), warm up over the second,
    record the next three, once."""
    from torch.profiler import schedule

    return schedule(wait=1, warmup=1, active=3, repeat=1)


def is_schedule(value) -> bool:
    """Whether `value` is a torch.profiler schedule: a callable from an update's number to a
    `ProfilerAction`."""
    from torch.profiler import ProfilerAction

    if not callable(value):
        return False
    try:
        return isinstance(value(0), ProfilerAction)
    except Exception:  # noqa: BLE001 (any failure says it is not one)
        return False


class OperatorTrace:
    """torch.profiler over the updates its `schedule` picks, the operators it records kept on our clock.

    Args:
        schedule: a `torch.profiler.schedule(...)`, counted in updates.
        cuda: also record the CUDA kernels and copies (a run on a CUDA device).

    Attributes:
        events: `(name, cat, t0, t1, lane, args)` per recorded event, `t0`/`t1` on `time.perf_counter_ns`'s
            clock; `lane` 0 is the thread that runs the loop, the others numbered from 1 as first seen.
        lanes: `{lane: name}` of the lanes beside 0 (torch's thread and stream names).
        windows: how many windows were read back and placed on our clock; `unplaced`: how many were left
            out, their clock marks missing (the trace file says so).
    """

    def __init__(self, schedule, cuda: bool = False):
        import torch.profiler as tp

        self._actions = tp.ProfilerAction
        self._record = tp.record_function
        activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if cuda else [])
        self._profile = tp.profile(activities=activities, schedule=schedule, on_trace_ready=self._read)
        self._main = (os.getpid(), threading.get_native_id())  # torch's (pid, tid) of the loop's thread
        self._lane_of: dict[tuple, int] = {}
        self._marks: list[tuple[int, int, int]] = []  # (before, inside, after) per mark, on our clock
        self._kept: collections.deque[tuple[int, list]] = collections.deque()  # (its last end, its events)
        self.lanes: dict[int, str] = {}
        self.windows = self.unplaced = 0

    def _recording(self) -> bool:
        return self._profile.current_action in (self._actions.RECORD, self._actions.RECORD_AND_SAVE)

    def _mark(self) -> None:
        for _ in range(MARKS):
            before = _now()
            with self._record(CLOCK_MARK):
                inside = _now()
            self._marks.append((before, inside, _now()))

    def start(self) -> None:
        """Start the profiler (update 0 of the schedule)."""
        self._moving(self._profile.start, before=False)

    def step(self) -> None:
        """An update boundary: the schedule's next step (a window that ends now is read back)."""
        self._moving(self._step)

    def stop(self) -> None:
        """The run ended: stop the profiler (a window still recording is read back)."""
        self._moving(self._profile.stop, after=False)

    def _step(self) -> None:
        with warnings.catch_warnings():  # each window is read back as it ends: keeping only the last is meant
            warnings.filterwarnings("ignore", message="Warning: Profiler clears events at the end of each cycle")
            self._profile.step()

    def _moving(self, move, before: bool = True, after: bool = True) -> None:
        """`move` the profiler on, with clock marks at the end of the window it leaves and the start of the one
        it enters (`before`, `after`: where a window can be recording)."""
        if before and self._recording():
            self._mark()
        move()
        if after and self._recording():
            self._mark()

    @property
    def events(self) -> list[tuple]:
        """The events of the windows kept, oldest first."""
        return [event for _, events in self._kept for event in events]

    def drop_before(self, t: int) -> None:
        """Forget the windows that ended before `t` (our clock): the trace keeps a bounded number of updates."""
        while self._kept and self._kept[0][0] < t:
            self._kept.popleft()

    def _read(self, profile) -> None:
        """`on_trace_ready`: export the window to a temporary file, read it back, keep its events."""
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "operators.json")
            profile.export_chrome_trace(path)
            with open(path) as f:
                document = json.load(f)
        marks, self._marks = self._marks, []
        events = document.get("traceEvents", [])
        names = {(e.get("pid"), e.get("tid")): e["args"].get("name") for e in events
                 if e.get("ph") == "M" and e.get("name") == "thread_name" and isinstance(e.get("args"), dict)}
        found = sorted((e for e in events if e.get("ph") == "X" and e.get("name") == CLOCK_MARK
                        and (e.get("pid"), e.get("tid")) == self._main), key=lambda e: e["ts"])
        offset = clock_offset(found, marks)
        if offset is None:  # its marks did not come back: it cannot be placed on the loop's clock
            self.unplaced += 1
            return
        self.windows += 1
        kept = []
        for e in events:
            if e.get("ph") != "X" or "dur" not in e or str(e.get("name", "")).startswith(_LEFT_OUT):
                continue
            t0 = round(e["ts"] * 1000) - offset
            kept.append((e["name"], e.get("cat", "torch"), t0, t0 + round(e["dur"] * 1000),
                         self._lane((e.get("pid"), e.get("tid")), names), e.get("args")))
        if kept:
            self._kept.append((max(event[3] for event in kept), kept))

    def _lane(self, where: tuple, names: dict) -> int:
        lane = self._lane_of.get(where)
        if lane is None:
            lane = self._lane_of[where] = 0 if where == self._main else len(self.lanes) + 1
            if lane:
                tid = where[1]
                self.lanes[lane] = f"torch: {names.get(where) or (f'thread {tid}' if isinstance(tid, int) else tid)}"
        return lane


def clock_offset(found: list[dict], marks: list[tuple[int, int, int]]) -> int | None:
    """torch's clock minus ours (ns), from the marks torch recorded (`found`, oldest first) and our readings
    around them (`marks`, `(before, inside, after)`, the same marks in the same order): each mark's start lies
    between `before` and `inside`, its end between `inside` and `after`. The middle of the bounds all marks
    agree on; if they agree on none (a clock stepped), the middle of the tightest mark's. None without marks."""
    if not found or len(found) != len(marks):
        return None
    bounds = []
    for event, (before, inside, after) in zip(found, marks):
        start, end = round(event["ts"] * 1000), round((event["ts"] + event["dur"]) * 1000)
        bounds.append((max(start - inside, end - after), min(start - before, end - inside)))
    low, high = max(b[0] for b in bounds), min(b[1] for b in bounds)
    if low > high:
        low, high = min(bounds, key=lambda b: b[1] - b[0])
    return (low + high) // 2
