"""The BatchNorm pass at a fit's end: the spec's `fit_statistics` state, its guard and its commit point.

A weight average whose BatchNorm statistics are recomputed at the fit's end (`SWACallback` with
`bn_update=True`: a callback with `statistics_source`, `statistics_due` and `recompute_statistics`) is a
stage of its own. The driver fires `recompute_statistics` from `fit_done` after the last epoch;
`statistics_due` leads into `fit_statistics`, where the pass reads its batches through the same guard as a
training task (`snapshot_trigger.fetches`: once a listed signal arrived no batch is fetched), and
`end_statistics` commits it (`commit_statistics`: a rollback no longer undoes it). A signal during the
pass fires `snapshot` from `fit_statistics`: its edge puts the averages back as the last epoch's end left
them (`discard_window` runs the undo registered here), writes the snapshot of that commit point and stops;
the resumed run, finding the average moved, runs the pass again over the same batches from the same
generator states, so its statistics are the uninterrupted run's bit for bit. Snapshots of the fit's end
hold the statistics before the pass (the pass depends on the averaged weights and the data alone: a
resume from one recomputes them). Without such a callback nothing is fired.
"""

from __future__ import annotations

from deepepochs.engine import runstate, snapshot_trigger
from deepepochs.engine.context import Context
from deepepochs.engine.registry import action, guard
from deepepochs.fsm.events import StateName, TriggerName

__all__ = ["check_sources", "commit_statistics", "recompute", "statistics_due"]


def _passes(ctx: Context) -> list:
    """The attached callbacks that recompute statistics at the fit's end."""
    return [cb for cb in ctx.parts.hooks.callbacks if callable(getattr(cb, "recompute_statistics", None))]


def check_sources(ctx: Context, train_tasks) -> None:
    """At the fit's start: each pass picks its data from the fit's training data (the DataLoaders as given)
    and refuses data it cannot read at the fit's end, before anything trains."""
    for cb in _passes(ctx):
        cb.statistics_source(ctx.parts.facade, [task.dataloader for task in train_tasks])


@guard
def statistics_due(ctx: Context) -> bool:
    """A pass has statistics to recompute (its average moved in this run)."""
    return any(cb.statistics_due(ctx.parts.facade) for cb in _passes(ctx))


@action
def commit_statistics(ctx: Context) -> None:
    """The statistics the pass computed stay: the undo registered when it began is dropped."""
    ctx.epoch_undo.clear()


def recompute(ctx: Context) -> None:
    """After the fit's last epoch: the `fit_statistics` stage when a pass is due (see the module doc)."""
    passes = _passes(ctx)
    if not passes or ctx.machine.fire_cold(TriggerName.RECOMPUTE_STATISTICS) != StateName.FIT_STATISTICS:
        return
    before = runstate.capture(ctx.run)  # the averages as the last epoch's end committed them
    ctx.epoch_undo.append(lambda: runstate.restore(ctx.run, before))
    facade, opened = ctx.parts.facade, []

    def read(batches):
        guarded, closer = snapshot_trigger.guard(ctx, batches, "train")
        if closer is not None:
            opened.append(closer)
        return guarded

    try:
        for cb in passes:
            if cb.statistics_due(facade):
                cb.recompute_statistics(facade, read)
    except snapshot_trigger.FetchStopped as stop:
        snapshot_trigger.stop_fetching(ctx, stop.signal)  # raises Preempted
    finally:
        for closer in opened:
            closer.close()
    ctx.machine.fire_cold(TriggerName.END_STATISTICS)
