"""Snapshots at commit points: when the `snapshot` trigger fires, and how ranks agree.

With a snapshot writer attached (a callback with `poll_snapshot`, `write_snapshot`,
`late_signal` and `signals`: see `deepepochs.callbacks.SnapshotCallback`), every commit point fires the
spec's `snapshot` trigger: after each committed window of a training task (`task_train`) and after each
epoch's commit (`fit_running`).
Its guards read what `commit_point` decided: `snapshot_due` (the writer wants one here) and
`stop_signalled` (a signal it listens for arrived). Without a writer nothing is fired and nothing is
paid.

Under DDP a signal may reach only some ranks, and minutes differ per rank: when the writer listens for
signals or counts minutes, one small all-reduce per commit point makes every rank take the same edge.

Fetching stops too, in every stage's batch loop (`guard`: training, validation, and test, prediction and
the LR sweep, where no writer listens). A scheduler signals the whole job: the DataLoader workers die with
the main process's signal, and a fetch after it would wait for them and fail. A fetch that fails once a
listed signal arrived (or killed a worker: `SnapshotCallback` counts that as the signal) is part of the
preemption, not a data error (`fetches`):

- training: once a signal arrived no further batch is fetched: at a window's start the fit stops at that
  commit point, inside an open accumulation window its micro-batches are dropped and it stops at the last
  commit point (the `snapshot` edge from `window_open`). Under DDP one rank's fetch may fail where
  another's succeeds, so the ranks agree after every fetch (one more small all-reduce per micro-batch while
  signals are armed) and stop together;
- validation: batches are fetched while they can be (a signal that left the workers alive stops the fit at
  the epoch's end); a fetch the signal made fail stops the fit at the last commit point, the epoch's last
  update (the `snapshot` edge from `task_val`): the resumed run validates that epoch again. Ranks do not
  agree per fetch here (their validation shards may differ in length): each stops at its own failed fetch;
- test, prediction, the LR sweep: no writer listens (signals are armed during `fit` only), so the data is
  iterated as given and a signal has its default effect.
"""

from __future__ import annotations

import torch

from deepepochs import torch_private
from deepepochs.engine import generators, loader_starts
from deepepochs.engine.context import Context
from deepepochs.fsm.events import TriggerName

__all__ = ["FetchStopped", "after_fit", "commit_point", "fetches", "find_writer", "guard", "stop_fetching"]

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


class FetchStopped(Exception):
    """Raised by `fetches` in place of the next batch: a listed signal arrived (on some rank); `signal` names
    it. The batch loop catches it and stops the fit (`stop_fetching`)."""

    def __init__(self, signal: str):
        super().__init__(signal)
        self.signal = signal


def guard(ctx: Context, data, stage: str):
    """(the batches a stage's loop iterates, the generator to close when it ends or None): `data` guarded by
    `fetches` while a snapshot writer listens for signals (during `fit`), else `data` as given."""
    writer = ctx.snapshots
    if writer is None or not writer.signals or not writer.listening:
        return data, None
    guarded = fetches(ctx, data, training=stage == "train")
    return guarded, guarded


def fetches(ctx: Context, data, training: bool = True):
    """Iterate `data` until a listed signal arrives: then raise `FetchStopped` instead of the next batch (see
    the module doc). `training`: stop before fetching once a signal arrived, every rank agreeing after each
    fetch under DDP (all stop at the same micro-batch); else stop only at a fetch the signal made fail."""
    writer, dist = ctx.snapshots, ctx.parts.dist
    agree = training and dist.world_size > 1
    it = loader_starts.start(ctx, data)
    try:
        while True:
            batch, end, failed = None, False, False
            if writer.pending_signal is None or not training:
                if training:
                    generators.keep_host_state(ctx)  # a window's first fetch: what a dropped window rewinds to
                try:
                    batch = next(it)
                except StopIteration:
                    end = True
                except (OSError, EOFError, RuntimeError):  # how a worker's death shows, before SIGCHLD or after
                    if writer.signal_after_error() is None:  # no listed signal: a data error, the fit's to handle
                        raise
                    failed = True
            signal = writer.pending_signal if training or failed else None
            if agree:
                _, signal = _agree(ctx, False, signal)
            if signal is not None:
                raise FetchStopped(signal)
            if end:
                return
            yield batch
    finally:  # closed by the batch loop; stopping: the workers the signal killed are shut down
        if writer.pending_signal is not None:
            torch_private.shutdown_loader_workers(it)


def stop_fetching(ctx: Context, signal: str) -> None:
    """Stop the fit on `signal` before the next batch is fetched: the `snapshot` trigger from the window's
    start (this commit point), from inside an open window (its micro-batches are dropped; the snapshot is
    the last commit point's) or from a validation task (the snapshot is the epoch's last update's). Raises
    `Preempted`."""
    loop = ctx.loop
    loop.snapshot_due, loop.stop_signal = True, signal
    ctx.machine.fire(SNAPSHOT)


def _agree(ctx: Context, due: bool, signal: str | None) -> tuple[bool, str | None]:
    """(due, signal) agreed over the ranks: due on any rank, the first listed signal any rank received."""
    names = ctx.snapshots.signals
    flags = torch.zeros(1 + len(names), device=ctx.parts.device)
    flags[0] = float(due)
    if signal is not None:
        flags[1 + names.index(signal)] = 1.0
    flags = ctx.parts.dist.reduce_sum(flags).tolist()
    if signal is None:
        signal = next((name for name, n in zip(names, flags[1:]) if n > 0), None)
    return flags[0] > 0, signal


def _fire(ctx: Context, due: bool, signal: str | None, only_signal: bool = False) -> None:
    """Fire `snapshot` with its guards' inputs (`snapshot_due`, `stop_signal`), agreed over the ranks first
    when the writer's decision can differ between them (signals, minutes); with `only_signal`, fire only
    when a signal arrived."""
    writer, loop, dist = ctx.snapshots, ctx.loop, ctx.parts.dist
    if dist.world_size > 1 and writer.must_agree:
        due, signal = _agree(ctx, due, signal)
    if only_signal and signal is None:
        return
    loop.snapshot_due = not only_signal and (due or signal is not None)
    loop.stop_signal = signal
    ctx.machine.fire(SNAPSHOT)
