"""The driver: fit, test and predict through epochs, stages and tasks, firing the machine's cold triggers,
and rollback to the last commit point when anything escapes.

Rollback has one rule: the trainer returns to the last commit point (see `deepepochs.engine.actions`).
Inside an epoch that is the last committed update, kept in the run state (`deepepochs.engine.runstate`:
`resume` with the epoch's training meters); the next `fit` continues from there
(`deepepochs.engine.continuation`). Work after it (an open window, an epoch's end that did not commit) is undone
by the `interrupt` edge's `discard_window` action, an epoch's end by restoring the run state captured
before it.

Elsewhere: which tasks a stage runs (`stage_tasks`), resume and replay (`resume`), a fit that leaves no
trace (`trial`), the micro-batch loops (`batches`).
"""

from __future__ import annotations

import copy
import datetime
import functools
import math
import threading

import torch

from deepepochs.data import workers
from deepepochs.data.batch_rules import input_splitter
from deepepochs.data.outputs import concat_batches, detached, label_split, merge_shards
from deepepochs.engine import (
    actions,
    batches,
    buffers,
    callback_states,
    carried,
    continuation,
    generators,
    kept_grads,
    rank_place,
    runstate,
    snapshot_trigger,
    stage_tasks,
    statistics_pass,
    steps,
    update_clock,
)
from deepepochs.engine.context import Context, ResumePoint
from deepepochs.engine.emit import emit
from deepepochs.engine.signals import InterruptGuard
from deepepochs.engine.stage_tasks import data_length, no_batch_error
from deepepochs.fsm.events import ActionName, Event, StateName, TriggerName
from deepepochs.fsm.machine import LoopMachine
from deepepochs.metrics import DEFAULT_AVERAGE_NOTES, take_default_averages
from deepepochs.protocols import monitors_undo
from deepepochs.tasks import TASK_SUFFIX_NOTE, EpochTask, TaskMeters, merge_stage_metrics, merge_values

__all__ = ["Driver"]

#: Per stage, the hooks the driver fires around stages and tasks.
STAGE_HOOKS = {
    "train": (Event.BEFORE_TRAIN_EPOCHS, Event.AFTER_TRAIN_EPOCHS, Event.BEFORE_TRAIN_EPOCH, Event.AFTER_TRAIN_EPOCH),
    "val": (Event.BEFORE_VAL_EPOCHS, Event.AFTER_VAL_EPOCHS, Event.BEFORE_VAL_EPOCH, Event.AFTER_VAL_EPOCH),
    "test": (Event.BEFORE_TEST_EPOCHS, Event.AFTER_TEST_EPOCHS, Event.BEFORE_TEST_EPOCH, Event.AFTER_TEST_EPOCH),
}


def _failing_window(loop) -> tuple[str, int] | None:
    """At a fault, before the rollback empties it: what became of the failing batch's training window, as
    `(what, micro-batches)`: 'committed' (it closed before the error), 'applied' (its update ran: the
    rollback commits it, `discard_window`) or 'open' (no update yet: dropped); None outside one."""
    if loop.stage != "train":
        return None
    if loop.window_pos:
        return ("applied" if loop.window_updated else "open"), loop.window_pos
    return ("committed", 0) if loop.window_committed else None


def _kept_text(window: tuple[str, int] | None, updates: int) -> str:
    """What the crash note says the rollback kept of the failing batch: its update, or not."""
    committed = f"{updates} update(s) of the run committed"
    if window is None:
        return f"no update was in progress: {committed}, every one kept"
    what, batches = window
    if what == "committed":
        return f"the failing batch's update was kept (committed before the error): {committed}"
    if what == "applied":
        return f"the failing batch's update was kept (applied before the error): {committed}"
    return (f"the failing batch's update was not made: its window's {batches} batch(es) are dropped and a"
            f" refit trains them again; {committed}, every one kept")


