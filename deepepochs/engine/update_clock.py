"""The update clock: training counted in committed updates (`Trainer(max_updates=N)`) and validation every
M updates (`fit(val_every_n_updates=M)`), inside an epoch or across epoch ends.

What happens is the spec's (`spec/loop.py`): in `task_train` the cold trigger `validate` takes the
`val_point_due` edge into the validation stage, whose `end_stage` returns to the training task
(`val_point_open`: `commit_val_point` records the point's row), or the `task_stops` edge to `task_spent`
(the budget is reached, or a stop was requested): the task reads no further batch, and `next_epoch` ends the
fit on `update_budget_reached`. This module only fires those triggers where the batch loop hands it a
commit point (`clock_point`), and runs the validation stage between them with the training task's scratch
kept aside, so that training continues exactly where it was.

The clock is on only when a fit asks for it (`make_clock`); otherwise no batch calls anything here.
"""

from __future__ import annotations

import functools
import itertools
import types

from torch.utils.data import DataLoader

from deepepochs.data.sampling import ShortestShard
from deepepochs.engine.context import Context
from deepepochs.engine.stage_tasks import data_length
from deepepochs.errors import ConfigError
from deepepochs.fsm.events import StateName, TriggerName

__all__ = ["check_clock", "clock_point", "counts_updates", "endless", "make_clock", "progress"]

#: Iterables that are endless by construction (`itertools.repeat` only without `times`: then it has no
#: length hint).
_ENDLESS_TYPES = (itertools.count, itertools.cycle)


def _endless_iterator(obj) -> bool:
    if isinstance(obj, _ENDLESS_TYPES):
        return True
    if isinstance(obj, itertools.repeat):
        try:
            return obj.__length_hint__() is None
        except TypeError:  # repeat(x) without times refuses a length hint
            return True
    return False


def endless(data) -> str | None:
    """What makes `data` known to be endless, or None: `itertools.count`, `itertools.cycle` or
    `itertools.repeat` without `times` given as the data, or as a DataLoader's `sampler=` or
    `batch_sampler=` (its indices then never end). Other data without a length (an `IterableDataset`, a
    generator, a sampler of your own) may end on its own, which nothing can tell before iterating it: its
    epoch ends when it is exhausted, and one that never ends needs `max_updates`."""
    data = data.data if isinstance(data, ShortestShard) else data
    if _endless_iterator(data):
        return type(data).__name__
    if isinstance(data, DataLoader):
        batch_sampler = getattr(data, "batch_sampler", None)
        for name, source in (("sampler", getattr(data, "sampler", None)), ("batch_sampler", batch_sampler),
                             ("sampler", getattr(batch_sampler, "sampler", None))):
            if _endless_iterator(source):
                return f"a DataLoader whose {name} is {type(source).__name__}"
    return None


def check_clock(train_tasks, val_tasks, max_updates: int | None, val_every: int | None, val_at_start: bool = False,
                val_at_end: bool = True) -> None:
    """Refuse what the update clock cannot run: `val_every_n_updates` that is not a positive int or comes
    without validation data, `val_at_start`/`val_at_end` that are not bools or come without it, and endless
    training data with no update budget."""
    for name, value, default in (("val_at_start", val_at_start, False), ("val_at_end", val_at_end, True)):
        if not isinstance(value, bool):
            raise ConfigError(f"fit {name} must be True or False (got {value!r})")
        if value is not default and val_every is None:
            raise ConfigError(f"fit {name}={value} places the validation points of the update clock, but"
                              " val_every_n_updates is None (validation runs at epochs' ends); pass"
                              f" val_every_n_updates=M, or leave {name}={default}")
    if val_every is not None:
        if isinstance(val_every, bool) or not isinstance(val_every, int) or val_every < 1:
            raise ConfigError(f"fit val_every_n_updates must be None or a positive int, the number of updates"
                              f" between validation points (got {val_every!r})")
        if not val_tasks:
            raise ConfigError(f"fit val_every_n_updates={val_every} validates every {val_every} updates, but"
                              " fit() got no validation data; pass val_dl (or val_tasks), or leave"
                              " val_every_n_updates=None")
    if max_updates is None:
        for index, task in enumerate(train_tasks):
            why = endless(task.data)
            if why is not None:
                raise ConfigError(
                    f"the train data of task {index} is an endless stream ({why}), and nothing ends the fit:"
                    " pass Trainer(max_updates=N), a positive int, to train N updates (got max_updates=None)")


