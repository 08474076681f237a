"""What the engine works on: the loop's counters (`LoopState`), the trainer parts it may use (`Parts`) and
the run-time context of one trainer (`Context`), which the spec's guards and actions read and write.

`Parts` is the whole interface between the `Trainer` facade and the engine: the facade builds it once, and
the engine never reaches back into the facade. The facade object itself travels only as the first
argument of callback hooks and step methods, which are user code.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from deepepochs.config import TrainerConfig
from deepepochs.protocols import (
    ConsoleLike,
    DistPolicy,
    Facade,
    HookTableLike,
    OptimizerSet,
    PrecisionPolicy,
)

__all__ = ["Context", "LoopState", "Parts", "ResumePoint", "StopRequest"]


@attrs.define(frozen=True)
class StopRequest:
    """A request to end the fit after the current epoch (e.g. early stopping)."""

    reason: str
    source: str = ""


@attrs.define(slots=True)
class ResumePoint:
    """The last commit point inside an epoch: where an interrupted fit continues (moved forward in place by
    each committed update).

    Attributes:
        epoch: 1-based epoch the point belongs to.
        task_index: the training task in progress (0-based), or -1 once the epoch's training stage is done.
        batches_done: that task's batches whose windows were committed (their updates applied).
        samples: for a snapshot resumed on another world size, the samples the task consumed over all
            ranks (the task then skips `samples / world size` of its shard); None otherwise.
    """

    epoch: int
    task_index: int
    batches_done: int
    samples: int | None = None


@attrs.define(slots=True)
class LoopState:
    """Counters and flags of a running loop (guards read these; actions update them).

    Epochs are 1-based (`epoch` 0 means none has started); `batch_idx` is 1-based within the task;
    `window_pos` counts the open window's micro-batches (0: no window is open).
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
    window_committed: bool = False
    val_due: bool = False
    stop: StopRequest | None = None
    save_requests: list = attrs.Factory(list)
    update_indices: tuple = ()
    finite: dict = attrs.Factory(dict)
    opt_index: int = 0
    meters: object = None
    resume: ResumePoint | None = None
    resume_pending: bool = False
    last_error_state: str | None = None
    snapshot_due: bool = False
    stop_signal: str | None = None


@attrs.define(frozen=True, eq=False)
class Parts:
    """The trainer parts the engine may use, fixed when the trainer is built.

    Attributes:
        config: the validated `TrainerConfig` (`fit(epochs=...)` hands its new target to the driver).
        device: the training device.
        raw_model: the unwrapped module (train/eval mode, parameters).
        train_model: what training steps call (DDP-wrapped under DDP, compiled if asked).
        eval_model: what evaluation steps call (never DDP-wrapped: no collectives per batch).
        opts: the `Optimizers`.
        precision: the `Precision` policy (autocast, GradScaler).
        dist: the distributed policy (`SingleProcess` or `DDPPolicy`).
        hooks: the `HookTable` of the attached callbacks.
        clippers: gradient clippers, `clip(trainer, indices, finite)`.
        console: the `Console`.
        facade: the object handed to hooks and step methods as `trainer`.
        resolve_step: `(task, stage) -> step method`, or None for the engine's default step.
        resume: loads the checkpoint `Trainer(resume=...)` asked for (the `resume_checkpoint` action),
            with the run's history and, for a finished run, its end (the next fit then trains nothing).
        running_id: the run's current name (a resume may change it).
        target_key: `Trainer(targets='<key>')`: the field of dict batches that holds the targets, or None.
        pick_targets: `Trainer(targets=callable)`: `(batch_x, model_out) -> (preds, targets)` for the
            metrics, or None (the metrics get the model output and the batch's label).
    """

    config: TrainerConfig
    device: torch.device
    raw_model: torch.nn.Module
    train_model: torch.nn.Module
    eval_model: torch.nn.Module
    opts: OptimizerSet
    precision: PrecisionPolicy
    dist: DistPolicy
    hooks: HookTableLike
    clippers: list[Callable[[object, tuple, dict], None]]
    console: ConsoleLike
    facade: Facade
    resolve_step: Callable
    resume: Callable[[], object]
    running_id: Callable[[], str]
    target_key: str | None = None
    pick_targets: Callable | None = None


