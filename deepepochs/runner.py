"""The loop driver: iterates stages, tasks and batches and fires the machine's triggers.

Training batches take every edge here (`_train_batches`: the user's step, callbacks, several optimizers,
DDP), or the fused edges in `deepepochs.fused` when nothing can observe a micro-batch's inner states.
Per micro-batch this does one batch split and device move, the step and a handful of compiled-table
triggers (~1 µs each). Nothing here reads a tensor value on the host except where a guard needs it (the
fp32 finite check at an update) and the console's throttled batch line.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import torch

from deepepochs import fused
from deepepochs.data import batch_splitter, call_model, lookahead
from deepepochs.errors import ConfigError, LoopError
from deepepochs.loop import ResumePoint
from deepepochs.patches import PatchBase, ValuePatch
from deepepochs.tasks import STEP_NAMES, BatchMetrics, EpochTask, TaskMeters, _as_metric_list, flatten_value

__all__ = ["Runner"]

_EV = {
    stage: {
        "before_stage": f"on_before_{stage}_epochs", "after_stage": f"on_after_{stage}_epochs",
        "before_task": f"on_before_{stage}_epoch", "after_task": f"on_after_{stage}_epoch",
        "before_batch": f"on_before_{stage}_batch", "after_batch": f"on_after_{stage}_batch",
        "before_forward": f"on_before_{stage}_forward", "after_forward": f"on_after_{stage}_forward",
        "metrics": f"on_{stage}_metrics",
    }
    for stage in ("train", "val", "test")
}


class Runner:
    """Runs fit and test for one trainer (`t`)."""

    def __init__(self, trainer):
        self.t = trainer
        self.task: EpochTask | None = None
        self.last_metrics: dict = {}
        self._step_loss = None
        self._batch_n = 0

    # ---- setup ----
    @staticmethod
    def metric_list(metrics, argname):
        return _as_metric_list(metrics, argname)

    def make_tasks(self, stage, dataloader, tasks, metrics, do_loss, batch_size) -> list[EpochTask]:
        """EpochTasks of a stage from a DataLoader and/or a task list (they combine, DataLoader first)."""
        out = []
        if dataloader is not None:
            out.append(EpochTask(dataloader, do_loss=do_loss, batch_size=batch_size))
        if tasks:
            for task in tasks if isinstance(tasks, (list, tuple)) else [tasks]:
                if not isinstance(task, EpochTask):
                    raise ConfigError(f"{stage}_tasks must hold EpochTask objects (got {type(task).__name__})")
                out.append(task)
        for i, task in enumerate(out):
            if _len_or_none(task.dataloader) == 0:
                raise ConfigError(
                    f"the {stage} data of task {i} is empty (len 0): check the dataset size, batch_size and"
                    " drop_last; a DataLoader must yield at least one batch"
                )
            task.trainer = self.t
            task.stage = stage
            task.all_metrics = [*metrics, *task.metrics]
            if task.batch_size is None:
                task.batch_size = batch_size
            task.data = self.t._dist.prepare_dataloader(task.dataloader, stage)
            task.step_fn = self._resolve_step(task, stage)
        return out

    def _resolve_step(self, task, stage):
        """`step`, then the stage's method, then `evaluate_step`; per name the task's before the trainer's."""
        from deepepochs.trainer import TrainerBase

        t = self.t
        for name in STEP_NAMES[stage]:
            if getattr(type(task), name, None) is not None:
                return getattr(task, name)
            method = getattr(type(t), name, None)
            if method is not None and method is not getattr(TrainerBase, name, None):
                return getattr(t, name)
        return t.train_step if stage == "train" else t.evaluate_step

    # ---- error handling: interrupt -> rollback -> idle, with the flight record ----
    def guarded(self, run):
        t = self.t
        try:
            return run()
        except BaseException as exc:
            self._rollback(exc)
            loop = t.loop
            note = (f"deepepochs: {type(exc).__name__} raised in state {loop.last_error_state!r} (epoch"
                    f" {loop.epoch}, batch {loop.batch_idx}, stage {self._failed_stage!r});"
                    f" {t.machine.flight_record()}")
            if hasattr(exc, "add_note"):
                exc.add_note(note)
            exc.deepepochs_flight_record = t.machine.records()
            raise

    def _rollback(self, exc):
        t, loop, machine = self.t, self.t.loop, self.t.machine
        state = machine.state
        loop.last_error_state = state
        self._failed_stage = loop.stage
        self._record_resume_point(state)
        try:
            if machine.spec.state(state).running:
                machine.fire_cold("interrupt")
            for hook in t._hooks["on_rollback"]:
                hook(t, exc, state)
            if machine.state != "idle":
                machine.fire_cold("recover")
        except BaseException as inner:  # never leave a half-rolled-back trainer behind
            machine.reset()
            t._opts.zero_grad(t._opts.all_indices)
            raise LoopError(f"rollback after an error in state {state!r} failed: {inner!r}") from exc
        finally:
            t.model = t._train_model
            t._console.close()
            self._step_loss = None
            self._pending_nonfinite = None
        for hook in t._hooks["on_interrupted"]:
            hook(t, exc)

    def _record_resume_point(self, state):
        """Remember where an interrupted fit resumes: completed windows (and tasks) are kept, so the next
        fit continues after the last completed update instead of repeating or skipping data."""
        loop = self.t.loop
        if self._train_done is not None and loop.epoch:  # this epoch's training had finished
            loop.resume = ResumePoint(loop.epoch, -1, 0)
            self._saved_meters = self._train_done
        elif loop.stage == "train" and self._train_progress is not None:
            updated = state == "step_optimized" or loop.window_updated
            done = loop.batch_idx if updated else loop.batch_idx - loop.window_pos
            index, meters_list = self._train_progress
            if loop.meters is not None:
                loop.meters.first_batch = done
            loop.resume = ResumePoint(loop.epoch, index, done)
            self._saved_meters = meters_list

    # ---- fit ----
    _train_progress = None
    _train_done = None
    _saved_meters = None

    def run_fit(self, train, val, val_freq):
        t, loop, machine = self.t, self.t.loop, self.t.machine
        fire = machine.fire_cold
        loop.target_epochs = t.config.epochs
        records = {"train": {}, "val": {}}
        fire("fit")
        self._header()
        self._run_hooks("on_before_fit", t.config.epochs)
        if not t._started:
            t._started = True
            t._dist.broadcast_model(t.raw_model)  # after init callbacks: every rank starts equal (DDP-5)
        t._opts.drop_stale_grads()
        while fire("next_epoch") == "epoch_running":
            epoch = loop.epoch
            self.last_metrics = {}
            self._run_hooks("on_before_epoch", train, val, epoch)
            fire("begin_train")
            train_metrics = self._run_train_stage(train, epoch)
            fire("end_stage")
            loop.val_due = bool(val) and epoch % val_freq == 0
            val_metrics = {}
            if fire("validate") == "stage_val":
                val_metrics = self._run_eval_stage("val", val, epoch)
                fire("end_stage")
            loop.completed_epochs = epoch
            loop.resume = None
            self._train_done = None
            self._run_hooks("on_after_epoch", train, val, train_metrics, val_metrics, epoch)
            t._console.epoch(epoch, loop.target_epochs, {"train": train_metrics, "val": val_metrics})
            for stage, metrics in (("train", train_metrics), ("val", val_metrics)):
                for name, value in metrics.items():
                    records[stage].setdefault(name, []).append(value)
                    t.history[stage].setdefault(name, []).append(value)
            fire("end_epoch")
        loop.stage = None
        self._run_hooks("on_after_fit")
        fire("finish")
        return records

    def _run_train_stage(self, tasks, epoch):
        t, loop = self.t, self.t.loop
        resume = loop.resume if loop.resume is not None and loop.resume.epoch == epoch else None
        loop.stage = "train"
        t.model = t._train_model
        t.raw_model.train()
        self._run_hooks("on_before_train_epochs", tasks, epoch)
        saved = self._saved_meters if resume is not None else None
        if resume is not None and resume.task_index == -1:  # training finished before the interrupt
            self._train_done = saved
            metrics = self._stage_metrics(tasks, saved)
            self._run_hooks("on_after_train_epochs", tasks, metrics, epoch)
            return metrics
        meters_list = []
        for index, task in enumerate(tasks):
            skip = 0
            if saved is not None and index < len(saved) and (resume.task_index > index
                                                             or resume.task_index == index):
                meters = saved[index]
                skip = meters.first_batch if index == resume.task_index else None
            else:
                meters = TaskMeters()
            meters_list.append(meters)
            self._train_progress = (index, meters_list)
            if skip is None:  # this task completed before the interrupt
                continue
            self._run_task(task, "train", epoch, meters, skip)
        self._train_progress = None
        self._train_done = meters_list
        loop.resume = None
        metrics = self._stage_metrics(tasks, meters_list)
        self.last_metrics["train"] = metrics
        self._run_hooks("on_after_train_epochs", tasks, metrics, epoch)
        return metrics

    def _run_eval_stage(self, stage, tasks, epoch):
        t, loop = self.t, self.t.loop
        loop.stage = stage
        t.model = t._eval_model
        t.raw_model.eval()
        ev = _EV[stage]
        self._run_hooks(ev["before_stage"], tasks, epoch) if stage == "val" else self._run_hooks(
            ev["before_stage"], tasks)
        meters_list = []
        try:
            with torch.no_grad():
                for task in tasks:
                    meters = TaskMeters()
                    meters_list.append(meters)
                    self._run_task(task, stage, epoch, meters, 0)
        finally:
            t.model = t._train_model
            t.raw_model.train()
        metrics = self._stage_metrics(tasks, meters_list)
        self.last_metrics[stage] = metrics
        if stage == "val":
            self._run_hooks(ev["after_stage"], tasks, metrics, epoch)
        else:
            self._run_hooks(ev["after_stage"], tasks, metrics)
        return metrics

    def run_test(self, tasks):
        t, loop = self.t, self.t.loop
        t.machine.fire_cold("test")
        self._header()
        loop.epoch = max(loop.epoch, 0)
        metrics = self._run_eval_stage("test", tasks, 1)
        loop.stage = None
        t.machine.fire_cold("end_stage")
        t._console.test(metrics)
        return metrics

    # ---- one task ----
    def _run_task(self, task, stage, epoch, meters, skip):
        t, loop, machine = self.t, self.t.loop, self.t.machine
        ev = _EV[stage]
        self.task = task
        loop.meters = meters
        machine.fire_cold("begin_task")
        self._run_hooks(ev["before_task"], task)
        data = task.data
        total = _len_or_none(data)
        if skip:
            data = itertools.islice(data, skip, None)
        loop.batch_idx = skip
        t._console.start_task(stage, epoch, loop.target_epochs if stage != "test" else 1, total)
        if stage == "train":
            (fused.loop_for(self, task) or self._train_batches)(task, data, meters)
        else:
            self._eval_batches(task, data, meters, ev)
        t._console.end_task()
        self._raise_pending_nonfinite()
        t._dist.check_batch_counts(loop.batch_idx, stage)
        metrics = self._task_metrics(meters)
        self._run_hooks(ev["after_task"], task, metrics)
        machine.fire_cold("end_task")
        self.task = None
        return metrics

    def _train_batches(self, task, data, meters):
        t, loop = self.t, self.t.loop
        fire = t.machine.fire
        hooks = t._hooks.by_event
        before_batch, after_batch = hooks["on_before_train_batch"], hooks["on_after_train_batch"]
        k = t.config.gradient_accumulation_steps
        loop.window_size = k
        split = batch_splitter(t.loss_fn is not None, t.device, t.device.type == "cuda", task.batch_size)
        step_fn, step_args = task.step_fn, task.step_args
        console, autocast = t._console, t._precision.autocast
        amp = t._precision.dtype is not None
        log_batch = console.log_batch or console.log_tqdm
        for batch, is_last in lookahead(data):
            if loop.window_pos == 0:
                fire("begin_window")
            loop.window_pos += 1
            loop.batch_idx += 1
            loop.window_boundary = is_last or loop.window_pos == k
            batch_x, batch_y, n = split(batch)
            if loop.window_pos == 1:
                loop.window_first_size = n
            loop.window_samples += n
            self._batch_n = n
            self._step_loss = None
            fire("begin_batch")
            for hook in before_batch:
                hook(t, batch_x, batch_y, loop.batch_idx)
            if amp:
                with autocast():  # forward and loss of default and custom steps alike (AMP-1)
                    result = step_fn(batch_x, batch_y, **step_args)
            else:
                result = step_fn(batch_x, batch_y, **step_args)
            patches = None if result is None else self._check_step_result(result, n)
            loss = self._step_loss
            if patches and "loss" in patches:
                loss = None
            meters.add_batch(loss, n, patches)
            fire("end_batch")
            if after_batch:
                metrics = BatchMetrics(loss, patches)
                for hook in after_batch:
                    hook(t, metrics, loop.batch_idx)
            if log_batch:
                console.batch(loop.batch_idx, lambda loss=loss, p=patches: BatchMetrics(loss, p))

    def _eval_batches(self, task, data, meters, ev):
        t, loop = self.t, self.t.loop
        fire = t.machine.fire
        before_batch, after_batch = t._hooks[ev["before_batch"]], t._hooks[ev["after_batch"]]
        split = batch_splitter(t.loss_fn is not None, t.device, t.device.type == "cuda", task.batch_size)
        step_fn, step_args = task.step_fn, task.step_args
        console, autocast = t._console, t._precision.autocast
        for batch in data:
            loop.batch_idx += 1
            batch_x, batch_y, n = split(batch)
            self._batch_n = n
            self._step_loss = None
            fire("begin_batch")
            for hook in before_batch:
                hook(t, batch_x, batch_y, loop.batch_idx)
            with autocast():
                result = step_fn(batch_x, batch_y, **step_args)
            patches = None if result is None else self._check_step_result(result, n)
            loss = None if (patches and "loss" in patches) else self._step_loss
            meters.add_batch(loss, n, patches)
            meters.close_window()
            fire("end_batch")
            if after_batch:
                metrics = BatchMetrics(loss, patches)
                for hook in after_batch:
                    hook(t, metrics, loop.batch_idx)
            console.batch(loop.batch_idx, lambda loss=loss, p=patches: BatchMetrics(loss, p))

    @staticmethod
    def _check_step_result(result, n):
        if result is None:
            return None
        if not isinstance(result, dict):
            raise ConfigError(f"a step method must return None or a dict {{name: Patch}} (got {type(result).__name__})")
        for name, value in result.items():
            if not isinstance(value, PatchBase):
                if isinstance(value, (torch.Tensor, int, float)):
                    result[name] = ValuePatch(value.detach() if isinstance(value, torch.Tensor) else value, n)
                else:
                    raise ConfigError(f"step result {name!r} must be a Patch, a tensor or a number"
                                      f" (got {type(value).__name__})")
        return result

    # ---- metrics ----
    def _task_metrics(self, meters: TaskMeters) -> dict:
        """The task's metrics (global under DDP), computed once per finished task."""
        if meters.final is not None:
            return meters.final
        dist = self.t._dist
        out = {}
        total = meters.loss_total()
        if dist.world_size == 1:
            if total is not None:
                out["loss"] = float(total) / meters.count
        else:
            stats = torch.zeros(2, dtype=torch.float64, device=self.t.device)
            if total is not None:
                stats[0] = total
                stats[1] = meters.count
            stats = dist.reduce_sum(stats)
            if stats[1] > 0:
                out["loss"] = float(stats[0] / stats[1])
        # Under DDP: merged copies (global metrics on every rank), names agreed even for an empty shard.
        for name, patch in dist.sync_patches(meters.patches).items():
            out.update(flatten_value(name, patch.forward()))
        meters.final = out
        return out

    def _stage_metrics(self, tasks, meters_list) -> dict:
        metrics = {}
        for i, meters in enumerate(meters_list):
            for name, value in self._task_metrics(meters).items():
                metrics[name if name not in metrics else f"{name}_{i}"] = value
        return metrics

    # ---- inside a step ----
    def default_step(self, batch_x, batch_y, stage):
        t = self.t
        ev, hooks, task = _EV[stage], t._hooks.by_event, self.task
        for hook in hooks[ev["before_forward"]]:
            hook(t)
        model_out = call_model(t.model, batch_x)  # under the step's autocast (see _train_batches)
        for hook in hooks[ev["after_forward"]]:
            hook(t, model_out)
        loss = None
        if stage == "train" or task.do_loss:
            loss = self.loss(model_out, batch_y, 1.0, True)
        for hook in hooks[ev["metrics"]]:
            hook(t, loss, model_out, batch_y, task)
        return t.batch_patches(model_out, batch_y) if task.all_metrics else None

    def compute_loss(self, model_out, batch_y) -> torch.Tensor:
        """The loss function's value (or the model's own loss with loss=None), checked to be a scalar."""
        loss_fn = self.t.loss_fn
        if loss_fn is None:
            loss = model_out.get("loss") if isinstance(model_out, dict) else model_out
            if not isinstance(loss, torch.Tensor):
                raise ConfigError("with loss=None the model must return a scalar loss tensor or a dict with"
                                  f" 'loss' (got {type(model_out).__name__})")
        else:
            loss = loss_fn(model_out, batch_y)
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ConfigError(f"the loss must be a scalar tensor (got {shape}); reduce it, e.g. with .mean()")
        return loss

    def loss(self, model_out, batch_y, loss_adjust, do_optimize):
        """`Trainer.loss`: compute the loss; in training backpropagate it (scaled) and maybe update."""
        t = self.t
        loss = self.compute_loss(model_out, batch_y)
        # The batch's reported loss: the sub-batch losses of a hand-split batch, weighted by loss_adjust,
        # add up to the batch mean. Detached: statistics must not keep the graph alive.
        value = loss.detach() if loss_adjust == 1.0 else loss.detach() * loss_adjust
        self._step_loss = value if self._step_loss is None else self._step_loss + value
        loop = t.loop
        if loop.stage != "train":
            return loss
        t.machine.fire("backward")
        hooks = t._hooks.by_event
        for hook in hooks["on_before_backward"]:
            hook(t, loss)
        # Weight this micro-batch by its share of the window: n_i / (k * n_first). For a window of k equal
        # batches that is 1/k, the usual accumulation factor; the update (unscale_gradients) multiplies by
        # k * n_first / N once, so a short tail window or a ragged batch weighs each sample exactly as a
        # full window does. Dividing here, not at the update, keeps fp16 gradients in range while they add up.
        factor = loss_adjust
        if loop.window_size > 1:
            factor *= self._batch_n / (loop.window_size * loop.window_first_size)
        scaled = loss if factor == 1.0 else loss * factor
        # fp16: every loss of one batch is scaled with the same scale (see deepepochs.precision).
        # Backward leaves the step's autocast region: its ops already run in the dtypes the forward chose,
        # and PyTorch advises against running backward under autocast.
        precision = t._precision
        if precision.dtype is None:
            scaled.backward()
        else:
            with precision.no_autocast():
                precision.scale(scaled, (loop.epoch, loop.batch_idx, id(loop.meters))).backward()
        for hook in hooks["on_after_backward"]:
            hook(t, loss)
        if do_optimize:
            self.optimize(None)
        return loss

    def optimize(self, optimize_index):
        """`Trainer.optimize`: on the window's last micro-batch run the optimize layer of the machine:
        unscale -> clip -> step or skip per optimizer -> scaler update and zero_grad."""
        t = self.t
        loop = t.loop
        if loop.stage != "train":
            return
        fire = t.machine.fire
        loop.update_indices = t._opts.indices(optimize_index)
        if fire("optimize") != "optimize_unscaled":
            return  # an inner micro-batch: gradients keep accumulating
        hooks = t._hooks.by_event
        for hook in hooks["on_before_optimize"]:
            hook(t, optimize_index)
        fire("clip")
        for i in loop.update_indices:
            loop.opt_index = i
            fire("apply_update")  # grads_finite picks the step or the skip edge for optimizer i
        fire("finish_update")
        t.loop.window_updated = True
        for hook in hooks["on_after_optimize"]:
            hook(t, optimize_index)

    @contextlib.contextmanager
    def no_sync(self):
        """`Trainer.no_sync`: backward inside does not all-reduce gradients (a no-op in one process).

        On exit the sync setting the machine chose for this micro-batch is restored (on only for a
        window's last micro-batch), so a hand-split batch inside an inner micro-batch still does not sync.
        """
        t = self.t
        dist = t._dist
        dist.set_grad_sync(False)
        try:
            yield
        finally:
            loop = t.loop
            dist.set_grad_sync(loop.window_boundary if loop.stage == "train" else True)

    def window_loss_finite(self) -> bool:
        """Whether the update window's losses are all finite (fp32/bf16; fp16 asks the scaler instead).

        By design this reads one value on the host per update (the guard needs a Python bool): under fp32
        nothing else tells a NaN update apart, and one read per update, not per batch, is cheap. Under DDP
        the flag is summed over the ranks first, so every rank takes the same step/skip edge (gradients
        are averaged, so one rank's NaN reaches all). Raises FloatingPointError with nonfinite='raise'.
        """
        t, loop = self.t, self.t.loop
        window = loop.meters.window_losses
        step_loss = self._step_loss
        if not window and step_loss is not None and step_loss.is_cpu and t._dist.world_size == 1:
            # the common CPU case (one micro-batch per window): one read of a host value, no tensor ops
            ok = math.isfinite(step_loss.item())
            if not ok and t.config.nonfinite == "raise":
                self._raise_nonfinite()
            return ok
        losses = [loss for loss, _ in window]
        if self._step_loss is not None:
            losses.append(self._step_loss)
        dist = t._dist
        if not losses and dist.world_size == 1:
            return True
        if len(losses) == 1:
            total = losses[0]  # one element: .item() below reads it (~0.3 µs on CPU)
        elif losses:  # inf and NaN survive a sum; float32 keeps fp16 losses from overflowing in it
            total = torch.stack([v.reshape(()).float() for v in losses]).sum()
        else:
            total = torch.zeros((), device=t.device)
        if dist.world_size == 1 and total.device.type != "cpu" and t.config.nonfinite == "raise":
            # PERF-2: no host read per update on an accelerator. Keep a device-side flag and check it at
            # the task's end, where the loop reads values anyway; 'skip' needs the per-update read.
            bad = ~torch.isfinite(total.detach().reshape(()))
            self._pending_nonfinite = bad if self._pending_nonfinite is None else self._pending_nonfinite | bad
            return True
        if dist.world_size > 1:
            bad = dist.reduce_sum((~torch.isfinite(total)).float().reshape(1))
            ok = bad.item() == 0.0
        else:
            ok = math.isfinite(total.item())
        if not ok and t.config.nonfinite == "raise":
            self._raise_nonfinite()
        return ok

    def _raise_nonfinite(self):
        """nonfinite='raise': the update window's loss was inf/NaN."""
        t, loop = self.t, self.t.loop
        raise FloatingPointError(
            f"non-finite loss in the update window ending at epoch {loop.epoch} batch {loop.batch_idx}"
            f" (precision={t.config.precision!r}); pass nonfinite='skip' to Trainer to skip such updates"
        )

    _pending_nonfinite = None

    def _raise_pending_nonfinite(self):
        """Raise for an inf/NaN loss an accelerator run flagged without a host read (see window_loss_finite)."""
        flag, self._pending_nonfinite = self._pending_nonfinite, None
        if flag is not None and bool(flag):
            loop = self.t.loop
            raise FloatingPointError(
                f"non-finite loss in a training update during epoch {loop.epoch} (task ending at batch"
                f" {loop.batch_idx}); on {self.t.device} nonfinite='raise' checks at the task's end to avoid a"
                " host sync per update: pass nonfinite='skip' to skip such updates as they happen"
            )

    # ---- misc ----
    def _run_hooks(self, event, *args):
        t = self.t
        for hook in t._hooks[event]:
            hook(t, *args)

    def _header(self):
        t = self.t
        if getattr(self, "_header_done", False):
            return
        self._header_done = True
        n = sum(p.numel() for p in t.raw_model.parameters())
        import datetime

        now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")
        extra = f" | world size: {t.world_size}" if t.world_size > 1 else ""
        t._console.info(f"{now} | device: {t.device} | running id: {t.running_id} | parameters: {n:,}"
                        f" | precision: {t.config.precision}{extra}")


def _len_or_none(data):
    try:
        return len(data)
    except TypeError:
        return None


