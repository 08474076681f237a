"""`ProfileCallback`: where a run's time goes, state by state of the loop's spec.

The loop is always in one state of its spec, so every nanosecond of a fit (or test, or predict) belongs to
one: the engine charges it to the state, or to the part running inside it (an action such as a
checkpoint write, a callback hook, the DataLoader's fetch, the forward, loss and backward of a compiled
micro-batch, a console line; `deepepochs.engine.profiling`). What each state and action counts as is
written in the spec (`State.cost`, `Action.cost`). Without this callback none of it runs.
"""

from __future__ import annotations

import collections
import functools
import json
import os
from pathlib import Path

from deepepochs.callbacks.base import Callback
from deepepochs.engine.device_times import DeviceTimes
from deepepochs.engine.operator_trace import OperatorTrace, default_schedule, is_schedule
from deepepochs.engine.profiling import Timeline
from deepepochs.errors import ConfigError
from deepepochs.fsm.events import ActionName
from deepepochs.reporting.profile_report import (
    CATEGORIES,
    category_shares,
    merge_traces,
    straggler_line,
    summary_text,
    table_rows,
    trace_document,
    verdict,
)

__all__ = ["ProfileCallback"]


class ProfileCallback(Callback):
    """Time every state the loop enters and say where the run's time went.

    After each `fit`, `test` or `predict`, `table` lists one row per state (and per part that runs inside
    one: `'task_train/fetch'`, `'step_forward/loss_value'`, `'epoch_end/save_checkpoints'`,
    `'task_train/MyCallback.on_after_train_batch'`) as `{'state', 'category', 'count', 'seconds', 'share'}`,
    the largest first; the rows add up to the run's whole wall time. `bottleneck` is the category with the
    largest share, `verdict` a sentence saying what to try, `summary()` the table as text (printed at the
    run's end). Under DDP, `straggler` says which rank the others waited for at the gradient
    synchronisations of the last `trace_updates` updates, and how long in all (host clocks; on one machine
    exact, across machines as good as their clocks agree).

    Args:
        trace: a path: also write the run as a Chrome trace-event JSON file (opens in Perfetto or
            chrome://tracing), one complete event per state visit, under its epoch and update. Under DDP
            rank 0 writes every rank's track into it (process r: rank r); after a failed run each rank
            writes its own (`<stem>.rank<r><suffix>` for r > 0). Each rank's `table` is its own.
        torch_profiler: also run torch.profiler during a fit and merge its operator trace into the `trace`
            file, on the loop's clock, so that each operator sits under the state it ran in (the loop thread's
            on the loop's track, other threads and CUDA streams on tracks beside it). A
            `torch.profiler.schedule(wait=..., warmup=..., active=..., repeat=...)` counted in updates (the
            profiler steps at update boundaries, not per micro-batch), or True for a window of three updates
            after two (`wait=1, warmup=1, active=3`). Needs `trace`. None or False: torch.profiler is not
            touched.
        trace_updates: how many of the last updates the trace keeps (memory stays bounded; the file says
            how many were dropped).

    On a CUDA device each row also has `'device_seconds'`: the device's time in that state, from CUDA events
    recorded on the current stream and read at update boundaries and the run's end (no synchronisation per
    batch); the summary adds the column.

    Example:
        >>> profiler = ProfileCallback()
        >>> # Trainer(model, opt, loss, callbacks=[profiler]).fit(train_dl, epochs=2)
        >>> # profiler.bottleneck, profiler.verdict, print(profiler.summary())
    """

    def __init__(self, trace: str | os.PathLike | None = None, torch_profiler=None, trace_updates: int = 200):
        super().__init__()
        if trace is not None:
            if not isinstance(trace, (str, os.PathLike)):
                raise ConfigError(f"trace must be a file path (str or os.PathLike) or None (got"
                                  f" {type(trace).__name__})")
            folder = Path(trace).parent
            if not folder.is_dir():
                raise ConfigError(f"trace={str(trace)!r}: the folder {str(folder)!r} does not exist; create it"
                                  " first or write the trace elsewhere")
        if torch_profiler is True:
            torch_profiler = default_schedule()
        elif torch_profiler is None or torch_profiler is False:
            torch_profiler = None
        elif not is_schedule(torch_profiler):
            raise ConfigError(f"torch_profiler must be None, False, True (a window of a few updates) or a"
                              f" torch.profiler.schedule(...) (got {torch_profiler!r})")
        if torch_profiler is not None and trace is None:
            raise ConfigError("torch_profiler needs trace=<a file path>: torch's operator trace is merged into that"
                              " file (got trace=None)")
        if isinstance(trace_updates, bool) or not isinstance(trace_updates, int) or trace_updates < 1:
            raise ConfigError(f"trace_updates must be a whole number >= 1 (got {trace_updates!r})")
        self.trace = None if trace is None else Path(trace)
        self.trace_updates = trace_updates
        self.torch_schedule = torch_profiler
        self.operators: OperatorTrace | None = None  # the last fit's torch.profiler events
        self.table: list[dict] = []
        self.bottleneck: str | None = None
        self.verdict: str | None = None
        self.timeline: Timeline | None = None
        self.run: str | None = None
        self.straggler: str | None = None
        self.trace_path: Path | None = None
        self._running: Timeline | None = None
        self._mark: tuple[dict, int] | None = None  # (ns per category, when) at the last validation point
        self._interval: tuple[int, dict] | None = None  # (its step, its shares)
        self._device: DeviceTimes | None = None

    # ---- called by the engine around a run (deepepochs.engine.profiling.profiled) ----
    def profile_begin(self, ctx, run: str) -> Timeline:
        """The timeline for the run `run` that starts now."""
        self._running = Timeline(ctx.loop, self.trace_updates if self.trace is not None else 0)
        self._mark = self._interval = None
        if ctx.parts.dist.world_size > 1:  # when each window's synchronising micro-batch starts, for `straggler`
            self._running.marks[ActionName.SYNC_GRADIENTS.value] = collections.deque(maxlen=self.trace_updates)
        self._device = DeviceTimes.for_device(ctx.parts.device)
        if self._device is not None:
            self._device.install(self._running)
        self.operators = None
        if self.torch_schedule is not None and run == "fit":  # a schedule counted in updates: fits only
            self.operators = OperatorTrace(self.torch_schedule, ctx.parts.device.type == "cuda")
            self._running.at_updates("torch_profiler", functools.partial(_step, self.operators, self._running))
            self.operators.start()
        return self._running

    def profile_end(self, ctx, run: str, timeline: Timeline, failed: bool) -> None:
        """The run ended (`failed`: it raised): make the table and verdict, write the trace, and print the
        summary of a run that did not fail."""
        self.timeline, self.run, self._running = timeline, run, None
        if self.operators is not None:
            self.operators.stop()  # after the run's clock stopped: reading the last window back is not the run's
        device = None
        if self._device is not None:
            times, self._device = self._device, None
            try:
                times.read(wait=True)
                device = times.totals
            except RuntimeError:  # a CUDA error that failed the run comes back here: the run's own error is raised
                if not failed:
                    raise
        self.table = table_rows(timeline.totals, timeline.cost_of, timeline.wall_ns, device)
        self.bottleneck, self.verdict = verdict(self.table, run, timeline.loaders.get("train"))
        self.straggler = None
        syncs = timeline.marks.get(ActionName.SYNC_GRADIENTS.value)
        if syncs is not None and not failed:  # one gather at the run's end, every rank there
            host = [timeline.started_wall + t - timeline.started for t in syncs]
            self.straggler = straggler_line(ctx.parts.dist.all_gather_object(host))
        if self.trace is not None:
            self.trace_path = self._write_trace(ctx.parts.dist, run, timeline, failed)
        if not failed:
            ctx.parts.console.decision(self.summary())

    def interval_shares(self, step: int) -> dict[str, float]:
        """`{category: share}` of the running fit's time since the previous call (or its start) up to now,
        the validation point at update `step`; asked again for the same step, the same answer (every
        logging callback logs the same numbers). `{}` outside a profiled run."""
        timeline = self._running
        if timeline is None:
            return {}
        if self._interval is not None and self._interval[0] == step:
            return self._interval[1]
        now = timeline.since  # the time up to here is charged (a hook runs now, timed from its start)
        spent = dict.fromkeys(CATEGORIES, 0)
        for key, (_, ns) in timeline.totals.items():
            spent[timeline.cost_of(key)] += ns
        before, since = self._mark if self._mark is not None else ({}, timeline.started)
        span = max(now - since, 1)
        shares = {category: (ns - before.get(category, 0)) / span for category, ns in spent.items()}
        self._mark, self._interval = (spent, now), (step, shares)
        return shares

    def _write_trace(self, dist, run: str, timeline: Timeline, failed: bool) -> Path | None:
        """Write the run's trace; returns its path on this rank. Under DDP, after a run every rank finished,
        rank 0 writes every rank's track into the one file (one gather, at the run's end); after a failure
        each rank writes its own (`<stem>.rank<r><suffix>` on ranks > 0): no collective a failed rank
        would never join."""
        rank = dist.rank
        document = trace_document(timeline.trace, run, timeline.started, timeline.stopped, rank, self.table,
                                  timeline.started_wall, self.operators)
        if dist.world_size > 1 and not failed:
            documents = dist.all_gather_object(document)
            if rank != 0:
                return None
            document = merge_traces(documents)
        path = self.trace if rank == 0 else self.trace.with_name(f"{self.trace.stem}.rank{rank}{self.trace.suffix}")
        path.write_text(json.dumps(document))
        return path

    # ---- results ----
    @property
    def shares(self) -> dict[str, float]:
        """Each category's share of the last run's wall time (a dict from category name to share)."""
        return category_shares(self.table)

    def summary(self, limit: int = 12) -> str:
        """The last run's table as text (its `limit` largest rows), with the verdict."""
        if self.timeline is None:
            return "Where the time goes: nothing profiled yet"
        return summary_text(self.table, self.run, self.timeline.wall_ns / 1e9, self.verdict, limit, self.straggler)


def _step(operators: OperatorTrace, timeline: Timeline) -> None:
    """An update boundary of a fit under torch.profiler: its schedule's next step; the operator windows that
    ended before the trace's kept updates are dropped (memory stays bounded)."""
    operators.step()
    segments = timeline.trace.segments
    if segments:
        operators.drop_before(segments[0][1])
