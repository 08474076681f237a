"""Writing checkpoints: a trainer's state as a `Checkpoint`, the rank-agreed save (one file, or a sharded
folder under FSDP), the atomic file write and the cleanup of what killed saves left, `consolidate`.

Files live at `<ckpt_dir>/<running_id>/<monitor file>.ckpt` and contain no absolute paths, so a run
folder (or a whole `ckpt_dir`) can be moved or renamed. A write goes to a hidden temporary file in the
same folder and is renamed over the target with `os.replace`, which is atomic on POSIX and Windows: a
crash mid-save leaves the previous checkpoint intact, and the leftover temporary file (it does not end
in `.ckpt`) is never picked by resume; the next save or resume in that folder removes it once its writer
no longer runs.

`consolidate` lives here rather than with the reading: it reads a sharded checkpoint and writes it as one
file, and the atomic write needs the reading (a folder is replaced only when it is a complete sharded
checkpoint), so reading never imports writing.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

import attrs
import torch

from deepepochs.checkpoint import names, shard_storage
from deepepochs.checkpoint.format import COMPILED_PREFIX, Checkpoint, monitors_of, plain_records
from deepepochs.checkpoint.read import _read_shards, _shard_folder, read_checkpoint
from deepepochs.engine import callback_states, carried, runstate
from deepepochs.errors import CheckpointError
from deepepochs.utils import rng_state

__all__ = [
    "carried_states",
    "consolidate",
    "generator_states",
    "remove",
    "remove_stale_temps",
    "retire",
    "save",
    "snapshot",
    "write_atomic",
]

_TEMP_SUFFIX = ".tmp"


def snapshot(trainer, position: Mapping | None = None) -> Checkpoint:
    """The trainer's current training state as a `Checkpoint` for one file (tensors are not copied);
    `position`: where inside the epoch it was taken (`deepepochs.engine.position.capture`), None at an
    epoch's end. Under FSDP, where every rank holds shards, `save` writes a sharded checkpoint instead."""
    if trainer.dist.shards_model:
        raise CheckpointError("under strategy='fsdp' every rank holds shards of the states, so there is no one-file"
                              " snapshot; call deepepochs.checkpoint.save(trainer, path) on every rank (a sharded"
                              " checkpoint folder) and consolidate(path, file) for one file")
    _warn_unsaved(trainer)
    return _header(trainer, position, trainer.raw_model.state_dict(), trainer.opt.state_dict(),
                   generator_states(trainer), carried_states(trainer, position))


def _warn_unsaved(trainer) -> None:
    """Name, once, each callback holding tensors, modules or optimizers that no file holds
    (`callback_states.warn_unsaved`)."""
    callback_states.warn_unsaved(trainer.callbacks, trainer.raw_model, [item.opt for item in trainer.opt.items])


def generator_states(trainer, gather: bool = True):
    """The `rng` a checkpoint holds: this process's generator states (Python's, NumPy's, torch's, and under
    'loaders' those of the training DataLoaders' own generators) and under 'streams' the states of the
    stateful datasets its training data streams from; under DDP `{'ranks': [...]}`, every rank's
    in rank order (a collective: every rank calls it), or with `gather=False` this rank's alone at its
    index (a local backup, never a file)."""
    dist = trainer.dist
    mine = {**rng_state(), "loaders": dist.loader_generator_states(), "streams": dist.stream_states()}
    return mine if dist.world_size == 1 else {"ranks": _per_rank(dist, mine, gather)}


def carried_states(trainer, position: Mapping | None) -> list:
    """The `carried` a checkpoint holds: every rank's `trainer.carried` as of the file's commit point
    (`deepepochs.engine.carried`), in rank order (under DDP a collective: every rank calls it)."""
    now = carried.at_commit_point(trainer.carried, trainer.loop.run, mid_epoch=position is not None)
    return _per_rank(trainer.dist, carried.stored(now), gather=True)


