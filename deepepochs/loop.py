"""The loop's run-time state and the guards and actions the spec names, bound to one trainer.

`LoopState` is the typed record every guard reads. `LoopActions` implements each guard and action of the
spec by name (`guard_<name>`, `act_<name>`); `bind_machine` hands them to a `LoopMachine`. The actions
delegate to the policy modules: precision (scaling, finiteness), optim (stepping, scheduling), distributed
(gradient sync, global counts) and the task meters (window statistics).
"""

from __future__ import annotations

import attrs
import torch

from deepepochs.checkpoint import resume_once
from deepepochs.fsm.machine import LoopMachine, load_spec

__all__ = ["LoopActions", "LoopState", "ResumePoint", "StopRequest", "bind_machine"]


@attrs.define(frozen=True)
class StopRequest:
    """A request to end the fit after the current epoch (e.g. early stopping)."""

    reason: str
    source: str = ""


@attrs.define(frozen=True)
class ResumePoint:
    """Where an interrupted training stage resumes: `stage`, task index and completed batches."""

    epoch: int
    task_index: int
    batches_done: int


@attrs.define(slots=True)
class LoopState:
    """Counters and flags of a running loop (guards read these; actions update them).

    Epochs are 1-based (`epoch` 0 means none has started); `batch_idx` is 1-based within the task.
    """

    target_epochs: int = 0
    completed_epochs: int = 0
    epoch: int = 0
    stage: str | None = None
    batch_idx: int = 0
    window_size: int = 1
    window_pos: int = 0
    window_first_size: int = 0
    window_samples: int = 0
    window_boundary: bool = False
    window_updated: bool = False
    val_due: bool = False
    stop: StopRequest | None = None
    save_requests: list = attrs.Factory(list)
    update_indices: tuple = ()
    finite: dict = attrs.Factory(dict)
    opt_index: int = 0
    meters: object = None
    resume: ResumePoint | None = None
    last_error_state: str | None = None



# States in which a training step has not returned yet (its batch is not in the meters).
_IN_STEP = frozenset({"step_forward", "step_backward", "step_optimized", "optimize_unscaled",
                      "optimize_clipped"})