def counts_updates(config, loop) -> bool:
    """Whether the run is told in updates, the clock its user chose: an update budget
    (`Trainer(max_updates=N)`) or the last fit's validation every M updates. Its messages (the tested file,
    a resume, the test line) then name updates, which an epoch count (often 0 then) would not."""
    return config.max_updates is not None or loop.target_updates is not None or loop.val_every is not None


def make_clock(driver, val_tasks, max_updates: int | None, val_every: int | None, val_at_start: bool = False,
               val_at_end: bool = True):
    """Set the fit's clock on the loop and `Context.update_clock` to what a training task calls (None when
    neither `max_updates` nor `val_every` is given: the clock is off)."""
    ctx = driver.ctx
    loop = ctx.loop
    loop.target_updates, loop.val_every, loop.val_point_open = max_updates, val_every, False
    loop.val_at_start, loop.val_at_end = val_at_start, val_at_end
    on = max_updates is not None or val_every is not None
    ctx.update_clock = functools.partial(clock_point, driver, val_tasks) if on else None


def clock_point(driver, val_tasks) -> bool:
    """At a training task's start or after a committed window: fire `validate` in `task_train`; a due
    validation point runs the validation stage and returns with `end_stage`. True when the task stops here
    (`task_spent`)."""
    ctx: Context = driver.ctx
    machine = ctx.machine
    state = machine.fire(TriggerName.VALIDATE)  # once per update: the compiled table, not `transitions`
    if state == StateName.STAGE_VAL:
        kept = _TrainingScratch(ctx)
        try:
            metrics = driver.eval_stage("val", val_tasks, ctx.loop.epoch)
        finally:
            kept.restore(ctx)
        loop = ctx.loop
        ctx.parts.console.update_point(loop.run.updates, loop.target_updates, metrics)
        state = machine.fire_cold(TriggerName.END_STAGE)
        kept.reopen(ctx)
    return state == StateName.TASK_SPENT


def progress(ctx: Context) -> tuple[int, int | None] | None:
    """What a training task's progress bar counts with the clock on: (committed updates, `max_updates` or
    None); None with the clock off (the bar counts the task's batches)."""
    loop = ctx.loop
    return None if ctx.update_clock is None else (loop.run.updates, loop.target_updates)


class _TrainingScratch(types.SimpleNamespace):
    """The running training task's scratch that a validation stage overwrites (its task, meters, batch
    index, stage, stateful loader), put back when the stage returns."""

    def __init__(self, ctx: Context):
        loop = ctx.loop
        super().__init__(task=ctx.task, task_index=ctx.task_index, meters=loop.meters, batch_idx=loop.batch_idx,
                         stage=loop.stage, data_source=ctx.data_source, first_batch=ctx.first_batch)

    def restore(self, ctx: Context) -> None:
        loop = ctx.loop
        ctx.task, ctx.task_index, ctx.data_source, ctx.first_batch = (self.task, self.task_index, self.data_source,
                                                                      self.first_batch)
        loop.meters, loop.batch_idx, loop.stage = self.meters, self.batch_idx, self.stage

    def reopen(self, ctx: Context) -> None:
        """The training task's progress line (or bar) again."""
        loop = ctx.loop
        ctx.parts.console.start_task("train", loop.epoch, loop.target_epochs, data_length(self.task.data),
                                     progress(ctx))