def _refuse_inside_epoch(loop, path: Path) -> None:
    """Raise `CheckpointError` when the run stands inside an epoch that has not ended (its training or its
    validation ran in part): a file without a position cannot say where (see `save`)."""
    point = loop.resume
    if point is None or point.epoch <= loop.completed_epochs:
        return
    where = (f"training task {point.task_index} of epoch {point.epoch}, {point.batches_done} batches committed"
             if point.task_index >= 0 else f"epoch {point.epoch}, after its training and before its end")
    raise CheckpointError(
        f"checkpoint.save({str(path)!r}) was called inside {where}: a file without a position there would say"
        f" epoch {loop.completed_epochs} ended, and a resume from it would train epoch {point.epoch} again on"
        " weights that already trained part of it; save at an epoch's end (on_after_epoch), ask for one with"
        " trainer.request_save(fn) (it runs at the epoch's end, or at a validation point with its position), or"
        " use SnapshotCallback, which records the position inside the epoch")


def _per_rank(dist, mine, gather: bool) -> list:
    """`mine` of every rank in rank order (one all-gather), or with `gather=False` at this rank's index only."""
    if dist.world_size == 1:
        return [mine]
    if gather:
        return dist.all_gather_object(mine)
    return [mine if rank == dist.rank else None for rank in range(dist.world_size)]


def _header(trainer, position: Mapping | None, model: Mapping, opts: Mapping, rng,
            carried_now: list | None) -> Checkpoint:
    """A `Checkpoint` of the trainer's state with the given model, optimizer, generator and carried states
    (`carried_states`; None: the file leaves `trainer.carried` as it is)."""
    return Checkpoint(
        format_version=1 if position is None else 2,
        position=position,
        running_id=str(trainer.running_id),
        epoch=trainer.loop.completed_epochs,
        world_size=trainer.world_size,
        model=model,
        optimizers=opts["optimizers"],
        schedulers=opts["schedulers"],
        scaler=trainer.precision.state_dict(),
        monitors={m.monitor_id: m.state_dict() for m in monitors_of(trainer)},
        rng=rng,
        order_seed=trainer.dist.order_seed,
        param_names=names.param_names(trainer),
        history=plain_records(_run_records(trainer, position)),
        updates=trainer.loop.run.updates,
        averages=trainer.loop.run.averages or None,
        carried=carried_now,
        callbacks=callback_states.stored(callback_states.now(callback_states.stateful(trainer.callbacks))),
    )


def _run_records(trainer, position: Mapping | None) -> Mapping:
    """The records of the epochs the file counts as completed. An epoch-end save runs before its epoch
    commits (`save_checkpoints` precedes `commit_epoch`; `epoch_undo` is pending then), so that epoch's
    metrics are added to the history here; a validation point's save likewise runs before
    `commit_val_point`, so the point's row is added (and nothing else: the epoch goes on, its position in
    the file). A snapshot taken while the point still validates holds the records of the point's update
    (`runstate.val_point_validated`)."""
    loop = trainer.loop
    run = loop.run
    point_validated = runstate.val_point_validated(loop, run.last_metrics)
    if not point_validated and (position is not None or not loop.epoch_undo):
        return run.history
    records = {stage: {name: list(values) for name, values in metrics.items()}
               for stage, metrics in run.history.items()}
    if point_validated:
        runstate.record_val_point(records.setdefault("val", {}), run.updates, run.last_metrics.get("val", {}))
        return records
    for stage, metrics in run.last_metrics.items():
        if stage in records:
            for name, value in metrics.items():
                records[stage].setdefault(name, []).append(value)
    return records


