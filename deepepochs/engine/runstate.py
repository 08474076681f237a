"""The run state: what a run has committed (epoch counters, records, the epoch's training meters, random
state, data position), in one typed record with one `capture` and one `restore`.

Rollback, the learning-rate finder, checkpoint loading and snapshots all go through this record, so a
field added here is carried by every one of them without touching them:

- rollback: the driver captures the record when an epoch's end begins and restores it when that end does
  not commit (`Driver._count_epoch`); inside an epoch the record holds only what commit points wrote
  (`commit_update` moves `resume`, `random_state`, `data_state`), so a fault leaves it as it was;
- `find_lr` captures it before the sweep and restores it after (`deepepochs.training.lr_sweep.run_sweep`);
- `checkpoint.load_into` captures it before loading and restores it when loading fails (all or nothing);
- a mid-epoch snapshot stores every field its own format does not already hold (`snapshot=GENERIC`,
  the default of a new field) per rank, and a resume puts them back (`deepepochs.engine.position`).

Per-batch scratch (the open window's counters, the step's loss, backward seeds, ...) is not run state:
it lives in `LoopState` and `Context` and is reset by each window, task or rollback.

Each field says, in its metadata, how `capture` copies it (`copy`: `DEEP` by default; `SHARED` for a
value a run replaces but never changes in place, so the captured reference stays valid) and how a
snapshot carries it (`snapshot`: `GENERIC`, or the part of the file that holds it, or why it is not
carried). `restore` writes every field back; a field marked `keep_identity` (a dict the user may hold,
such as `trainer.history`) is refilled in place, and one marked `in_place` (tensors a module owns, such as
a weight average's) has its tensors copied into the ones it holds (`write_in_place`).
"""

from __future__ import annotations

import copy as _copy
import math

import attrs

from deepepochs.config import VAL_POINT_KEY  # defined where the trackers (`reporting`) can read it too

__all__ = ["DEEP", "GENERIC", "SHARED", "VAL_POINT_KEY", "ResumePoint", "RunState", "StopRequest", "capture",
           "generic_fields", "record_row", "record_val_point", "restore", "val_point_validated",
           "write_in_place"]

#: `copy` metadata: `capture` deep-copies the value (the default: safe for any new field).
DEEP = "deep"
#: `copy` metadata: the run replaces the value whole and never mutates it, so `capture` keeps a reference.
SHARED = "shared"
#: `snapshot` metadata: a mid-epoch snapshot stores the value as it is (tensors, numbers, strings, lists,
#: dicts, tuples and attrs records of those), per rank.
GENERIC = "generic"


def _field(default=attrs.NOTHING, *, factory=None, copy: str = DEEP, snapshot: str = GENERIC,
           keep_identity: bool = False, in_place: bool = False):
    """An attrs field of the run state with its capture/snapshot policy in the metadata."""
    meta = {"copy": copy, "snapshot": snapshot, "keep_identity": keep_identity, "in_place": in_place}
    if factory is not None:
        return attrs.field(factory=factory, metadata=meta)
    return attrs.field(default=default, metadata=meta)


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
        trained: once the training stage is done (`task_index` -1), its last commit point as (the last
            task's index, its committed batches, its DataLoader's batch size or None): where a stop during
            the epoch's validation goes back to (`position.capture`).
    """

    epoch: int
    task_index: int
    batches_done: int
    samples: int | None = None
    trained: tuple | None = None


def _empty_history() -> dict:
    """A run's records before its first epoch: no metric yet for either stage."""
    return {"train": {}, "val": {}}


