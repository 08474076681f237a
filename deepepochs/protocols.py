"""The duck types the layers meet through: what the engine and the checkpoint code may use of a trainer's
parts (`engine.context.Parts`) and of the callbacks they find by shape (monitors, clippers, the snapshot
writer).

This module sits below the engine, the checkpoint code and the policies, and imports nothing of deepepochs,
so any of them can name these types without an upward import. Each protocol lists what is used, not all
that the concrete class offers: the concrete classes (named in each docstring) are the one implementation,
and `tests/test_protocols.py` checks that each of them has every member its protocol names, with
parameters that accept the same calls, and that the engine reads nothing of a part beyond its protocol.

The checks are structural (`typing.Protocol`): nothing here is a base class to inherit from, and a part of
your own (e.g. a console that logs elsewhere) only needs the members listed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only: torch is not needed to import this module
    import torch

__all__ = [
    "Averager",
    "Clipper",
    "ConsoleLike",
    "DistPolicy",
    "Facade",
    "HookTableLike",
    "Monitor",
    "OptimizerSet",
    "PrecisionPolicy",
    "SnapshotWriter",
    "monitors_in",
    "monitors_undo",
]


class Monitor(Protocol):
    """A checkpoint monitor (`deepepochs.callbacks.CheckCallback`): a callback whose state every checkpoint
    carries and whose file `resume=True` looks for. Recognised by a `monitor_id` string (`monitors_in`)."""

    monitor_id: str
    ckpt_dir: Any  # a path-like folder; the run's files go to <ckpt_dir>/<running_id>/

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def monitors_in(callbacks: Iterable) -> list:
    """The checkpoint monitors (see `Monitor`) among `callbacks`, in declaration order.

    Found by shape, not by class, so that the engine's first-batch checks and epoch rollback, and the
    checkpoint code, find the same monitors without importing the callbacks above them."""
    return [cb for cb in callbacks if isinstance(getattr(cb, "monitor_id", None), str)]


def monitors_undo(callbacks: Iterable) -> Callable[[], None]:
    """An undo that puts the checkpoint monitors among `callbacks` back to their states as of now (an
    epoch's end or a validation point that a rollback discards: their checks did not happen)."""
    states = [(monitor, monitor.state_dict()) for monitor in monitors_in(callbacks)]

    def undo() -> None:
        for monitor, state in states:
            monitor.load_state_dict(state)

    return undo


class Clipper(Protocol):
    """A gradient clipper (`deepepochs.callbacks.GradClipCallback`): any callback with a `clip` method is
    registered as one; the `clip_gradients` action calls it after unscaling, before the optimizers step."""

    def clip(self, trainer: Any, indices: Sequence[int], finite: Mapping[int, bool]) -> None: ...


class Averager(Protocol):
    """A weight average (`deepepochs.callbacks.EMACallback`, `SWACallback`): any callback with an
    `average_weights` method is registered as one; the `average_update` action calls it with
    `at='update'` for each applied update, the `average_epoch` action with `at='epoch'` at an epoch's end."""

    def average_weights(self, trainer: Any, at: str) -> None: ...


class SnapshotWriter(Protocol):
    """The snapshot writer (`deepepochs.callbacks.SnapshotCallback`), found by its `poll_snapshot` method
    (`deepepochs.engine.snapshot_trigger.find_writer`): decides at each commit point whether a snapshot is due and
    whether a stop signal arrived, and writes the snapshot the `save_snapshot` action asks for."""

    signals: Sequence[str]

    @property
    def must_agree(self) -> bool: ...

    @property
    def pending_signal(self) -> str | None: ...

    @property
    def listening(self) -> bool: ...

    def signal_after_error(self, timeout: float = 1.0) -> str | None: ...

    def poll_snapshot(self, epoch_end: bool) -> tuple[bool, str | None]: ...

    def late_signal(self) -> str | None: ...

    def write_snapshot(self, trainer: Any, position: Any) -> Any: ...

    def exit_code(self, signal_name: str) -> int: ...


class DistPolicy(Protocol):
    """How processes train together (`deepepochs.parallel.single.SingleProcess`, `DDPPolicy`,
    `deepepochs.parallel.fsdp.FSDPPolicy`): the same methods whatever the world size, so the engine has no
    `if distributed` branches. Also `trainer.dist` for callbacks."""

    rank: int
    local_rank: int
    world_size: int
    is_main: bool
    device: torch.device
    shards_model: bool
    order_seed: int | None
    data_order: str

    def set_epoch(self, epoch: int) -> None: ...

    def loader_generator_states(self) -> list: ...

    def continue_loader_generators(self, states: list) -> None: ...

    def stream_states(self) -> list: ...

    def continue_streams(self, states: list) -> None: ...

    def shard_model(self, model: torch.nn.Module, optimizers: Any) -> None: ...

    def wrap_model(self, model: torch.nn.Module, ddp_kwargs: Mapping | None = None) -> torch.nn.Module: ...

    def prepare_dataloader(self, dataloader: Any, stage: str) -> Any: ...

    def set_grad_sync(self, enabled: bool) -> None: ...

    def drop_unsynced_gradients(self) -> None: ...

    def local_shards(self, tensors: list) -> list: ...

    def pad_eval(self, data: Any) -> Any: ...

    def sync_eval_buffers(self, model: torch.nn.Module) -> None: ...

    def global_sum(self, value: int) -> int: ...

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def sync_patch(self, patch: Any) -> Any: ...

    def sync_patches(self, patches: dict) -> dict: ...

    def broadcast_model(self, model: torch.nn.Module) -> None: ...

    def broadcast_object(self, obj: Any) -> Any: ...

    def all_gather_object(self, obj: Any) -> list: ...

    def check_batch_counts(self, count: int, stage: str) -> None: ...

    def main_process_first(self) -> Any: ...

    def publish_places(self, read_place: Any) -> None: ...

    def agree_paths(self, place: dict) -> None: ...

    def timed_out(self, exc: BaseException, where: str, place: dict | None = None) -> Exception | None: ...

    def load_model_state_dict(self, model: torch.nn.Module, state: Mapping) -> None: ...

    def load_optimizer_state_dict(self, model: torch.nn.Module, opt: torch.optim.Optimizer,
                                  state: Mapping) -> None: ...

    def close(self) -> None: ...


class PrecisionPolicy(Protocol):
    """What the precision means on the device (`deepepochs.training.precision.Precision`): autocast contexts, the
    fp16 GradScaler (None otherwise) and the loss scaling around an update. Also `trainer.precision`."""

    name: str
    dtype: torch.dtype | None
    scaler: Any  # torch.amp.GradScaler or None
    autocast: Callable[[], Any]
    no_autocast: Callable[[], Any]

    def scale(self, loss: torch.Tensor, token: Any = None) -> torch.Tensor: ...

    def unscale(self, optimizers: Any) -> list[bool] | None: ...

    def finish(self, optimizers: Any, n_total: int, token: Any = None) -> None: ...

    def discard_step_state(self) -> None: ...

    def state_dict(self) -> dict | None: ...

    def load_state_dict(self, state: dict | None) -> None: ...


class ConsoleLike(Protocol):
    """Where the run prints (`deepepochs.reporting.console.Console`, rank 0 only): the header, task progress, epoch
    and test lines, notes. Also `trainer.console`."""

    enabled: bool
    log_batch: bool
    log_tqdm: bool
    show_info: bool

    def info(self, text: str) -> None: ...

    def decision(self, text: str) -> None: ...

    def note_once(self, key: str, text: str) -> None: ...

    def start_task(self, stage: str, epoch: int, epochs: int | None, total: int | None,
                   updates: tuple[int, int | None] | None = None) -> None: ...

    def batch(self, batch_idx: int, metrics: Callable[[], Mapping[str, float]], skipped: int = 0,
              updates: int = 0) -> None: ...

    def end_task(self) -> None: ...

    def epoch(self, epoch: int, epochs: int | None, stages: Mapping[str, Mapping[str, float]],
              skipped: int = 0) -> None: ...

    def update_point(self, updates: int, target: int | None, metrics: Mapping[str, float]) -> None: ...

    def test(self, metrics: Mapping[str, float], updates: int | None = None) -> None: ...

    def close(self) -> None: ...


class HookTableLike(Protocol):
    """The attached callbacks and, per hook name, the bound methods to call in dispatch order
    (`deepepochs.callbacks.base.HookTable`)."""

    callbacks: list
    by_event: dict[str, tuple]

    def extend(self, callbacks: Iterable) -> None: ...

    def remove(self, callbacks: Iterable) -> None: ...


class OptimizerSet(Protocol):
    """The trainer's optimizers in `optimize_index` order (`deepepochs.training.optim.Optimizers`): their
    gradients, zeroing, and the schedulers stepped per update or per epoch. Also `trainer.opt`."""

    items: list
    all_indices: tuple[int, ...]
    sum_check: bool

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...

    def indices(self, optimize_index: Any) -> tuple[int, ...]: ...

    def grads(self, index: int) -> list: ...

    def zero_grad(self, indices: Sequence[int]) -> None: ...

    def drop_stale_grads(self) -> None: ...

    def step_scheduler(self, index: int) -> Any: ...

    def step_epoch(self, train_loss: float | None, val_loss: float | None) -> None: ...

    def epoch_scheduler_state(self) -> list: ...

    def load_epoch_scheduler_state(self, state: list) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict, load_optimizer: Any = None) -> None: ...


class Facade(Protocol):
    """The object hooks and step methods receive as `trainer` (the `Trainer`). Opaque to the engine: it only
    hands it to user code, and reads nothing of it, so no member is listed."""