def save(trainer, path, position: Mapping | None = None, writer=None, after=None, spare=None) -> Path | None:
    """Save the trainer's state to `path`, every rank calling it; returns `path` on rank 0, else None.

    One file written atomically by rank 0 (`snapshot`, `write_atomic`), or under FSDP a sharded checkpoint
    folder of that name written by every rank (`shard_storage`). `path` is replaced whichever form it had
    before. `position` as for `snapshot`; None: where the loop stands, which is a position at a validation
    point of the update clock (a save `trainer.request_save` asked for there: `LoopState.save_position`),
    so that a resume from the file continues inside the epoch exactly. Anywhere else inside an epoch (a hook
    of a training task or of the epoch's validation, or after a fault interrupted the epoch) a file without a
    position would say the previous epoch ended while its weights trained part of this one: that is refused
    (`CheckpointError`, nothing written). When the save fails, every rank raises (see `_agreed`).


    With `writer` (a `background.BackgroundWriter`, one file only), rank 0 hands the state to the writer, which
    waits for the write in flight, if any, makes its host copy of the state, writes that beside training and
    then calls `after(path)`; the call returns once the copy is made, and the writer keeps a failure for its
    owner to report. `spare`: a file `retire` took out of the folder, which the synchronous one-file write
    overwrites (`write_atomic`); removed otherwise.
    """
    path, dist = Path(path), trainer.dist
    if position is None and trainer.loop.save_position is not None:
        position = trainer.loop.save_position()
    if position is None:
        _refuse_inside_epoch(trainer.loop, path)
    if not dist.shards_model:
        ckpt = snapshot(trainer, position)
        if writer is None:
            _agreed(dist, path, lambda: write_atomic(ckpt.to_dict(), path, spare=spare))
        else:
            _agreed(dist, path, lambda: writer.submit(ckpt.to_dict(), path, after))
        return path if dist.is_main else None
    _take_spare(spare, None)
    if writer is not None:
        raise CheckpointError("a background write takes one checkpoint file; under strategy='fsdp' every rank"
                              " writes its shards: save without a writer")
    _warn_unsaved(trainer)
    flat, params = shard_storage.flat_tensors(trainer.raw_model, [item.opt for item in trainer.opt.items])
    averages, counters = shard_storage.flat_averages(trainer.loop.run.averages)
    flat.update(averages)  # each rank writes its shards of the averages, as of the parameters
    # every rank's generator and carried states (collectives), before rank 0 alone commits
    rng, carried_now = generator_states(trainer), carried_states(trainer, position)
    folder = _agreed(dist, path, lambda: _prepare_folder(path))
    try:
        shard_storage.write(flat, path / folder)  # DCP raises on every rank when one fails
    except Exception as e:
        raise CheckpointError(f"writing the shards of checkpoint {path} failed"
                              f" ({e if isinstance(e, CheckpointError) else repr(e)}); the previous"
                              " checkpoint, if any, is unchanged") from e

    def commit() -> None:
        opts = trainer.opt.state_dict()
        opts["optimizers"] = [_without_tensors(state) for state in opts["optimizers"]]
        ckpt = _header(trainer, position, {}, opts, rng, carried_now)
        ckpt.format_version, ckpt.shards, ckpt.averages = 3, {"folder": folder, "params": params}, counters
        write_atomic(ckpt.to_dict(), path / shard_storage.SIDE_CAR)
        shard_storage.remove_unnamed(path, folder)

    _agreed(dist, path, commit)
    return path if dist.is_main else None


def _agreed(dist, path: Path, work):
    """`work()` run by rank 0, its result given to every rank. When it fails, every rank raises: rank 0
    its own error, the others a `CheckpointError` saying so (one broadcast), so that no rank trains on
    alone while rank 0 has stopped (it would wait at its next collective until `dist_timeout`)."""
    result = failure = None
    if dist.is_main:
        try:
            result = work()
        except Exception as e:
            failure = e
    if dist.world_size > 1:
        ok, result = dist.broadcast_object((True, result) if failure is None
                                           else (False, f"{type(failure).__name__}: {failure}"))
        if not ok and failure is None:
            raise CheckpointError(f"rank 0 could not save checkpoint {path} ({result}); every rank stops")
    if failure is not None:
        raise failure
    return result