@attrs.define(slots=True, eq=False)
class RunState:
    """What a run has committed, owned here and nowhere else (see the module docstring).

    `trainer.loop` shows the counters (`epoch`, `completed_epochs`, `target_epochs`, `stop`, `resume`,
    `last_error_state`) and the engine's `Context` the rest under the same names; both read and write
    this record.

    Attributes:
        running_id: the run's name, the folder of its checkpoints and logs (a resume may change it).
        running_id_given: the name was given to the Trainer (then `resume=True` means this run only).
        target_epochs: the epoch target of the running (or last) fit, a total.
        completed_epochs: epochs committed (1-based count; 0: none).
        epoch: the 1-based epoch in progress (or the last one); 0 before the first.
        stop: a request to end the fit after the epoch (early stopping), or None.
        resume: the last commit point inside an epoch (the data position), or None at an epoch's end.
        last_error_state: the machine state the last fault was raised in (diagnostics), or None.
        history: per stage, per metric, the values of the epochs the run committed (those a resume
            loaded included); `trainer.history` is this dict, `fit()` returns a copy.
        last_metrics: the current epoch's metrics per stage, read by epoch-wise schedulers.
        train_meters: the epoch's training meters per task (committed work a resumed fit continues).
        random_state: torch's generator states at the last commit point of the running fit.
        random_restore_due: a fit failed; the next fit starts from `random_state` (a refit).
        task_random_state: the generator states just before the running training task made its data
            iterator (which draws DataLoader worker seeds).
        random_replay: for a refit resuming a task mid-way, (its `task_random_state`, `random_state`):
            the iterator is made from the first, the batches continue from the second.
        data_state: `(epoch, task index, batches done, state_dict())` of a stateful training DataLoader
            at the last complete commit point: a refit or a resumed snapshot continues it with
            `load_state_dict` instead of skipping batches.
        data_generators: `(epoch, task index, states)`: the states of a stateful training DataLoader's
            generators (`deepepochs.data.sampling.user_generators`) at the last commit point; a refit or a
            resumed snapshot puts them back once it has made the epoch's iterator (torchdata's
            `StatefulDataLoader` draws from them again then), so the epochs after it draw what the
            uninterrupted run drew.
        data_ended: `(epoch, task index, batches done)` of the last commit point when the task's stateful data
            had already said it has no more batches (read ahead to find the task's last one), else None: a
            refit or a resumed snapshot there loads its state but runs no more of the task's batches.
        order_draws: what the running (or last) training task's DataLoader drew its epoch's order from,
            in the loader's own order (`deepepochs.data.sampling.OrderDraws`, one process,
            `data_order='loader'`), filled in place as it draws: a refit or a resumed snapshot of that epoch
            draws the same order; None otherwise.
        buffers: the model's buffers (persistent or not, by name) at the last commit point of the running
            fit, which a rollback writes back into the model (`deepepochs.engine.buffers`); None outside a
            fit.
        grads: the gradients the optimizers' parameters held at the last commit point (those of optimizers
            that did not step, by `"<optimizer>.<group>.<position>"`), which a rollback writes back and a
            fit starts from (`deepepochs.engine.kept_grads`); None when they held none.
        carried: what steps carry from batch to batch (`trainer.carried`: an RNN's hidden state, a queue)
            as the last commit point of the running fit saw it, which a rollback writes back
            (`deepepochs.engine.carried`); None outside a fit. Every checkpoint file holds it (`carried`).
        callbacks: the states of the callbacks that keep one (`state_dict()`, `load_state_dict()`), by name,
            as the last commit point of the running fit saw them, which a rollback loads back
            (`deepepochs.engine.callback_states`); None outside a fit. Every checkpoint file holds them
            (`callbacks`).
        updates: the update windows the run committed (`commit_update`: applied, or skipped for inf/NaN),
            resumed runs included: the update clock (`max_updates`, `val_every_n_updates`) and the snapshots'
            count (`snapshot-u<updates>`).
        loader_starts: per stage and task of the running fit (`"train/0"`, `"val/0"`), where its DataLoader
            with persistent workers first made an iterator and the base seed it drew, as (1-based epoch,
            updates, seed): a refit or a resumed snapshot that makes the iterator anew where the uninterrupted
            run reused it draws no base seed (`deepepochs.engine.loader_starts`); None when there is none.
            Loading an epoch-end checkpoint sets what it implies (`"val/*"`: every validation task).
        averages: the weight averages (`EMACallback`, `SWACallback`) by their `average_id`: each a dict
            whose tensors are the averaged module's own (its `state_dict()`, moved only at commit points:
            the `average_update` and `average_epoch` actions) and the average's counters; None when none
            is attached. A restore copies the tensors back into the module (`write_in_place`).
    """

    running_id: str = _field("", copy=SHARED, snapshot="the checkpoint's running_id (resume names the run)")
    running_id_given: bool = _field(False, copy=SHARED, snapshot="the Trainer's argument, not the file's")
    target_epochs: int = _field(0, copy=SHARED, snapshot="the resumed fit's epochs=")
    completed_epochs: int = _field(0, copy=SHARED, snapshot="the checkpoint's epoch")
    epoch: int = _field(0, copy=SHARED, snapshot="the position's epoch")
    stop: StopRequest | None = _field(None, copy=SHARED, snapshot="every epoch starts without a stop request")
    resume: ResumePoint | None = _field(None, snapshot="the position (epoch, task_index, batches_done, samples)")
    last_error_state: str | None = _field(None, copy=SHARED, snapshot="diagnostics of this process")
    history: dict = _field(factory=_empty_history, snapshot="the checkpoint's history", keep_identity=True)
    last_metrics: dict = _field(factory=dict, snapshot="a mid-epoch snapshot has no epoch metrics yet")
    # The meters of a committed task are continued in place only by a fit resuming its epoch, which a
    # restore replaces; a capture keeps the list (copying it would copy every kept prediction).
    train_meters: list | None = _field(None, copy=SHARED, snapshot="the position's meters, per rank")
    random_state: tuple | None = _field(None, copy=SHARED, snapshot="the position's random states, per rank")
    random_restore_due: bool = _field(False, copy=SHARED, snapshot="a resume starts from the position's states")
    task_random_state: tuple | None = _field(None, copy=SHARED,
                                             snapshot="the position's random states, per rank")
    random_replay: tuple | None = _field(None, copy=SHARED, snapshot="derived from the position's random states")
    data_state: tuple | None = _field(None, copy=SHARED, snapshot="the position's data state, per rank")
    data_generators: tuple | None = _field(None, copy=SHARED)
    data_ended: tuple | None = _field(None, copy=SHARED)
    # Filled in place by the loader's sampler when it draws (deep-copied by a capture: two small tensors).
    order_draws: object | None = _field(None)
    # Copied in place at every commit point (`buffers.keep`), so a capture copies them (once per epoch end).
    buffers: dict | None = _field(None)
    # Replaced whole at commit points where some optimizer did not step (`kept_grads.keep`); None otherwise.
    grads: dict | None = _field(None, copy=SHARED)
    # Replaced whole, by a copy, at commit points (`carried.keep`); a capture copies it (small: hidden states).
    carried: dict | None = _field(None, snapshot="the checkpoint's carried, per rank (every file holds it)")
    # Replaced whole, by copies, at commit points (`callback_states.keep`); a capture copies them.
    callbacks: dict | None = _field(None, snapshot="the checkpoint's callbacks (every file holds them)")
    updates: int = _field(0, copy=SHARED, snapshot="the checkpoint's updates")
    # Replaced whole when a stage's persistent DataLoader first makes an iterator (a few numbers).
    loader_starts: dict | None = _field(None, copy=SHARED)
    # The averaged modules' own tensors: a capture copies them, a restore writes them back into the module.
    averages: dict | None = _field(None, snapshot="the checkpoint's averages", in_place=True)


