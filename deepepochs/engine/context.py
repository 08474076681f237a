"""What the engine works on: the loop's counters (`LoopState`), the trainer parts it may use (`Parts`) and
the run-time context of one trainer (`Context`), which the spec's guards and actions read and write.

`Parts` is the whole interface between the `Trainer` facade and the engine: the facade builds it once, and
the engine never reaches back into the facade. The facade object itself travels only as the first
argument of callback hooks and step methods, which are user code.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import attrs
import torch

from deepepochs.config import TrainerConfig
from deepepochs.engine.runstate import ResumePoint, RunState, StopRequest
from deepepochs.protocols import (
    ConsoleLike,
    DistPolicy,
    Facade,
    HookTableLike,
    OptimizerSet,
    PrecisionPolicy,
)

__all__ = ["Context", "LoopState", "Parts", "ResumePoint", "RunState", "StopRequest"]


def _run_alias(name: str, path: str) -> property:
    """A property reading and writing field `name` of the run state found at `path` from the instance (the
    getter is an `attrgetter`: no Python frame, some are read per micro-batch)."""
    run_of = operator.attrgetter(path)

    def set_(self, value):
        setattr(run_of(self), name, value)

    return property(operator.attrgetter(f"{path}.{name}"), set_, doc=f"The run state's `{name}` (`RunState.{name}`).")


def _run_aliases(path: str, *names: str):
    """Class decorator: `names` become properties of the class reading and writing the run state's fields
    of those names (`deepepochs.engine.runstate`, which owns them), so the loop's and the engine's code keep
    their names for them. Applied below `attrs.define`, which keeps them on the class it makes."""
    def decorate(cls):
        for name in names:
            setattr(cls, name, _run_alias(name, path))
        return cls
    return decorate


@attrs.define(slots=True)
@_run_aliases("run", "target_epochs", "completed_epochs", "epoch", "stop", "resume", "last_error_state")
class LoopState:
    """Counters and flags of a running loop (guards read these; actions update them).

    `run` is the run state (`RunState`: what the run committed); `epoch`, `completed_epochs`,
    `target_epochs`, `stop`, `resume` and `last_error_state` read and write its fields. The rest is the
    loop's scratch: the stage, the batch, the open window, requests. Epochs are 1-based (`epoch` 0 means
    none has started); `batch_idx` is 1-based within the task; `window_pos` counts the open window's
    micro-batches (0: no window is open). `resume_tasks`: the training tasks of the fit whose start honours
    a pending `resume=...` (a snapshot's position is checked against them), None otherwise. `epoch_undo`:
    how to undo the epoch-end work done before `commit_epoch`, in order (rollback; empty outside an
    epoch's end). `update_open`: an update began (`unscale_gradients`) and its `zero_grad` has not run yet, so the
    gradients it leaves are not kept yet (`kept_grads`). The update clock (the running fit's): `target_updates`
    (`Trainer(max_updates=...)`, a total of committed updates, or None), `val_every`
    (`fit(val_every_n_updates=...)`, or None), `val_at_start` and `val_at_end` (fit's: a point before the first
    update, a point at the budget that is no multiple of `val_every`), `val_point_open` (the validation stage runs
    at an update point inside a training task), `save_position` (while a validation point's save requests run: a
    function giving the point's mid-epoch position for the files they write, `checkpoint.save`'s default; else
    None). `own_gradients`: the open window's gradients come from the step's own `loss.backward()`
    (`keep_own_gradients`). `closure`: the closure a step handed `self.optimize(closure=...)` while its update runs,
    and `closure_loss` what the optimizer's step returned.
    """

    run: RunState = attrs.Factory(RunState)
    stage: str | None = None
    batch_idx: int = 0
    window_size: int = 1
    window_pos: int = 0
    window_first_size: int = 0
    window_samples: int = 0
    window_boundary: bool = False
    window_updated: bool = False
    window_committed: bool = False
    update_open: bool = False
    own_gradients: bool = False
    closure: object = None
    closure_loss: object = None
    val_due: bool = False
    save_requests: list = attrs.Factory(list)
    update_indices: tuple = ()
    finite: dict = attrs.Factory(dict)
    opt_index: int = 0
    meters: object = None
    resume_pending: bool = False
    resume_tasks: list | None = None
    epoch_undo: list = attrs.Factory(list)
    snapshot_due: bool = False
    stop_signal: str | None = None
    target_updates: int | None = None
    val_every: int | None = None
    val_at_start: bool = False
    val_at_end: bool = True
    val_point_open: bool = False
    save_position: object = None


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
        facade: the object handed to hooks and step methods as `trainer` (and to `resumer`); its step
            methods are found by `stage_tasks.resolve_step`.
        resumer: the checkpoint layer's resume policy, `resumer(facade)`: loads what `Trainer(resume=...)`
            asks for (the `resume_checkpoint` action, the engine's resume step), writing the run state and
            clearing `loop.resume_pending`; None where nothing can be resumed.
        target_key: `Trainer(targets='<key>')`: the field of dict batches that holds the targets, or None.
        pick_targets: `Trainer(targets=callable)`: `(batch_x, model_out) -> (preds, targets)` for the
            metrics, or None (the metrics get the model output and the batch's label).
        averagers: the weight averages' `average_weights(trainer, at)` methods (`EMACallback`,
            `SWACallback`), called by the `average_update` (`at='update'`) and `average_epoch`
            (`at='epoch'`) actions.
        stateful: the callbacks that keep a state (`state_dict()`, `load_state_dict()`) by name
            (`deepepochs.engine.callback_states`), kept at commit points and loaded back by a rollback.
        on_cuda: whether `device` is a CUDA device, whose generator is kept besides the CPU's
            (`engine.generators`); derived once from `device`, whose `type` builds a new string per read.
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
    resumer: Callable[[Facade], None] | None = None
    target_key: str | None = None
    pick_targets: Callable | None = None
    averagers: list[Callable[[object, str], None]] = attrs.Factory(list)
    stateful: dict = attrs.Factory(dict)
    on_cuda: bool = attrs.field(init=False)

    @on_cuda.default
    def _on_cuda(self) -> bool:
        return self.device.type == "cuda"


@attrs.define(slots=True, eq=False)
@_run_aliases("loop.run", "train_meters", "history", "last_metrics", "random_state", "random_restore_due",
              "task_random_state", "random_replay", "data_state")
class Context:
    """One trainer's run-time context: its parts, its loop state, and what the current batch holds.

    The run state (`run`, owned by `loop.run`) is read and written under its own names here too:
    `train_meters`, `history`, `last_metrics`, `random_state`, `random_restore_due`, `task_random_state`,
    `random_replay`, `data_state` (see `RunState`). Everything else is scratch of the current fit, task or
    batch.

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
        pending_nonfinite: a device-side inf/NaN flag checked at the task's end (accelerators).
        seeds: gradients that backward starts from, per micro-batch share (`steps.backward`).
        signals: the SIGINT guard that holds a Ctrl-C during an update (`signals.InterruptGuard`).
        task_index: the index of the running task within its stage.
        batch_counted: the current batch's loss and patches are in the meters already.
        step_patches: the default step's metric patches, made before its update (committed with it).
        epoch_undo: `loop.epoch_undo`.
        first_batch: the running task's first batch is yet to be checked (`steps.first_batch_checks`).
        monitor_check: the fit's (train tasks, val tasks) until the first training batch has checked the
            checkpoint monitors' names; None after.
        snapshots: the running fit's snapshot writer (a `SnapshotCallback`), or None: then no commit point
            fires the `snapshot` trigger (`deepepochs.engine.snapshot_trigger`).
        snapshot_path: the snapshot the last `save_snapshot` wrote (None on ranks other than 0).
        data_source: the running training task's stateful DataLoader (torchdata's `StatefulDataLoader`),
            whose position `remember_position` keeps; None for other data.
        buffer_copies: which model buffers the running fit's commit points copy where
            (`buffers.BufferCopies`), or None.
        carried: `trainer.carried`, what steps carry from batch to batch (live; the run state keeps its
            copy at commit points, `deepepochs.engine.carried`).
        host_random_state: Python's and NumPy's generator states when the open window's first batch was
            fetched, kept only where a signal can drop the window (`generators.keep_host_state`); None otherwise.
        host_state_due: the next training fetch keeps them (set at each commit point).
        told: the one-time notes this trainer has given (a key per note: persistent DataLoader workers
            started anew after an interrupt, `loader_starts`); each is said once per trainer.
        backward_loss: (1-based batch, loss) of the first loss a custom step backpropagated with
            `self.backward(loss)` in that batch: the loss a rollback counts for the batch when the step's
            update was applied but the step raised before returning its loss (`discard_window`).
        update_clock: with the update clock on (`max_updates` or `val_every_n_updates`), what a training
            task calls at its start and after each committed window (`deepepochs.engine.update_clock`):
            True when the task stops there; None otherwise (nothing is called).
        profiler: the running fit's `profiling.Timeline` when a profiler is attached, else None (the batch
            loops time their DataLoader's fetches through it; nothing else on the hot path asks).
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
    pending_nonfinite: torch.Tensor | None = None
    seeds: dict = attrs.Factory(dict)
    signals: object = None
    task_index: int = 0
    batch_counted: bool = False
    step_patches: dict | None = None
    first_batch: bool = False
    monitor_check: tuple | None = None
    snapshots: object = None
    snapshot_path: object = None
    data_source: object = None
    buffer_copies: object = None
    carried: dict = attrs.Factory(dict)
    update_clock: Callable[[], bool] | None = None
    host_random_state: tuple | None = None
    host_state_due: bool = False
    profiler: object = None
    told: set = attrs.Factory(set)
    backward_loss: tuple | None = None

    @property
    def run(self) -> RunState:
        """The run state (`loop.run`): what the run committed, with one capture and one restore."""
        return self.loop.run

    @property
    def epoch_undo(self) -> list:
        """`loop.epoch_undo`."""
        return self.loop.epoch_undo