def _prepare_folder(path: Path) -> str:
    """Make `path` a folder for a sharded save (replacing a single file of that name: a run that went on
    under FSDP), remove what a save killed before its commit left there, and name the new shard folder."""
    if path.is_file():
        path.unlink()
    elif path.is_dir():
        _check_replaceable(path, committed=False)
    path.mkdir(parents=True, exist_ok=True)
    shard_storage.remove_unnamed(path, _shard_folder(path))
    return shard_storage.new_folder_name()


def _check_replaceable(path: Path, committed: bool) -> None:
    """`CheckpointError` unless a save may replace (or, `committed=False`, write into) the existing folder
    `path`: it holds nothing but what sharded saves write there, and with `committed` it is a complete
    sharded checkpoint (a `checkpoint.pt` naming a shard folder that is there). A user's folder is never
    removed or written into because a checkpoint has its name."""
    foreign = shard_storage.foreign_entries(path)
    if foreign:
        shown = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
        raise CheckpointError(f"cannot save checkpoint {path}: that folder exists and holds what no deepepochs"
                              f" save wrote there ({shown}); it was left as it is. Move those files, or save"
                              " to another path")
    name = _shard_folder(path) if committed else None
    try:
        complete = name is not None and shard_storage.check_name(name, path).is_dir()
    except CheckpointError:
        complete = False
    if committed and not complete:
        raise CheckpointError(f"cannot save checkpoint {path}: that folder exists but is not a complete sharded"
                              f" checkpoint (no readable {shard_storage.SIDE_CAR} naming a shard folder in it); it was"
                              " left as it is. Remove it yourself if it is no longer needed, or save to another path")


def _without_tensors(state: Mapping) -> dict:
    """An optimizer's `state_dict()` without its per-parameter tensors (they go into the shards)."""
    return {**state, "state": {index: {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
                               for index, values in state.get("state", {}).items()}}


def remove(path) -> None:
    """Delete the checkpoint at `path`, a file or a sharded checkpoint folder."""
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


# ---- the atomic file write ----
def _fsync_dir(folder: Path) -> None:
    """Make the rename durable (POSIX); harmless to skip where directories cannot be opened."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.(?P<pid>\d+)-[0-9a-f]{8}" + re.escape(_TEMP_SUFFIX) + "$")


def _alive(pid: int) -> bool:
    """Whether a process with this id runs on this machine (a writer that may still finish its file)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists but is not ours, or cannot be asked: leave its file alone
    return True


def remove_stale_temps(folder) -> list[Path]:
    """Remove the temporary files `write_atomic` left in `folder` when its process was killed mid-save
    (their writer no longer runs); returns what was removed. Other files are never touched."""
    folder, removed = Path(folder), []
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        match = _TEMP_NAME.match(entry.name)
        if match and entry.is_file() and not _alive(int(match["pid"])):
            try:
                entry.unlink()
                removed.append(entry)
            except OSError:
                pass
    return removed


def _temp_name(path: Path) -> Path:
    """A hidden name, unique to this process and call and not ending in SUFFIX, beside `path`: resume never
    mistakes it for a checkpoint, and `remove_stale_temps` removes it once this process no longer runs."""
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}{_TEMP_SUFFIX}")


def retire(path) -> Path:
    """Take the checkpoint file `path` out of its folder for reuse (rotation pruning it): renamed, atomically, to
    a temporary name of this process (`_temp_name`); returns that name, a spare for `write_atomic`."""
    path = Path(path)
    spare = _temp_name(path)
    os.replace(path, spare)
    return spare


