"""Device time per state on a CUDA device, beside the host time (`ProfileCallback` on a CUDA run).

At each point where the `Timeline` moves from one `(state, part)` to the next, a CUDA event is recorded on the
current stream; the device time between two events is the stream's time from the work queued before the
first to the work queued before the second, charged to the `(state, part)` the host was in between them
(idle gaps of the stream included, so the rows add up to the stream's whole span).

Recording an event does not wait for the device. The events are read only at update boundaries, and then
only those the device has already passed (`Event.query`, a binary search: no wait), and at the run's end,
where one `synchronize` on the last event waits for the device once; never a synchronisation per
micro-batch. Read events are reused, so memory stays bounded by how far the device lags behind the host.
"""

from __future__ import annotations

__all__ = ["DeviceTimes"]


class DeviceTimes:
    """CUDA events at the timeline's marks, read into `totals` (`{(state, part): device ns}`).

    `install(timeline)` wraps that timeline instance's `start`, `enter` and `_charge` (the places where its
    key changes) and reads at its update boundaries (`Timeline.at_updates`); a timeline on the CPU is never
    given one and runs as before.
    """

    def __init__(self, event=None):
        if event is None:
            import torch

            def event():
                return torch.cuda.Event(enable_timing=True)

        self._event = event  # makes an event: `record()`, `query()`, `synchronize()`, `elapsed_time(later)` in ms
        self.totals: dict[tuple, int] = {}
        self._pending: list[tuple] = []  # (the key closed at the event, the event), oldest first
        self._last = None  # the newest event already read: the next interval starts there
        self._free: list = []

    @classmethod
    def for_device(cls, device) -> DeviceTimes | None:
        """One for a run on `device` when it is a CUDA device, else None (the host's clock alone)."""
        return cls() if device.type == "cuda" else None

    def mark(self, closing) -> None:
        """Record an event on the current stream, closing the interval of `closing` (None: opens one)."""
        event = self._free.pop() if self._free else self._event()
        event.record()
        self._pending.append((closing, event))

    def read(self, wait: bool = False) -> None:
        """Charge the intervals the device has finished (`wait`: wait for all of them, at the run's end)."""
        pending = self._pending
        if not pending:
            return
        if wait:
            pending[-1][1].synchronize()  # the one wait for the device: the run is over
            done = len(pending)
        else:  # events complete in stream order: find the first one not yet passed
            low, high = 0, len(pending)
            while low < high:
                middle = (low + high) // 2
                if pending[middle][1].query():
                    low = middle + 1
                else:
                    high = middle
            done = low
        totals = self.totals
        for key, event in pending[:done]:
            if self._last is not None and key is not None:
                ns = round(self._last.elapsed_time(event) * 1e6)  # elapsed_time is in milliseconds
                totals[key] = totals.get(key, 0) + ns
            if self._last is not None:
                self._free.append(self._last)
            self._last = event
        del pending[:done]

    def install(self, timeline) -> None:
        """Mark `timeline`'s key changes with events and read them at its update boundaries."""
        start, enter, charge = timeline.start, timeline.enter, timeline._charge

        def start_marked(state):
            start(state)
            self.mark(None)

        def enter_marked(state):
            self.mark(timeline.key)
            enter(state)

        def charge_marked(now):
            self.mark(timeline.key)
            charge(now)

        timeline.start, timeline.enter, timeline._charge = start_marked, enter_marked, charge_marked
        timeline.at_updates("device_times", self.read)