def capture(run: RunState) -> RunState:
    """An independent copy of `run`: fields marked `SHARED` by reference, every other one deep-copied.
    `restore(run, capture(run))` later puts `run` back as it is now."""
    cls = type(run)
    values = {}
    for field in attrs.fields(cls):
        value = getattr(run, field.name)
        values[field.name] = value if field.metadata.get("copy", DEEP) == SHARED else _copy.deepcopy(value)
    return cls(**values)


def restore(run: RunState, saved: RunState) -> None:
    """Write every field of `saved` (from `capture`) back into `run`, deep-copied values copied again so
    that `saved` stays independent (it can be restored twice); a `keep_identity` dict is refilled in place
    (the user may hold it, e.g. `trainer.history`)."""
    for field in attrs.fields(type(run)):
        value = getattr(saved, field.name)
        if field.metadata.get("copy", DEEP) != SHARED:
            value = _copy.deepcopy(value)
        current = getattr(run, field.name)
        if field.metadata.get("in_place") and isinstance(current, dict) and isinstance(value, dict):
            write_in_place(current, value)
        elif field.metadata.get("keep_identity") and isinstance(current, dict) and isinstance(value, dict):
            current.clear()
            current.update(value)
        else:
            setattr(run, field.name, value)


def record_row(records: dict, metrics: dict, aligned: bool) -> None:
    """Append an epoch's `metrics` to a stage's `records`. `aligned` (training, which runs every epoch): a
    name this epoch lacks gets NaN and a name new this epoch NaN for the epochs before, so that every list
    has one entry per epoch (an epoch whose updates were all skipped reports NaN values)."""
    epochs = max((len(values) for values in records.values()), default=0)
    for name, value in metrics.items():
        records.setdefault(name, [math.nan] * epochs if aligned else []).append(value)
    if aligned:
        for name, values in records.items():
            if name not in metrics and len(values) == epochs:
                values.append(math.nan)


def val_point_validated(loop, last_metrics: dict) -> bool:
    """Whether a validation point of the update clock is open and its validation has run (its metrics wait in
    `last_metrics` for `commit_val_point`): a file written then (the point's own `save_checkpoints`) holds the
    point as validated. One written while the point still validates (a signal's snapshot of the last commit
    point, from `task_val`) holds the run as the point's update left it, and its resume validates the point."""
    return loop.val_point_open and "val" in last_metrics


def record_val_point(records: dict, updates: int, metrics: dict) -> None:
    """Append a validation point's row to the validation `records`: its update count under `VAL_POINT_KEY`,
    then its metrics."""
    record_row(records, {VAL_POINT_KEY: updates, **metrics}, aligned=False)


def write_in_place(current: dict, saved: dict) -> None:
    """Write `saved` into `current` keeping what `current` holds: a tensor of the same shape is copied into
    (the module owning it sees the value), a nested dict written the same way, anything else replaced by
    a copy. Keys `saved` lacks stay as they are."""
    for key, value in saved.items():
        now = current.get(key)
        if isinstance(now, dict) and isinstance(value, dict):
            write_in_place(now, value)
        elif (hasattr(now, "copy_") and getattr(now, "shape", None) is not None
              and getattr(value, "shape", None) == now.shape):
            now.copy_(value)  # state_dict() tensors are detached: no autograd record of the copy
        else:
            current[key] = _copy.deepcopy(value)


def generic_fields(run: RunState) -> list[str]:
    """The names of `run`'s fields a snapshot stores as they are (`snapshot=GENERIC`)."""
    return [f.name for f in attrs.fields(type(run)) if f.metadata.get("snapshot", GENERIC) == GENERIC]