def _take_spare(spare, temp: Path | None) -> bool:
    """Rename the spare file `spare` (None: none) to `temp` when it lies in `temp`'s folder; otherwise remove it.
    Whether `temp` is now that file."""
    if spare is None:
        return False
    spare = Path(spare)
    try:
        if temp is not None and spare.parent == temp.parent:
            os.replace(spare, temp)
            return True
        spare.unlink(missing_ok=True)
    except OSError:  # gone already, or not ours to move: the write makes a new file
        pass
    return False


def write_atomic(data: Mapping, path, spare=None) -> Path:
    """`torch.save(data)` to `path` atomically: a temporary file in the same folder, then `os.replace`.

    The temporary file must be in the same folder: `os.replace` is atomic only within one file system.
    A failed write removes it and raises `CheckpointError`; the previous file at `path` is untouched.
    `spare`: a file of the same folder that `retire` took out of it, or None. The write then goes over it in
    place (renamed to the temporary name, overwritten, cut to the new length): its disk blocks and cached pages
    are reused, where a new file would have the file system allocate (and, at the old file's removal, discard)
    as many again, which for a snapshot of a gigabyte costs more than writing it.
    """
    path = Path(path)
    temp = _temp_name(path)
    if path.is_dir():  # only a complete sharded checkpoint holding nothing else is replaced by the file
        _check_replaceable(path, committed=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(path.parent)
        reused = _take_spare(spare, temp)
        with open(temp, "r+b" if reused else "wb") as f:
            torch.save(dict(data), f)
            f.truncate()  # a longer spare keeps nothing past the new file's end
            f.flush()
            os.fsync(f.fileno())  # the data must be on disk before the rename makes it the checkpoint
        if path.is_dir():  # a sharded checkpoint of that name (checked above): the file replaces it
            shutil.rmtree(path)
        os.replace(temp, path)
    except BaseException as e:
        try:
            temp.unlink(missing_ok=True)
        except OSError:
            pass
        if isinstance(e, Exception):
            raise CheckpointError(f"writing checkpoint {path} failed ({_write_failure(e)}); the previous file,"
                                  " if any, is unchanged") from e
        raise
    _fsync_dir(path.parent)
    return path


# What a full disk, a quota or a file size limit make a write fail with (torch reports such a failed
# write of its own as "[enforce fail at inline_container.cc] unexpected pos ...", the OSError in its context).
_SPACE_ERRORS = {errno.ENOSPC: "no space left on the device", errno.EFBIG: "the file is too large (a file size"
                 " limit of the file system or the process)", getattr(errno, "EDQUOT", -1): "the disk quota is"
                 " exceeded"}


def _write_failure(e: BaseException) -> str:
    """Why a write failed, in words: the space error somewhere in `e`'s chain, else `e` itself."""
    seen, cause = set(), e
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in _SPACE_ERRORS:
            return f"{_SPACE_ERRORS[cause.errno]} ({errno.errorcode.get(cause.errno)})"
        cause = cause.__cause__ or cause.__context__
    return repr(e)


def consolidate(source, target) -> Path:
    """Write the sharded checkpoint `source` (a folder written under FSDP) as one checkpoint file `target`,
    which any trainer loads, in one process too; returns `target`. The full states are assembled in this
    process's memory. `target` may be `source` itself: the file then replaces the folder.

    The command line does the same: `python -m deepepochs consolidate SOURCE TARGET`.
    """
    source = Path(source)
    ckpt = read_checkpoint(source)
    if ckpt.shards is None:
        raise CheckpointError(f"consolidate: {source} is a single checkpoint file already (only a sharded"
                              " checkpoint folder, written under strategy='fsdp', needs consolidating)")
    full = _read_shards(ckpt, source)
    model = full.model
    if model and all(k.startswith(COMPILED_PREFIX) for k in model):  # written from torch.compile's wrapper
        model = {k[len(COMPILED_PREFIX):]: v for k, v in model.items()}
    full = attrs.evolve(full, format_version=1 if full.position is None else 2, shards=None, model=model)
    return write_atomic(full.to_dict(), target)
