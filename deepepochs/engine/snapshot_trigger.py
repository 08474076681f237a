"""Snapshots at commit points: when the `snapshot` trigger fires, and how ranks agree.

With a snapshot writer attached (a callback with `count_update`, `poll_snapshot`, `write_snapshot`,
`late_signal` and `signals`: see `deepepochs.callbacks.SnapshotCallback`), every commit point fires the
spec's `snapshot` trigger: after each committed window of a training task (`task_train`) and after each
epoch's commit (`fit_running`).
Its guards read what `commit_point` decided: `snapshot_due` (the writer wants one here) and
`stop_signalled` (a signal it listens for arrived). Without a writer nothing is fired and nothing is
paid.

Under DDP a signal may reach only some ranks, and minutes differ per rank: when the writer listens for
signals or counts minutes, one small all-reduce per commit point makes every rank take the same edge.
"""

from __future__ import annotations

import torch

from deepepochs.engine.context import Context
from deepepochs.fsm.events import TriggerName

__all__ = ["after_fit", "commit_point", "find_writer"]

SNAPSHOT = TriggerName.SNAPSHOT.value  # a plain str: fired per commit point (see batches.py)


def find_writer(callbacks):
    """The snapshot writer among `callbacks` (at most one is attached), or None."""
    return next((cb for cb in callbacks if callable(getattr(cb, "poll_snapshot", None))), None)


def commit_point(ctx: Context, epoch_end: bool) -> None:
    """At a commit point with a writer attached: decide (agreed over the ranks) and fire `snapshot`."""
    due, signal = ctx.snapshots.poll_snapshot(epoch_end)
    _fire(ctx, due, signal)


def after_fit(ctx: Context) -> None:
    """Once the fit's end hooks ran (the writer has disarmed: a signal from now on goes to the handler it
    replaced): a signal that arrived after the last commit point's decision (while its snapshot was written,
    or in `on_after_fit`) still ends the fit with `Preempted`, without another snapshot (the one at the last
    epoch's end holds everything). Fires `snapshot` only when a signal arrived (on any rank)."""
    _fire(ctx, False, ctx.snapshots.late_signal(), only_signal=True)


def _fire(ctx: Context, due: bool, signal: str | None, only_signal: bool = False) -> None:
    """Fire `snapshot` with its guards' inputs (`snapshot_due`, `stop_signal`), agreed over the ranks first
    when the writer's decision can differ between them (signals, minutes); with `only_signal`, fire only
    when a signal arrived."""
    writer, loop, dist = ctx.snapshots, ctx.loop, ctx.parts.dist
    if dist.world_size > 1 and writer.must_agree:
        names = writer.signals
        flags = torch.zeros(1 + len(names), device=ctx.parts.device)
        flags[0] = float(due)
        if signal is not None:
            flags[1 + names.index(signal)] = 1.0
        flags = dist.reduce_sum(flags).tolist()
        due = flags[0] > 0
        if signal is None:
            signal = next((name for name, n in zip(names, flags[1:]) if n > 0), None)
    if only_signal and signal is None:
        return
    loop.snapshot_due = not only_signal and (due or signal is not None)
    loop.stop_signal = signal
    ctx.machine.fire(SNAPSHOT)