class LoopActions:
    """Guards and actions of the spec for one trainer."""

    def __init__(self, trainer):
        self.t = trainer
        self.loop: LoopState = trainer.loop

    # ---- guards (side-effect free, real bools) ----
    def guard_epochs_remaining(self) -> bool:
        return self.loop.completed_epochs < self.loop.target_epochs

    def guard_stop_requested(self) -> bool:
        return self.loop.stop is not None

    def guard_val_due(self) -> bool:
        return self.loop.val_due

    def guard_window_boundary(self) -> bool:
        return self.loop.window_boundary

    def guard_grads_finite(self) -> bool:
        return self.loop.finite.get(self.loop.opt_index, True)

    def guard_has_save_requests(self) -> bool:
        return bool(self.loop.save_requests)

    def guard_resume_pending(self) -> bool:
        return bool(self.t._resume_pending)

    # ---- actions ----
    def act_resume_checkpoint(self) -> None:
        resume_once(self.t)

    def act_start_epoch(self) -> None:
        loop = self.loop
        loop.epoch = loop.completed_epochs + 1
        loop.stop = None
        self.t._dist.set_epoch(loop.epoch)

    def act_report_early_stop(self) -> None:
        stop = self.loop.stop
        self.t._console.info(f"Stopped early after epoch {self.loop.completed_epochs}: {stop.reason}")

    def act_open_window(self) -> None:
        loop = self.loop
        loop.window_pos = 0
        loop.window_samples = 0
        loop.window_first_size = 0
        loop.window_updated = False

    def act_sync_gradients(self) -> None:
        self.t._dist.set_grad_sync(True)

    def act_skip_gradient_sync(self) -> None:
        self.t._dist.set_grad_sync(False)

    def act_unscale_gradients(self) -> None:
        """Unscale (fp16), check finiteness, and normalise by the window's real sample count.

        Each micro-batch backpropagated `loss * n_i / (k * n_first)`; the window's gradient should be
        `sum(n_i * loss_i) / N` with N the window's samples over all ranks, so we multiply by
        `w * k * n_first / N` (DDP already averaged over the w ranks). For full windows of equal batches
        the factor is exactly 1 and no pass over the gradients is made. Gradients found non-finite are
        left alone: their optimizer skips this update.

        Host syncs: fp16 reads all optimizers' inf flags at once (the read `GradScaler.step` would make);
        fp32/bf16 read one flag for the window's losses. Nothing else here waits for the device.
        """
        t, loop = self.t, self.loop
        opts, indices = t._opts, loop.update_indices
        finite = loop.finite
        finite.clear()
        if t._precision.scaler is None:  # fp32/bf16: the window's losses decide (one check per update)
            ok = t._runner.window_loss_finite()
            for i in indices:
                finite[i] = ok
        else:
            finite.update(zip(indices, t._precision.unscale([opts[i].opt for i in indices])))
        if loop.window_size > 1:
            window_total = t._dist.global_sum(loop.window_samples)  # a collective under DDP: every rank
            factor = t._dist.world_size * loop.window_size * loop.window_first_size / window_total
            if factor != 1.0:
                seen, grads = set(), []
                for i in indices:
                    if finite[i]:
                        for g in opts.grads(i):
                            if id(g) not in seen:  # a parameter shared by two optimizers: scale it once
                                seen.add(id(g))
                                grads.append(g)
                if grads:
                    torch._foreach_mul_(grads, factor)

    def act_clip_gradients(self) -> None:
        """Run each registered clipper as `clip(trainer, indices, finite)` on the unscaled gradients."""
        loop = self.loop
        for clip in self.t._clippers:
            clip(self.t, loop.update_indices, loop.finite)

    def act_step_optimizer(self) -> None:
        """Step optimizer `opt_index`; its post-hook steps its step-wise scheduler and sets window_updated
        (from then on an interrupt must not replay this window)."""
        self.t._opts.step(self.loop.opt_index)

    def act_skip_optimizer(self) -> None:
        """Leave optimizer `opt_index` and its scheduler untouched; tell the callbacks."""
        for hook in self.t._hooks["on_skip_optimize"]:
            hook(self.t, self.loop.opt_index)

    def act_update_scaler(self) -> None:
        """Hand this update's inf records to the scaler, which adjusts its scale once per iteration."""
        t, loop = self.t, self.loop
        precision = t._precision
        if precision.scaler is None:  # fp32/bf16
            return
        opts = t._opts
        token = (loop.epoch, loop.batch_idx, id(loop.meters))  # this batch; Runner.loss builds the same
        precision.finish([opts[i].opt for i in loop.update_indices], len(opts), token)

    def act_zero_grad(self) -> None:
        """Drop the updated optimizers' gradients (set to None: the next backward writes, not adds)."""
        self.t._opts.zero_grad(self.loop.update_indices)

    def act_close_window(self) -> None:
        self.loop.meters.close_window()
        self.loop.window_pos = 0
        opts = self.t._opts
        if len(opts) > 1:
            # With several optimizers a later loss of the step (e.g. a GAN's generator loss) writes
            # gradients into parameters an earlier update already zeroed; drop them so that they cannot
            # leak into the next window.
            opts.zero_grad(opts.all_indices)

    def act_step_epoch_schedulers(self) -> None:
        self.t._step_epoch_schedulers()

    def act_save_checkpoints(self) -> None:
        requests = list(self.loop.save_requests)
        self.loop.save_requests.clear()
        for save in requests:
            save()

    def act_discard_window(self) -> None:
        """Rollback: drop every gradient, the interrupted update's scaler records, the window's loss sums
        and patches; completed updates stay (ACC-3)."""
        t, loop = self.t, self.loop
        t._opts.zero_grad(t._opts.all_indices)
        t._precision.discard_step_state()
        t._dist.set_grad_sync(True)
        meters = loop.meters
        if meters is not None:
            if loop.stage == "train" and loop.window_updated:
                # The window's update was applied, so the next fit resumes after it: the window is complete
                # and its loss statistics stay. A step interrupted after its update has not handed back its
                # batch yet: count the batch's loss (its metric patches never came back).
                runner = t._runner
                if loop.last_error_state in _IN_STEP and runner._step_loss is not None:
                    meters.add_batch(runner._step_loss, runner._batch_n, None)
                meters.close_window()
            else:
                meters.discard_window()
        loop.save_requests.clear()

    def act_reset_loop(self) -> None:
        loop = self.loop
        loop.stage = None
        loop.meters = None
        loop.window_pos = 0
        loop.finite.clear()


def bind_machine(trainer) -> LoopMachine:
    """Build the trainer's `LoopMachine` with its guards and actions looked up by spec name."""
    acts = LoopActions(trainer)
    spec = load_spec()
    guards = {g.name: getattr(acts, f"guard_{g.name}") for g in spec.guards}
    actions = {a.name: getattr(acts, f"act_{a.name}") for a in spec.actions}
    return LoopMachine(guards, actions, trainer.loop)
