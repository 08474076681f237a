"""The update clock's guards and actions (`Trainer(max_updates=N)`, `fit(val_every_n_updates=M)`), registered
in the spec's registry (`deepepochs.engine.registry`) like every other; what they decide is drawn in the spec
(`spec/loop.py`: `validate` from `task_train`, `task_spent`, the validation point's `end_stage` edges,
`next_epoch`'s budget edge) and driven by `deepepochs.engine.update_clock`.
"""

from __future__ import annotations

from deepepochs.engine import callback_states
from deepepochs.engine.context import Context
from deepepochs.engine.generators import remember_random_state
from deepepochs.engine.registry import action, guard
from deepepochs.engine.runstate import VAL_POINT_KEY, record_val_point
from deepepochs.protocols import monitors_undo

__all__ = ["commit_val_point", "open_val_point", "task_stops", "update_budget_reached", "val_point_due",
           "val_point_open"]


def _budget_spent(ctx: Context) -> bool:
    target = ctx.loop.target_updates
    return target is not None and ctx.loop.run.updates >= target


@guard
def update_budget_reached(ctx: Context) -> bool:
    """The budget is spent and no epoch interrupted after its last update waits for its end (a refit finishes
    that epoch: its last validation point, its end's hooks and records)."""
    return _budget_spent(ctx) and ctx.loop.resume is None


@guard
def task_stops(ctx: Context) -> bool:
    return _budget_spent(ctx) or ctx.loop.stop is not None


@guard
def val_point_due(ctx: Context) -> bool:
    """Every `val_every`-th committed update, the one reaching the budget (unless `val_at_end` is False) and,
    with `val_at_start`, update 0 (before the first update), unless the run's records already hold a
    validation at this count (a refit, or a resume, after the point was validated)."""
    loop = ctx.loop
    every, updates = loop.val_every, loop.run.updates
    if every is None:
        return False
    if updates == 0:
        if not loop.val_at_start:
            return False
    elif updates % every and not (loop.val_at_end and _budget_spent(ctx)):
        return False
    done = ctx.history["val"].get(VAL_POINT_KEY)
    return not done or done[-1] != updates


@guard
def val_point_open(ctx: Context) -> bool:
    return ctx.loop.val_point_open


@action
def open_val_point(ctx: Context) -> None:
    """The validation stage runs as an update point's. The monitors' checks at it (`CheckCallback`: best
    value, patience) count only once it commits: a rollback before `commit_val_point` puts them back, and the
    callbacks' states as the point began."""
    ctx.loop.val_point_open = True
    ctx.epoch_undo.append(monitors_undo(ctx.parts.hooks.callbacks))
    callback_states.keep(ctx)  # as the update's hooks left them: a rollback of the point puts them back


@action
def commit_val_point(ctx: Context) -> None:
    """The validation point is done for good: its row, `{'updates': count, metric: value, ...}`, joins the
    validation records (its metrics leave the epoch's, so the epoch's end does not record them again), and
    torch's generators are kept as the validation left them (its loaders drew from them): a refit after a
    fault in the next window continues from here."""
    remember_random_state(ctx)
    ctx.epoch_undo.clear()  # the point's scheduler step is committed with it
    ctx.loop.val_point_open = False
    record_val_point(ctx.history["val"], ctx.loop.run.updates, ctx.last_metrics.pop("val", {}))
