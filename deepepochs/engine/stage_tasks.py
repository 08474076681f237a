"""Building a stage's tasks: the `EpochTask`s a fit, test or predict runs, from the data and tasks it was
given, each with its metrics, its prepared (sharded) data and its step method.

Step methods are user code on the facade or on a task; which one runs is decided here (`resolve_step`)
from the classes, so the engine needs nothing of the facade but the object itself (`Parts.facade`).
"""

from __future__ import annotations

import collections.abc

from deepepochs.data.batch_rules import check_batch_size
from deepepochs.engine.context import Context
from deepepochs.errors import ConfigError
from deepepochs.tasks import STEP_NAMES, EpochTask, ahead_of, check_metric_names

__all__ = ["data_length", "default_step", "make_tasks", "no_batch_error", "resolve_step"]


def default_step(method):
    """Mark a facade's step method as the library's default: `resolve_step` passes over it, so the engine
    runs its own default step (`steps.default_step`, which the compiled micro-batch inlines) instead."""
    method.deepepochs_default_step = True
    return method


def resolve_step(facade, task, stage: str):
    """The step method of `task` in `stage`: `step`, then the stage's method, then `evaluate_step`
    (`tasks.STEP_NAMES`); per name the task's before the facade's. None when the facade's is the library's
    default (`default_step`) and the task has none: the engine's default step runs."""
    for name in STEP_NAMES[stage]:
        if getattr(type(task), name, None) is not None:
            return getattr(task, name)
        method = getattr(type(facade), name, None)
        if method is not None and not getattr(method, "deepepochs_default_step", False):
            return getattr(facade, name)
    return None


def make_tasks(ctx: Context, stage: str, dataloader, tasks, metrics, do_loss, batch_size,
               call: str | None = None) -> list[EpochTask]:
    """EpochTasks of a stage from a DataLoader and/or a task list (they combine, DataLoader first).
    `call`: the public call the data was given to, when it is not the stage's own (`predict`).

    Fails with a `ConfigError` before anything runs on what cannot work: an item that is not an
    `EpochTask`, empty data, metric names that clash."""
    parts = ctx.parts
    check_batch_size(batch_size)
    out = []
    if dataloader is not None:
        out.append(EpochTask(dataloader, do_loss=do_loss, batch_size=batch_size))
    if tasks:
        for task in tasks if isinstance(tasks, (list, tuple)) else [tasks]:
            if not isinstance(task, EpochTask):
                raise ConfigError(f"{stage}_tasks must hold EpochTask objects (got {type(task).__name__})")
            out.append(task)
    for i, task in enumerate(out):
        if data_length(task.dataloader) == 0:
            what = f"the {stage} data of task {i}" if call is None else f"the data given to {call}()"
            raise ConfigError(
                f"{what} is empty (len 0): check the dataset size, batch_size and"
                " drop_last; a DataLoader must yield at least one batch"
            )
        task.trainer = parts.facade
        task.stage = stage
        # 0.6.18's order: the task's own metrics, then the stage's
        task.all_metrics = check_metric_names(ahead_of(task.own_metrics, metrics), f"the {stage} task {i}")
        if task.batch_size is None:
            task.batch_size = batch_size
        task.data = parts.dist.prepare_dataloader(task.dataloader, stage)
        task.step_fn = resolve_step(parts.facade, task, stage)
        task.targets_checked = False  # batch_patches checks once that metrics can do without targets
    return out


def no_batch_error(data, index: int, epoch: int) -> ConfigError:
    """The error for training data (task `index`) that yielded no batch in `epoch`: a one-shot iterator (a
    generator) used up by an earlier epoch or fit, or data that is empty although it has no length to tell
    so in advance (a DataLoader over an `IterableDataset` yielding nothing)."""
    if isinstance(data, collections.abc.Iterator):
        return ConfigError(
            f"the train data of task {index} yielded no batch in epoch {epoch}: a one-shot iterator (e.g. a"
            f" generator, got {type(data).__name__}) is used up after one epoch; pass a DataLoader or another"
            " re-iterable (a list, or an object whose __iter__ starts over)")
    return ConfigError(
        f"the train data of task {index} is empty: it yielded no batch in epoch {epoch} (got a"
        f" {type(data).__name__} without a length); check its dataset (an IterableDataset whose __iter__ yields"
        " nothing, a shard of this rank left empty) and drop_last; training data must yield at least one batch")


def data_length(data) -> int | None:
    """`len(data)`, or None for data without a length (an IterableDataset, a generator)."""
    try:
        return len(data)
    except TypeError:
        return None
