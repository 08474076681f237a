"""Resume and replay: how a fit continues from a commit point instead of starting an epoch afresh.

Three ways lead here, all through the run state (`deepepochs.engine.runstate`):

- `Trainer(resume=...)`: the `resume_checkpoint` action hands the facade to the checkpoint layer's
  resume policy (`Parts.resumer`), which loads the file into the run state;
- a refit after a rollback: the run state still holds the last commit point (`resume`, the epoch's
  `train_meters`, `random_state`, `data_state`);
- a mid-epoch snapshot loaded by `load_checkpoint` (`deepepochs.engine.position.restore`).

The driver then asks, per epoch, where the training stage stands (`epoch_point`), per task what it
continues (`task_start`), and opens the task's data from there (`TrainingBatches`: the one place the
position meets the data), so that the batches, the metrics and every random stream continue exactly as
the uninterrupted run's would have.
"""

from __future__ import annotations

import warnings

from torch.utils.data import DataLoader

from deepepochs.data.batch_rules import exact_length
from deepepochs.data.sampling import DataOrder, LoaderOrder, iterate_past, loader_order, skip_batches
from deepepochs.data.streams import StreamSource, generators_of, resume_warning, start_draws, stream_holder
from deepepochs.engine import generators as random_streams
from deepepochs.engine import loader_starts, position
from deepepochs.engine.context import Context, ResumePoint
from deepepochs.errors import DeepEpochsWarning
from deepepochs.patches import TensorPatch
from deepepochs.tasks import EpochTask, TaskMeters, metric_name

__all__ = ["TrainingBatches", "epoch_point", "task_start"]


def epoch_point(ctx: Context, tasks, epoch: int) -> tuple[ResumePoint | None, list | None]:
    """Where epoch `epoch`'s training stage continues: the run state's resume point when it belongs to
    this epoch (checked against `tasks` when a task is in progress: a snapshot's position must lie inside
    this data), with the epoch's committed meters; (None, None) for a fresh epoch."""
    run = ctx.run
    point = run.resume if run.resume is not None and run.resume.epoch == epoch else None
    if point is None:
        return None, None
    if point.task_index >= 0:
        position.check_point(point, tasks, ctx.parts.dist.world_size)
    return point, run.train_meters


def task_start(point: ResumePoint | None, saved: list | None, index: int,
               task: EpochTask) -> tuple[TaskMeters, int | None, int | None]:
    """What training task `index` continues from the stage's resume point (`epoch_point`): its meters
    (committed ones adopted, else fresh), the batches to skip (None: the task completed before the
    interrupt, 0: it starts afresh) and, for a snapshot of another world size, the global samples it
    consumed."""
    if saved is None or index >= len(saved) or not (point.task_index == -1 or index <= point.task_index):
        return TaskMeters(task.all_metrics), 0, None
    meters = _adopt(saved[index], task)
    if point.task_index == -1 or index < point.task_index:
        return meters, None, None
    skip = point.batches_done
    return meters, skip, point.samples if skip else None


class TrainingBatches:
    """A training task's batches from the position it continues at: made when the task begins, it positions
    the data once (a stateful loader's own state, sampler-level skips, a global sample count: `_position`);
    iterated (once), it yields the batches after the committed ones with the random streams replayed
    (`_replay`).

    Args:
        ctx: the run's context (its run state holds the position).
        data: the task's data as given.
        epoch: the epoch the task runs in.
        skip: the batches the task committed before (`task_start`; 0 for a fresh task).
        samples: for a snapshot of another world size, the global samples the task consumed.

    Attributes:
        start: the committed batches in this run's batches: the task's batch count starts there.
        total: the task's batch count when its data has an exact length (`batch_rules.exact_length`), else None.
    """

    def __init__(self, ctx: Context, data, epoch: int, skip: int, samples: int | None):
        self._ctx = ctx
        self.total = exact_length(data)
        self._data, self.start, self._past, self._generators = _position(ctx, data, epoch, skip, samples)

    def __iter__(self):
        return _replay(self._ctx, self._data, self.start, self._past, self._generators)