class Driver:
    """Runs `fit` and `test` for one trainer's `Context`, and builds its machine."""

    def __init__(self, ctx: Context):
        """Bind the registry's guards and actions to `ctx` and build its machine (the spec's registry is
        checked once per process first: a missing implementation fails here, not mid-fit)."""
        actions.check_registry_once()
        self.ctx = ctx
        ctx.signals = InterruptGuard()
        guards, acts = actions.bind(ctx)
        ctx.machine = LoopMachine(guards, acts, ctx.loop)
        ctx.model = ctx.parts.train_model
        self._started = False
        self.header_done = False
        self.running: str | None = None  # 'fit' or 'test' while one runs (the facade refuses re-entry)
        self.running_thread: threading.Thread | None = None  # the thread it runs in
        ctx.parts.dist.publish_places(rank_place.reader(ctx, self))  # under DDP: a heartbeat; else nothing

    # ---- setup ----
    def make_tasks(self, stage, dataloader, tasks, metrics, do_loss, batch_size, call=None) -> list[EpochTask]:
        """The stage's EpochTasks, built for this trainer (`stage_tasks.make_tasks`): what `fit`, `test`,
        `predict` and `find_lr` hand to the runs below."""
        return stage_tasks.make_tasks(self.ctx, stage, dataloader, tasks, metrics, do_loss, batch_size, call)

    # ---- errors: interrupt -> rollback -> idle, with the flight record ----
    def honour_resume(self) -> None:
        """Load a pending `resume=...` now (the `resume_checkpoint` action a fit's or test's first edge runs),
        judged against the target the next fit() takes (Trainer(epochs=)), as that fit's own resume would be:
        whether a finished run trains on, and what the resume says about it. A no-op without one."""
        ctx = self.ctx
        if ctx.loop.resume_pending:
            ctx.loop.target_epochs = ctx.parts.config.epoch_target
            actions.ACTIONS[ActionName.RESUME_CHECKPOINT](ctx)

    def guarded(self, name: str, run):
        """Run `fit`/`test` (`name`) with SIGINT held during updates; on any exception roll back and
        re-raise it with the flight record attached."""
        ctx = self.ctx
        ctx.signals.install()
        self.running, self.running_thread = name, threading.current_thread()
        try:
            with workers.stage():  # the workers of iterators left running are shut down before any rollback
                return run()
        except BaseException as exc:
            task = ctx.task  # the rollback forgets it
            place = rank_place.failure_place(ctx, exc)  # before the rollback moves the loop
            window = _failing_window(ctx.loop)  # before the rollback empties it
            self._rollback(exc)
            loop, machine = ctx.loop, ctx.machine
            note = (f"deepepochs: {type(exc).__name__} raised in state {loop.last_error_state!r} (epoch"
                    f" {loop.epoch}, batch {loop.batch_idx}, stage {self._failed_stage!r});"
                    f" {_kept_text(window, loop.run.updates)}; {machine.flight_record()}")
            timeout = ctx.parts.dist.timed_out(exc, f"state {loop.last_error_state!r} (epoch {loop.epoch},"
                                                    f" batch {loop.batch_idx})", place)
            failure = exc if timeout is None else timeout
            if hasattr(failure, "add_note"):
                failure.add_note(note)
                hint = _step_hint(exc, task)
                if hint:
                    failure.add_note(hint)
            failure.deepepochs_flight_record = machine.records()
            if timeout is not None:
                raise timeout from exc
            raise
        finally:
            self.running = self.running_thread = None
            ctx.signals.uninstall()

    def _rollback(self, exc):
        """Return to the last commit point after `exc` escaped: the `interrupt` edge (its `discard_window`
        drops the open window and undoes an epoch end that did not commit), the `on_rollback` hooks, then
        `recover` to idle. If the rollback itself fails, the machine and the loop are reset to idle so the
        trainer stays usable. Records where the fault was, and makes a refit replay the random numbers."""
        ctx = self.ctx
        parts, loop, machine = ctx.parts, ctx.loop, ctx.machine
        state = machine.state
        loop.last_error_state = state  # for the rollback hooks; set again once the run state is restored
        self._failed_stage = loop.stage
        ctx.pending_nonfinite = None
        try:
            if machine.spec.state(state).running:
                machine.fire_cold(TriggerName.INTERRUPT)
            try:
                emit(ctx, Event.ROLLBACK, exc, state)
            finally:
                if machine.state != StateName.IDLE:
                    machine.fire_cold(TriggerName.RECOVER)
        except BaseException:  # never leave a half-rolled-back trainer behind
            machine.reset()
            actions.ACTIONS[ActionName.RESET_LOOP](ctx)
            parts.opts.zero_grad(parts.opts.all_indices)
            raise
        finally:
            parts.raw_model.train()
            # After the run state is back at the last commit point (`discard_window` restores it when an
            # epoch's end did not commit): where the fault was, and that the refit continues from that
            # commit point's random numbers (`random_state` as the rollback leaves it).
            loop.last_error_state = state
            if self.running == "fit":
                ctx.random_restore_due = True
        emit(ctx, Event.INTERRUPTED, exc)

    # ---- fit ----
    def run_fit(self, train, val, val_freq, epochs, max_updates=None, val_every=None, val_at_start=False,
                val_at_end=True):
        """Train toward the epoch target `epochs` (a total, not a count for this call; None: unbounded) and the
        update budget `max_updates` (a total of committed updates, or None), validating every `val_every`
        updates (`deepepochs.engine.update_clock`; `val_at_start`, `val_at_end`: also before the first
        update, at the budget) or, without it, every `val_freq` epochs."""
        ctx = self.ctx
        parts, loop = ctx.parts, ctx.loop
        fire = ctx.machine.fire_cold
        loop.target_epochs = epochs
        update_clock.make_clock(self, val, max_updates, val_every, val_at_start, val_at_end)
        ctx.monitor_check = (train, val)
        ctx.snapshots = snapshot_trigger.find_writer(parts.hooks.callbacks)
        run = ctx.run
        if run.random_restore_due:  # a refit after a fault: torch draws what the uninterrupted run drew
            run.random_restore_due = False
            run.random_replay = (run.task_random_state, run.random_state)
            generators.set_random_state(ctx, run.random_state)
        else:  # a new fit: its DataLoaders' first iterators are made in it (a resume puts a snapshot's back)
            run.loader_starts = None
        generators.remember_random_state(ctx)  # the fit's start is where a fault before any commit returns
        ctx.machine.agreed()  # the ranks' paths start together: their training data was agreed (make_tasks)
        statistics_pass.check_sources(ctx, train)  # a BatchNorm pass refuses data it cannot read, before training
        loop.resume_tasks = train  # a pending resume=... checks a snapshot's position against them
        try:
            fire(TriggerName.FIT)
        finally:
            loop.resume_tasks = None
        buffers.keep(ctx, fresh=True)  # after a resume loaded them: where a fault before any commit returns
        carried.keep(ctx, fresh=True)
        callback_states.keep(ctx, fresh=True)
        self._header()
        emit(self.ctx, Event.BEFORE_FIT, epochs)
        if not self._started:
            self._started = True
            parts.dist.broadcast_model(parts.raw_model)  # after init callbacks: every rank starts equal
        parts.opts.drop_stale_grads()  # what user code left between fits; then what the run kept, if anything
        if run.grads is not None:
            kept_grads.put_back(ctx)
        while fire(TriggerName.NEXT_EPOCH) == StateName.EPOCH_RUNNING:
            epoch = loop.epoch
            epoch_idx = epoch - 1  # hooks get 0-based epoch indices, as in 0.6; the loop counts from 1
            emit(self.ctx, Event.BEFORE_EPOCH, train, val, epoch_idx)
            fire(TriggerName.BEGIN_TRAIN)
            train_metrics = self._train_stage(train, epoch)
            callback_states.keep(ctx)  # as the last update's hooks left them, before validation and the end
            fire(TriggerName.END_STAGE)
            loop.val_due = bool(val) and epoch % val_freq == 0 and loop.val_every is None
            val_metrics = {}
            if ctx.machine.fire(TriggerName.VALIDATE) == StateName.STAGE_VAL:
                val_metrics = self.eval_stage("val", val, epoch)
                fire(TriggerName.END_STAGE)
            self._count_epoch(epoch)
            emit(self.ctx, Event.AFTER_EPOCH, train, val, train_metrics, val_metrics, epoch_idx)
            skipped = sum(meters.skipped for meters in ctx.train_meters or ())
            parts.console.epoch(epoch, loop.target_epochs, {"train": train_metrics, "val": val_metrics}, skipped,
                                update_clock.progress(ctx))
            fire(TriggerName.END_EPOCH)
            if ctx.snapshots is not None:
                snapshot_trigger.commit_point(ctx, epoch_end=True)
        loop.stage = None
        rank_place.agree(ctx, "the end of the fit")  # a rank that stopped alone waits here for its peers
        statistics_pass.recompute(ctx)  # the averages' BatchNorm statistics, a stage with its commit point
        emit(self.ctx, Event.AFTER_FIT)
        if ctx.snapshots is not None:
            snapshot_trigger.after_fit(ctx)
        fire(TriggerName.FINISH)
        buffers.forget(ctx)
        carried.forget(ctx)
        callback_states.forget(ctx)
        return copy.deepcopy(ctx.history)  # the whole run's records, resumed epochs included

    def _count_epoch(self, epoch):
        """The epoch counts as completed for its end's hooks and saves; until `commit_epoch` a rollback
        undoes that: the run state comes back as it was before the epoch's end (`runstate.capture`: the
        count, an early stop, anything a hook changed in it), and so does the monitors' state."""
        ctx = self.ctx
        monitors = monitors_undo(ctx.parts.hooks.callbacks)
        before = runstate.capture(ctx.run)

        def undo():
            """Put back the run state and the monitors as they were before this epoch's end."""
            runstate.restore(ctx.run, before)
            monitors()

        ctx.epoch_undo.append(undo)
        ctx.loop.completed_epochs = epoch

    def _train_stage(self, tasks, epoch):
        """The training stage of epoch `epoch`: each task in turn, a resumed epoch continuing at its commit
        point (`continuation.epoch_point`, `continuation.task_start`: completed tasks are not run again). The resume
        point moves with the running task and ends at (epoch, -1, 0): the stage is done."""
        ctx = self.ctx
        parts, loop = ctx.parts, ctx.loop
        point, saved = continuation.epoch_point(ctx, tasks, epoch)
        loop.stage = "train"
        ctx.model = parts.train_model
        parts.raw_model.train()
        emit(self.ctx, Event.BEFORE_TRAIN_EPOCHS, tasks, epoch - 1)
        meters_list = ctx.train_meters = []
        trained = point.trained if point is not None else None  # all tasks completed before a refit
        for index, task in enumerate(tasks):
            meters, skip, samples = continuation.task_start(point, saved, index, task)
            meters_list.append(meters)
            if skip is None:  # this task completed before the interrupt
                continue
            loop.resume = ResumePoint(epoch, index, skip)
            ctx.task_index = index
            self._run_task(task, "train", epoch, meters, skip, samples)
            trained = (index, loop.resume.batches_done, getattr(task.data, "batch_size", None))
        loop.resume = ResumePoint(epoch, -1, 0, trained=trained)
        metrics = self._stage_metrics(meters_list, tasks)
        ctx.last_metrics["train"] = metrics
        emit(self.ctx, Event.AFTER_TRAIN_EPOCHS, tasks, metrics, epoch - 1)
        return metrics

    def eval_stage(self, stage, tasks, epoch):
        """A validation or test stage: each task on the evaluation model (no DDP wrapper: no collective per
        batch) without gradients, with the stage's hooks (0.6's arguments: `val` hooks get the 0-based
        epoch, `test` hooks none). Returns the stage's metrics (global under DDP)."""
        ctx = self.ctx
        parts, loop = ctx.parts, ctx.loop
        before_stage, after_stage = STAGE_HOOKS[stage][:2]
        loop.stage = stage
        ctx.model = parts.eval_model
        parts.raw_model.eval()
        emit(self.ctx, before_stage, tasks, epoch - 1) if stage == "val" else emit(self.ctx, before_stage, tasks)
        meters_list = []
        try:
            with torch.no_grad():
                for index, task in enumerate(tasks):
                    meters = TaskMeters(task.all_metrics)
                    meters_list.append(meters)
                    ctx.task_index = index
                    self._run_task(task, stage, epoch, meters, 0)
        finally:
            ctx.model = parts.train_model
            parts.raw_model.train()
        metrics = self._stage_metrics(meters_list, tasks)
        ctx.last_metrics[stage] = metrics
        if stage == "val":
            emit(self.ctx, after_stage, tasks, metrics, epoch - 1)
        else:
            emit(self.ctx, after_stage, tasks, metrics)
        return metrics

    def run_test(self, tasks):
        """`test`: the `test` edge (a pending `resume=...` loads on it), the run header, the test stage and
        `end_stage`; prints and returns the metrics."""
        ctx = self.ctx
        ctx.machine.agreed()  # the ranks' paths start together here: fit and test start on every rank
        ctx.machine.fire_cold(TriggerName.TEST)
        self._header()
        metrics = self.eval_stage("test", tasks, 1)
        ctx.loop.stage = None
        ctx.machine.fire_cold(TriggerName.END_STAGE)
        clock = update_clock.counts_updates(ctx.parts.config, ctx.loop)
        ctx.parts.console.test(metrics, ctx.loop.run.updates if clock else None)
        return metrics

    # ---- predict ----
    def run_predict(self, task: EpochTask, device: torch.device | None):
        """The model's outputs over `task`'s data, in order; under DDP gathered on rank 0 (None elsewhere).

        Prediction walks the test stage's edges (`test`, `begin_task`, per batch `begin_batch`/`end_batch`,
        `end_task`, `end_stage`) through the evaluation loop with `steps.predict_step`; it runs no hooks,
        computes no loss or metrics and prints nothing. A pending `resume=...` loads first, as for test.
        """
        ctx = self.ctx
        parts, loop, machine = ctx.parts, ctx.loop, ctx.machine
        dist = parts.dist
        sharded = dist.world_size > 1 and task.data is not task.dataloader
        outputs = []
        # Gathering pickles the outputs: keep them on the CPU until rank 0 has them all.
        task.step_fn = functools.partial(steps.predict_step, ctx, outputs,
                                         torch.device("cpu") if sharded else device)
        task.step_args = {}
        split = input_splitter(label_split(ctx.loss_fn), parts.device, parts.device.type == "cuda",
                               task.batch_size or _uncounted, parts.target_key)
        machine.fire_cold(TriggerName.TEST)
        loop.stage = "predict"
        ctx.task, ctx.task_index = task, 0
        loop.meters = meters = TaskMeters(())
        machine.fire_cold(TriggerName.BEGIN_TASK)
        loop.batch_idx = 0
        ctx.model = parts.eval_model
        parts.raw_model.eval()
        try:
            with torch.no_grad():
                batches.eval_batches(ctx, task.data, meters, "test", observed=False, split=split)
        finally:
            ctx.model = parts.train_model
            parts.raw_model.train()
        machine.fire_cold(TriggerName.END_TASK)
        ctx.task = None
        loop.stage = None
        machine.fire_cold(TriggerName.END_STAGE)
        result = concat_batches(outputs)
        if sharded:  # every rank ran its strided shard (EvalShardSampler); rank 0 puts them back in order
            shards = dist.all_gather_object(result)
            if not dist.is_main:
                return None
            result = merge_shards(shards, dist.world_size)
            if result is not None and device is not None:
                result = detached(result, device)
        elif not dist.is_main:
            return None
        return result

    # ---- one task ----
    def _run_task(self, task, stage, epoch, meters, skip, samples=None):
        """Run one task of `stage` into `meters` between the `begin_task` and `end_task` edges, with its
        hooks and console lines; a training task first skips its `skip` committed batches (`samples`: as
        a global count, from a snapshot of another world size) and replays its random streams
        (`deepepochs.engine.continuation`). Returns the task's metrics (global under DDP)."""
        ctx = self.ctx
        parts, loop, machine = ctx.parts, ctx.loop, ctx.machine
        before_task, after_task = STAGE_HOOKS[stage][2:]
        ctx.task = task
        ctx.first_batch = True
        loop.meters = meters
        machine.fire_cold(TriggerName.BEGIN_TASK)
        emit(self.ctx, before_task, task)
        data = task.data
        total = data_length(data)
        if stage == "train":
            data = continuation.TrainingBatches(ctx, data, epoch, skip, samples)
            skip = data.start
        loop.batch_idx = skip
        parts.console.start_task(stage, epoch, loop.target_epochs if stage != "test" else 1, total,
                                 update_clock.progress(ctx) if stage == "train" else None)
        if stage == "train":
            stopped = batches.train_batches(ctx, data, meters, data.total)
            if not skip and loop.batch_idx == 0 and not stopped:
                raise no_batch_error(task.dataloader, ctx.task_index, epoch)
        else:
            batches.eval_batches(ctx, data, meters, stage)
        ctx.data_source = None
        parts.console.end_task()
        self._raise_pending_nonfinite(meters)
        rank_place.agree(ctx, rank_place.task_end(stage, ctx.task_index, epoch))  # before the task's collectives
        parts.dist.check_batch_counts(loop.batch_idx, stage)
        metrics = self._task_metrics(meters)
        emit(self.ctx, after_task, task, metrics)
        machine.fire_cold(TriggerName.END_TASK)
        ctx.task = None
        return metrics

    # ---- metrics ----
    def _task_metrics(self, meters: TaskMeters) -> dict:
        """The task's metrics (global under DDP), computed once per finished task."""
        if meters.final is not None:
            return meters.final
        ctx = self.ctx
        dist = ctx.parts.dist
        take_default_averages()  # forget what metrics called outside this task chose: the notes are this task's
        out = {}
        total = meters.loss_total()
        if dist.world_size == 1:
            if total is not None:
                out["loss"] = float(total) / meters.count
        else:
            stats = torch.zeros(2, dtype=torch.float64, device=ctx.parts.device)
            if total is not None:
                stats[0] = total
                stats[1] = meters.count
            stats = dist.reduce_sum(stats)
            if stats[1] > 0:
                out["loss"] = float(stats[0] / stats[1])
        # Under DDP: merged copies (global metrics on every rank), names agreed even for an empty shard.
        sources = dict.fromkeys(out, "the loss")
        for name, patch in dist.sync_patches(meters.patches).items():
            merge_values(out, sources, name, patch.forward(), getattr(patch, "name", None))
        if meters.skipped and not meters.count:
            # No update of this training task was applied (every one skipped for inf/NaN): its loss and
            # metrics are NaN, so the epoch keeps its entry in every record (the skip decisions agree over
            # the ranks, so every rank takes this branch).
            for name in ("loss", *meters.metrics):
                out.setdefault(name, math.nan)
        for average in take_default_averages():  # say once what average=None chose and how to choose
            ctx.parts.console.note_once(f"{average}-average", DEFAULT_AVERAGE_NOTES[average])
        meters.final = out
        return out

    def _stage_metrics(self, meters_list, tasks) -> dict:
        """A stage's metrics from its tasks' (`tasks.merge_stage_metrics`), noting once how names of several
        unnamed tasks are told apart when they clash."""
        per_task = [self._task_metrics(meters) for meters in meters_list]
        names = [task.name for task in tasks]
        if len(per_task) > 1 and len({name for m in per_task for name in m}) < sum(len(m) for m in per_task) \
                and any(name is None for name in names[1:]):
            self.ctx.parts.console.note_once("task-suffix", TASK_SUFFIX_NOTE)
        return merge_stage_metrics(per_task, names)

    def _raise_pending_nonfinite(self, meters):
        """nonfinite='raise' on an accelerator: the per-update finite checks were kept on the device;
        one read here, at the task's end, where the loop reads values anyway."""
        ctx = self.ctx
        flag, ctx.pending_nonfinite = ctx.pending_nonfinite, None
        if flag is not None and bool(flag):
            loop = ctx.loop
            raise FloatingPointError(
                f"non-finite loss or gradient in a training update during epoch {loop.epoch} (task ending at batch"
                f" {loop.batch_idx}); on {ctx.parts.device} nonfinite='raise' checks at the task's end to avoid"
                " a host sync per update: pass nonfinite='skip' to skip such updates as they happen"
            )

    # ---- misc ----
    def _header(self):
        """Print the run's header once per trainer (time, device, running id, parameters, precision and the
        parameters' dtypes: `precision` names autocast's, a float64 model trains in float64 under 'fp32')."""
        if self.header_done:
            return
        self.header_done = True
        ctx = self.ctx
        parts = ctx.parts
        n = sum(p.numel() for p in parts.raw_model.parameters())
        dtypes = ", ".join(sorted({str(p.dtype).removeprefix("torch.") for p in parts.raw_model.parameters()}))
        now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        world = parts.dist.world_size
        extra = f" | world size: {world}" if world > 1 else ""
        parts.console.info(f"{now} | device: {parts.device} | running id: {ctx.run.running_id} | parameters:"
                           f" {n:,} ({dtypes}) | precision: {parts.config.precision}{extra}")


def _uncounted(batch_x, batch_y) -> int:
    """Prediction keeps no per-sample statistics: batches need no sample count."""
    return 0


def _step_hint(exc: BaseException, task) -> str | None:
    """A hint for deepepochs 0.6 step code: 0.6 passed a single input as a one-item list, so its steps
    call `self.model(*batch_x)`, which unpacks a tensor's rows into arguments here (a TypeError such as
    "forward() takes 2 positional arguments but 33 were given")."""
    if (isinstance(exc, TypeError) and getattr(task, "step_fn", None) is not None
            and "positional argument" in str(exc) and "were given" in str(exc)):
        return ("deepepochs: a step method gets a single model input as itself, not as a one-item list as in"
                " deepepochs 0.6: call self.model(batch_x), not self.model(*batch_x) (see docs/MIGRATION.md)")
    return None