@attrs.define(slots=True, eq=False)
class Context:
    """One trainer's run-time context: its parts, its loop state, and what the current batch holds.

    Attributes:
        parts: see `Parts`.
        loop: see `LoopState`.
        loss_fn: `loss(model_out, batch_y)` or None (the model returns its loss); settable on the facade.
        model: the model steps call now (`parts.train_model` in training, `parts.eval_model` otherwise).
        task: the `EpochTask` running now.
        step_loss: the current batch's loss so far (detached; several losses of one step add up).
        batch_n: the current batch's sample count.
        hop: how a step moves the machine (`LoopMachine.fire`); a compiled micro-batch moves it itself.
        machine: the `LoopMachine` built from the registry for this context (`Driver`).
        last_metrics: the current epoch's metrics per stage, read by epoch-wise schedulers.
        pending_nonfinite: a device-side inf/NaN flag checked at the task's end (accelerators, PERF-2).
        seeds: gradients that backward starts from, per micro-batch share (`steps.backward`).
        signals: the SIGINT guard that holds a Ctrl-C during an update (`signals.InterruptGuard`).
        task_index: the index of the running task within its stage.
        batch_counted: the current batch's loss and patches are in the meters already.
        train_meters: the epoch's training meters per task (committed work a resumed fit continues).
        history: per stage, per metric, the values of the epochs the run committed (those a resume
            loaded included); `fit()` returns a copy.
        step_patches: the default step's metric patches, made before its update (committed with it).
        epoch_undo: how to undo the epoch-end work done before `commit_epoch`, in order (rollback).
        first_batch: the running task's first batch is yet to be checked (`steps.first_batch_checks`).
        random_state: torch's generator states at the last commit point of the running fit.
        random_restore_due: a fit failed; the next fit starts from `random_state` (a refit).
        task_random_state: the generator states just before the running training task made its data
            iterator (which draws DataLoader worker seeds).
        random_replay: for a refit resuming a task mid-way, (its `task_random_state`, `random_state`):
            the iterator is made from the first, the batches continue from the second.
        monitor_check: the fit's (train tasks, val tasks) until the first training batch has checked the
            checkpoint monitors' names; None after.
        snapshots: the running fit's snapshot writer (a `SnapshotCallback`), or None: then no commit point
            fires the `snapshot` trigger (`deepepochs.engine.snapshots`).
        snapshot_path: the snapshot the last `save_snapshot` wrote (None on ranks other than 0).
        data_source: the running training task's stateful DataLoader (torchdata's `StatefulDataLoader`),
            whose position `remember_position` keeps; None for other data.
        data_state: `(epoch, task index, batches done, state_dict())` of that loader at the last complete
            commit point: a refit or a resumed snapshot continues it with `load_state_dict` instead of
            skipping batches.
    """

    parts: Parts
    loop: LoopState
    loss_fn: Callable | None = None
    model: torch.nn.Module | None = None
    task: object = None
    step_loss: torch.Tensor | None = None
    batch_n: int = 0
    hop: Callable | None = None
    machine: object = None
    last_metrics: dict = attrs.Factory(dict)
    pending_nonfinite: torch.Tensor | None = None
    seeds: dict = attrs.Factory(dict)
    signals: object = None
    task_index: int = 0
    batch_counted: bool = False
    train_meters: list | None = None
    history: dict = attrs.Factory(lambda: {"train": {}, "val": {}})
    step_patches: dict | None = None
    epoch_undo: list = attrs.Factory(list)
    first_batch: bool = False
    random_state: tuple | None = None
    random_restore_due: bool = False
    task_random_state: tuple | None = None
    random_replay: tuple | None = None
    monitor_check: tuple | None = None
    snapshots: object = None
    snapshot_path: object = None
    data_source: object = None
    data_state: tuple | None = None