def _position(ctx: Context, data, epoch: int, skip: int, samples: int | None) -> tuple[object, int, int, list]:
    """A training task's data positioned after its `skip` committed batches: `(data, skip, past, generators)`,
    `skip` in this run's batches, `past` the batches to read and drop when the data cannot skip them itself,
    `generators` the `(generator, state)` pairs to put back once the epoch's iterator is made.

    Stateful data (`streams.stream_holder`: torchdata's StatefulDataLoader, a stateful IterableDataset or
    iterable) whose state was kept at this task's last commit point (or, for a dataset, at the task's start)
    continues from it (`load_state_dict`), reading past any update applied after it; other data skips at the
    sampler (`sampling.skip_batches`), or on another world size by its global sample count, or is iterated
    past its committed batches (with a warning naming what to do when its order may differ). The generators
    the data draws its epoch from go back to the states the run state kept when the epoch's task first began
    (`RunState.order_draws`, `streams.start_draws`), or are kept now for a fresh task. Sets `ctx.data_source`
    (what `remember_position` keeps) and the resume point's count."""
    loop, run = ctx.loop, ctx.run
    given, holder, drawing = data, stream_holder(data), generators_of(data)  # `data` may become () below
    saved, past, generators = run.data_state, 0, []
    if holder is not None and saved is not None and saved[:2] == (epoch, ctx.task_index) and saved[2] <= skip:
        holder.load_state_dict(saved[3])  # continues after the batches committed when it was read
        past = skip - saved[2]  # an update applied after it, whose commit a fault cut short: in order, past it
        if run.data_ended == (epoch, ctx.task_index, skip):
            data = ()  # it had said it has no more batches: its state may be the next pass's already
        kept = run.data_generators
        if kept is not None and kept[:2] == (epoch, ctx.task_index):
            # Making the restored iterator draws from the loader's generators again (torchdata's
            # StatefulDataLoader: its sampler's permutation, the base seed), leaving them where the
            # uninterrupted run's never were; they go back to the commit point's states after it.
            generators = list(zip(drawing, kept[2]))
        if skip and getattr(holder, "num_workers", 0):
            warnings.warn(
                f"resuming inside epoch {epoch} with a stateful DataLoader of {holder.num_workers} worker processes:"
                " its order and batches continue exactly, but it starts its workers' random generators afresh"
                " (torchdata seeds them from the base seed, not where they stood), so random draws inside the"
                " workers (augmentation in the dataset) differ from the uninterrupted run's for the rest of this"
                " epoch; make the dataset keep its generator in its own state (torchdata's Stateful protocol)"
                " or load in the main process (num_workers=0) for an exact resume", DeepEpochsWarning, stacklevel=4)
    elif skip:
        _check_order(ctx, data, epoch)
        data, skip, past = skip_batches(data, skip, samples, ctx.parts.dist.world_size)
        loop.resume.batches_done = skip  # in this run's batches
        message = None if isinstance(getattr(data, "sampler", None), (DataOrder, LoaderOrder)) \
            else resume_warning(data, skip)
        if message is not None:
            warnings.warn(message, DeepEpochsWarning, stacklevel=4)
    elif holder is not None and not isinstance(holder, DataLoader):
        # A dataset's stream at the task's start: a refit of the task before its first commit starts it here
        # again (a loader's epoch starts afresh from its generators, kept below).
        run.data_state = (epoch, ctx.task_index, 0, holder.state_dict())
    # right before the iterator is made (`_replay`): the generators' states of the epoch's start
    run.order_draws = start_draws(given, epoch, ctx.task_index, run.order_draws)
    ctx.data_source = None if holder is None else StreamSource(holder, drawing)
    return data, skip, past, generators


def _check_order(ctx: Context, data, epoch: int) -> None:
    """Warn when a task continuing after committed batches cannot continue their order: the order rule
    changed between the run that committed them and this one (`Trainer(data_order=...)`, or the world size:
    several processes always train in the global order)."""
    kept = ctx.run.order_draws
    kept = kept is not None and (kept.epoch, kept.task_index) == (epoch, ctx.task_index)
    if loader_order(data) is not None and not kept:
        warnings.warn(
            f"resuming inside epoch {epoch}: this run trains on the DataLoader's own order (data_order='loader',"
            " one process), but what the loader drew for this epoch was not kept (the run that committed its"
            " batches trained in the global order: data_order='global', several processes or an older"
            " deepepochs); the rest of the epoch follows a new order, so samples may repeat or be missed."
            " Resume with data_order='global' to continue that order exactly", DeepEpochsWarning, stacklevel=4)
    elif kept and isinstance(getattr(data, "sampler", None), DataOrder):
        warnings.warn(
            f"resuming inside epoch {epoch}: the run that committed its batches trained on the DataLoader's own"
            " order (data_order='loader', one process); this run trains in the global order of (seed, epoch)"
            " (data_order='global', or several processes), so the rest of the epoch follows another order and"
            " samples may repeat or be missed. Resume in one process with the default data_order to continue"
            " exactly", DeepEpochsWarning, stacklevel=4)


def _replay(ctx: Context, data, skip: int, past: int, generators: list):
    """The training task's batch iterator, made so that random streams replay exactly.

    A refit resuming the task mid-way (`run.random_replay` holds the task's states) makes the iterator
    from the generator states the task first had (DataLoader worker seeds) and reads the batches it
    iterates past from them (augmentation in the main process draws too); the batches then continue from
    the last commit point's states. A fresh task keeps its states first (`run.task_random_state`)."""
    run = ctx.run
    replay, run.random_replay = run.random_replay, None
    if skip and replay is not None and replay[0] is not None:
        run.task_random_state = replay[0]
        random_streams.set_random_state(ctx, replay[0])
        batches = _put_back(_watched(ctx, data), generators)
        batches = iterate_past(batches, past)
        random_streams.set_random_state(ctx, replay[1])
        return batches
    run.task_random_state = random_streams.random_state(ctx)
    return iterate_past(_put_back(_watched(ctx, data), generators), past)


def _watched(ctx: Context, data):
    """The iterator of `data`, made now; a stateful source's notes where it ends (`StreamSource.watch`)."""
    batches = loader_starts.start(ctx, data)
    return batches if ctx.data_source is None else ctx.data_source.watch(batches)


def _put_back(batches, generators: list):
    """`batches` (an iterator just made) after putting each `(generator, state)` of `generators` back."""
    for generator, state in generators:
        generator.set_state(state)
    return batches


def _adopt(meters: TaskMeters, task: EpochTask) -> TaskMeters:
    """A resumed task's committed meters under this fit's metrics: patches of metrics no longer asked for
    are dropped (a metric that failed can be removed), and a kept `TensorPatch` computes with the metric
    of the same name given now (a failed metric can be replaced; its inputs are all kept)."""
    now = {metric_name(m): m for m in task.all_metrics}
    for name in set(meters.metrics) - set(now):
        meters.patches.pop(name, None)
    for name, patch in meters.patches.items():
        # A snapshot stores no functions: a patch read from one gets its metric here (its `metric` is None).
        if name in now and (isinstance(patch, TensorPatch) or getattr(patch, "metric", False) is None):
            patch.metric = now[name]
    meters.metrics = now
    meters.final = None
    return meters
