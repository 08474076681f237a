"""Checkpoint files (CKPT-2, CKPT-3, CKPT-5): what a snapshot holds, atomic writes, finding and loading.

A checkpoint is a plain `torch.save` dict; `torch.load(path, weights_only=True)` reads it without
deepepochs (only tensors, numbers, strings, lists, dicts and None are stored, unless a scheduler of
yours keeps other objects in its state). Keys:

==================  ==========================================================================
`format_version`    int: 1, 2 for a mid-epoch snapshot (it has a `position`), 3 for the `checkpoint.pt`
                    of a sharded checkpoint (it has `shards`); a version newer than this deepepochs
                    reads is refused with a clear error (so an older deepepochs never takes a
                    mid-epoch snapshot for an epoch's end, nor a sharded one for an empty model).
`running_id`        str, the run that wrote the file (informational: the folder name wins on resume,
                    so a renamed run folder keeps working).
`epoch`             int, completed epochs when saved; a resumed fit continues with `epoch + 1`.
`world_size`        int, processes that trained (informational: any world size loads the file).
`model`             the unwrapped model's `state_dict()`: no `module.` (DDP) or `_orig_mod.`
                    (`torch.compile`) prefixes, so single-process, DDP and compiled runs share it.
`optimizers`        list, `optimizer.state_dict()` per optimizer in `optimize_index` order.
`schedulers`        list, the scheduler's `state_dict()` or None, parallel to `optimizers`.
`scaler`            the fp16 `GradScaler.state_dict()`, or None without a scaler.
`monitors`          dict, monitor id (e.g. `'val-loss.best'`) -> that `CheckCallback`'s state
                    (best value and epoch, epochs without improvement, last saved epoch). Every
                    file holds every monitor's state, whichever monitor wrote it.
`rng`               dict, the Python, NumPy and PyTorch (CPU, CUDA) generator states of a one-process
                    run (`deepepochs.utils.rng_state`), None under DDP. Restored on load in a
                    one-process run, so a resumed run shuffles and drops out exactly as the
                    uninterrupted one would; under DDP each rank keeps its own generators.
`order_seed`        int or None, the seed of the training order (`deepepochs.sharding.DataOrder`):
                    with it, later epochs of a resumed run see the order the uninterrupted run saw,
                    in any process and at any world size. None in files of older versions.
`position`          dict or None: where inside epoch `epoch + 1` a mid-epoch snapshot was taken
                    (`SnapshotCallback`): the data position, the task meters, every rank's generator
                    states; see `deepepochs.engine.position`. None at an epoch's end.
`shards`            dict or None: in a sharded checkpoint's `checkpoint.pt`, `{'folder': shard folder
                    name, 'params': per optimizer, its parameters' names in index order}`; `model` is
                    then empty and `optimizers` hold no tensors (they are in the shards). None in a
                    single file.
`history`           dict or None: the run's records up to `epoch`, `{'train': {name: [per epoch]},
                    'val': {...}}` (floats), so a resumed `fit()` returns the whole run's records.
                    None in files of older versions (the resumed history then starts empty).
==================  ==========================================================================

Under `strategy='fsdp'` a checkpoint is a folder of that name instead of a file, written by every rank
without gathering anything (`deepepochs.sharded`: `checkpoint.pt` as above, plus the shards in
Distributed Checkpoint format). It loads at any world size, with any strategy and in one process, and
`consolidate(folder, file)` (or `python -m deepepochs consolidate FOLDER FILE`) turns it into the single
file described here.

Files live at `<ckpt_dir>/<running_id>/<monitor file>.ckpt` and contain no absolute paths, so a run
folder (or a whole `ckpt_dir`) can be moved or renamed. A write goes to a hidden temporary file in the
same folder and is renamed over the target with `os.replace`, which is atomic on POSIX and Windows: a
crash mid-save leaves the previous checkpoint intact, and the leftover temporary file (it does not end
in `.ckpt`) is never picked by resume; the next save or resume in that folder removes it once its writer
no longer runs. Files are read with `weights_only=True` only (SEC-1): a file holding other objects is
refused unless loaded with `trusted=True` (`read_checkpoint`).

A deepepochs 0.6 file (`{'model_state', 'opt_state', 'best_value', 'epoch'}`) is read too
(`Checkpoint.from_dict` converts it): its weights, its optimizers' and schedulers' states and its epoch
load; 0.6's `best_value` is not carried over (its monitors start afresh).

Monitors are found by duck typing, like gradient clippers: a callback with a `monitor_id` string,
a `ckpt_dir`, `state_dict()` and `load_state_dict(state)` (see `deepepochs.callbacks.check`).
"""

from __future__ import annotations

import copy
import errno
import os
import pickle
import re
import shutil
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path

import attrs
import torch

from deepepochs import sharded
from deepepochs.distributed import is_dtensor
from deepepochs.engine import position, runstate
from deepepochs.errors import CheckpointError, DeepEpochsWarning
from deepepochs.utils import rng_state, set_rng_state

__all__ = [
    "CONVERT_HINT",
    "FORMAT_VERSION",
    "SUFFIX",
    "Checkpoint",
    "check_fits",
    "consolidate",
    "copied_to_cpu",
    "exists",
    "find_checkpoint",
    "find_checkpoints",
    "load_model_state",
    "load_into",
    "modified_ns",
    "monitors_in",
    "plain_records",
    "monitors_of",
    "read_checkpoint",
    "read_weights",
    "remove",
    "remove_stale_temps",
    "resume_once",
    "resume_scope",
    "save",
    "snapshot",
    "write_atomic",
]

FORMAT_VERSION = 3  # the newest version this deepepochs reads (and writes, for sharded checkpoints)
SUFFIX = ".ckpt"
_TEMP_SUFFIX = ".tmp"
# Prefixes a wrapped model adds to parameter names: torch.compile's OptimizedModule and DDP.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


#: How to write a state of another layout in this format, for the errors that refuse one.
CONVERT_HINT = (" (convert it with torch.save({'format_version': 1, 'epoch': <completed epochs>, 'model':"
                " model.state_dict(), 'optimizers': [optimizer.state_dict()], 'schedulers': [None]}, path);"
                " a deepepochs 0.6 file holds model_state, opt_state and epoch and loads as it is)")


def _non_negative_int(_instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"checkpoint key {attribute.name!r} must be a non-negative int (got {value!r})")


def _mapping(_instance, attribute, value):
    if not isinstance(value, Mapping):
        raise CheckpointError(f"checkpoint key {attribute.name!r} must be a dict"
                              f" (got {type(value).__name__})")


def _list(_instance, attribute, value):
    if not isinstance(value, (list, tuple)):
        raise CheckpointError(f"checkpoint key {attribute.name!r} must be a list"
                              f" (got {type(value).__name__})")


@attrs.define(kw_only=True)
class Checkpoint:
    """The typed contents of a checkpoint file; `to_dict()` is exactly what `torch.save` writes.

    Attributes mirror the file's keys (see the module docstring).
    """

    format_version: int = attrs.field(default=1, validator=_non_negative_int)
    running_id: str = attrs.field(default="", validator=attrs.validators.instance_of(str))
    epoch: int = attrs.field(default=0, validator=_non_negative_int)
    world_size: int = attrs.field(default=1, validator=_non_negative_int)
    model: Mapping = attrs.field(factory=dict, validator=_mapping)
    optimizers: list = attrs.field(factory=list, validator=_list)
    schedulers: list = attrs.field(factory=list, validator=_list)
    scaler: Mapping | None = None
    monitors: Mapping = attrs.field(factory=dict, validator=_mapping)
    rng: Mapping | None = None
    order_seed: int | None = None
    position: Mapping | None = None
    shards: Mapping | None = None
    history: Mapping | None = None

    def to_dict(self) -> dict:
        """The plain dict stored in the file."""
        return {f.name: getattr(self, f.name) for f in attrs.fields(type(self))}

    @classmethod
    def from_dict(cls, data, path="<memory>") -> Checkpoint:
        """Validate a loaded dict; `CheckpointError` names `path` and what is wrong. A deepepochs 0.6 file
        is converted (`from_06`)."""
        if not isinstance(data, Mapping):
            raise CheckpointError(f"{path} is not a deepepochs checkpoint (a dict was expected, got"
                                  f" {type(data).__name__})")
        if "format_version" not in data and {"model_state", "opt_state", "epoch"} <= set(data):
            return cls.from_06(data, path)
        names = [f.name for f in attrs.fields(cls)]
        missing = [n for n in ("format_version", "epoch", "model") if n not in data]
        if missing:
            raise CheckpointError(f"{path} is not a deepepochs checkpoint: keys {missing} are missing"
                                  f" (found {sorted(map(str, data))}){CONVERT_HINT}")
        version = data["format_version"]
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise CheckpointError(f"{path} has format_version {version}, but this deepepochs reads up to"
                                  f" {FORMAT_VERSION}; upgrade deepepochs to load it")
        try:
            return cls(**{n: data[n] for n in names if n in data})
        except CheckpointError as e:
            raise CheckpointError(f"{path}: {e}") from None

    @classmethod
    def from_06(cls, data: Mapping, path="<memory>") -> Checkpoint:
        """A deepepochs 0.6 checkpoint as this format.

        0.6 saved `{'model_state': model.state_dict(), 'opt_state': [...], 'best_value': ..., 'epoch': i}`,
        with one `{'opt_state': optimizer state, 'sched_state': scheduler state or None}` per optimizer
        and `i` the 0-based index of the epoch saved, so `i + 1` epochs were complete. A plain optimizer
        `state_dict()` under `opt_state` is accepted too. `best_value` is dropped: monitors start afresh.
        """
        hint = CONVERT_HINT
        epoch, opt_state = data["epoch"], data["opt_state"]
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < -1:
            raise CheckpointError(f"{path}: the 0.6 checkpoint's epoch must be an int (got {epoch!r}){hint}")
        if isinstance(opt_state, Mapping):
            opt_state = [opt_state]
        if not isinstance(opt_state, (list, tuple)):
            raise CheckpointError(f"{path}: the 0.6 checkpoint's opt_state must be a list (got"
                                  f" {type(opt_state).__name__}){hint}")
        optimizers, schedulers = [], []
        for item in opt_state:
            if isinstance(item, Mapping) and "param_groups" in item:  # a plain optimizer state_dict()
                optimizers.append(item)
                schedulers.append(None)
            elif isinstance(item, Mapping) and "opt_state" in item:
                optimizers.append(item["opt_state"])
                schedulers.append(item.get("sched_state"))
            else:
                raise CheckpointError(f"{path}: an opt_state entry of the 0.6 checkpoint is neither an optimizer"
                                      f" state nor {{'opt_state', 'sched_state'}} (got {type(item).__name__}){hint}")
        model = data["model_state"]
        if not isinstance(model, Mapping):
            raise CheckpointError(f"{path}: the 0.6 checkpoint's model_state must be a state dict (got"
                                  f" {type(model).__name__}){hint}")
        return cls(epoch=epoch + 1, model=model, optimizers=optimizers, schedulers=schedulers)


def monitors_in(callbacks) -> list:
    """The checkpoint monitors (e.g. `CheckCallback`s) among `callbacks`, in declaration order."""
    return [cb for cb in callbacks if isinstance(getattr(cb, "monitor_id", None), str)]


def monitors_of(trainer) -> list:
    """The trainer's checkpoint monitors, in declaration order."""
    return monitors_in(trainer.callbacks)


def snapshot(trainer, position: Mapping | None = None) -> Checkpoint:
    """The trainer's current training state as a `Checkpoint` for one file (tensors are not copied);
    `position`: where inside the epoch it was taken (`deepepochs.engine.position.capture`), None at an
    epoch's end. Under FSDP, where every rank holds shards, `save` writes a sharded checkpoint instead."""
    if trainer._dist.shards_model:
        raise CheckpointError("under strategy='fsdp' every rank holds shards of the states, so there is no one-file"
                              " snapshot; call deepepochs.checkpoint.save(trainer, path) on every rank (a sharded"
                              " checkpoint folder) and consolidate(path, file) for one file")
    return _header(trainer, position, trainer.raw_model.state_dict(), trainer.opt.state_dict())


def _header(trainer, position: Mapping | None, model: Mapping, opts: Mapping) -> Checkpoint:
    """A `Checkpoint` of the trainer's state with the given model and optimizer states."""
    return Checkpoint(
        format_version=1 if position is None else 2,
        position=position,
        running_id=str(trainer.running_id),
        epoch=trainer.loop.completed_epochs,
        world_size=trainer.world_size,
        model=model,
        optimizers=opts["optimizers"],
        schedulers=opts["schedulers"],
        scaler=trainer._precision.state_dict(),
        monitors={m.monitor_id: m.state_dict() for m in monitors_of(trainer)},
        rng=rng_state() if trainer.world_size == 1 else None,  # under DDP every rank has its own
        order_seed=trainer._dist.order_seed,
        history=plain_records(_run_records(trainer, position)),
    )


def _run_records(trainer, position: Mapping | None) -> Mapping:
    """The records of the epochs the file counts as completed. An epoch-end save runs before its epoch
    commits (`save_checkpoints` precedes `commit_epoch`; `epoch_undo` is pending then), so that epoch's
    metrics are added to the history here."""
    loop = trainer.loop
    run = loop.run
    if position is not None or not loop.epoch_undo:
        return run.history
    records = {stage: {name: list(values) for name, values in metrics.items()}
               for stage, metrics in run.history.items()}
    for stage, metrics in run.last_metrics.items():
        if stage in records:
            for name, value in metrics.items():
                records[stage].setdefault(name, []).append(value)
    return records


def plain_records(records: Mapping) -> dict:
    """`{'train': {name: [...]}, 'val': {...}}` as new lists of floats (what a file may hold)."""
    return {stage: {name: [float(v) for v in values] for name, values in metrics.items()}
            for stage, metrics in records.items()}


def save(trainer, path, position: Mapping | None = None) -> Path | None:
    """Save the trainer's state to `path`, every rank calling it; returns `path` on rank 0, else None.

    One file written atomically by rank 0 (`snapshot`, `write_atomic`), or under FSDP a sharded checkpoint
    folder of that name written by every rank (`deepepochs.sharded`). `path` is replaced whichever form it
    had before. `position` as for `snapshot`. When the save fails, every rank raises (see `_agreed`).
    """
    path, dist = Path(path), trainer._dist
    if not dist.shards_model:
        ckpt = snapshot(trainer, position)
        _agreed(dist, path, lambda: write_atomic(ckpt.to_dict(), path))
        return path if dist.is_main else None
    flat, params = sharded.flat_tensors(trainer.raw_model, [item.opt for item in trainer.opt.items])
    folder = _agreed(dist, path, lambda: _prepare_folder(path))
    try:
        sharded.write(flat, path / folder)  # DCP raises on every rank when one fails
    except Exception as e:
        raise CheckpointError(f"writing the shards of checkpoint {path} failed"
                              f" ({e if isinstance(e, CheckpointError) else repr(e)}); the previous"
                              " checkpoint, if any, is unchanged") from e

    def commit() -> None:
        opts = trainer.opt.state_dict()
        opts["optimizers"] = [_without_tensors(state) for state in opts["optimizers"]]
        ckpt = _header(trainer, position, {}, opts)
        ckpt.format_version, ckpt.shards = 3, {"folder": folder, "params": params}
        write_atomic(ckpt.to_dict(), path / sharded.SIDE_CAR)
        sharded.remove_unnamed(path, folder)

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
    sharded.remove_unnamed(path, _shard_folder(path))
    return sharded.new_folder_name()


def _check_replaceable(path: Path, committed: bool) -> None:
    """`CheckpointError` unless a save may replace (or, `committed=False`, write into) the existing folder
    `path`: it holds nothing but what sharded saves write there, and with `committed` it is a complete
    sharded checkpoint (a `checkpoint.pt` naming a shard folder that is there). A user's folder is never
    removed or written into because a checkpoint has its name."""
    foreign = sharded.foreign_entries(path)
    if foreign:
        shown = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
        raise CheckpointError(f"cannot save checkpoint {path}: that folder exists and holds what no deepepochs"
                              f" save wrote there ({shown}); it was left as it is. Move those files, or save"
                              " to another path")
    name = _shard_folder(path) if committed else None
    try:
        complete = name is not None and sharded.check_name(name, path).is_dir()
    except CheckpointError:
        complete = False
    if committed and not complete:
        raise CheckpointError(f"cannot save checkpoint {path}: that folder exists but is not a complete sharded"
                              f" checkpoint (no readable {sharded.SIDE_CAR} naming a shard folder in it); it was"
                              " left as it is. Remove it yourself if it is no longer needed, or save to another path")


def _without_tensors(state: Mapping) -> dict:
    """An optimizer's `state_dict()` without its per-parameter tensors (they go into the shards)."""
    return {**state, "state": {index: {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
                               for index, values in state.get("state", {}).items()}}


def _shard_folder(path: Path) -> str | None:
    """The shard folder the committed `checkpoint.pt` of the folder `path` names, or None (read alone: the
    shards' metadata is not needed for the name)."""
    try:
        shards = _read_file(path / sharded.SIDE_CAR, False).shards
    except CheckpointError:
        return None
    return shards.get("folder") if isinstance(shards, Mapping) else None


def exists(path) -> bool:
    """Whether `path` is a checkpoint: a file, or a committed sharded checkpoint folder."""
    path = Path(path)
    return path.is_file() or sharded.is_folder(path)


def modified_ns(path) -> int:
    """When the checkpoint at `path` was last committed (a folder's `checkpoint.pt`'s time)."""
    path = Path(path)
    return (path / sharded.SIDE_CAR if path.is_dir() else path).stat().st_mtime_ns


def remove(path) -> None:
    """Delete the checkpoint at `path`, a file or a sharded checkpoint folder."""
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


# ---- writing ----
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


def write_atomic(data: Mapping, path) -> Path:
    """`torch.save(data)` to `path` atomically: a temporary file in the same folder, then `os.replace`.

    The temporary file must be in the same folder: `os.replace` is atomic only within one file system.
    A failed write removes it and raises `CheckpointError`; the previous file at `path` is untouched.
    """
    path = Path(path)
    # Hidden, unique per writer, and not ending in SUFFIX: resume never mistakes it for a checkpoint.
    temp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}{_TEMP_SUFFIX}")
    if path.is_dir():  # only a complete sharded checkpoint holding nothing else is replaced by the file
        _check_replaceable(path, committed=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(path.parent)
        with open(temp, "wb") as f:
            torch.save(dict(data), f)
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


# ---- reading ----
def read_checkpoint(path, trusted: bool = False) -> Checkpoint:
    """Read and validate one checkpoint onto the CPU; `CheckpointError` names the path on failure.

    A sharded checkpoint (a folder, or the `checkpoint.pt` in it) is read without its tensors: `model`
    and the optimizers' states hold tensors on the meta device with the stored shapes and dtypes, enough
    for `check_fits`; `load_into` and `consolidate` read the tensors themselves.

    The file is unpickled with `weights_only=True`: only tensors, numbers, strings and containers come
    out, and nothing in the file can run code (SEC-1). A file holding other objects (a checkpoint of a
    custom scheduler that keeps objects in its state, or a file crafted to run code) is refused, naming
    the type, unless `trusted=True`: then it is fully unpickled, which runs whatever code the file
    carries; pass it only for a file you made yourself.
    """
    path = Path(path)
    if path.is_dir():
        if not (path / sharded.SIDE_CAR).is_file():
            raise CheckpointError(f"{path} is a folder but not a sharded checkpoint: it holds no {sharded.SIDE_CAR}"
                                  " (a save into it may have been killed before its first commit)")
        return _with_shard_specs(_read_file(path / sharded.SIDE_CAR, trusted), path)
    ckpt = _read_file(path, trusted)
    # the checkpoint.pt of a sharded checkpoint, named itself: the folder around it is the checkpoint
    return ckpt if ckpt.shards is None else _with_shard_specs(ckpt, path.parent)


def _read_file(path: Path, trusted: bool) -> Checkpoint:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} does not exist")
    try:
        data = torch.load(path, map_location="cpu", weights_only=not trusted)
    except Exception as e:
        offending = re.search(r"GLOBAL ([\w.]+)", str(e)) if isinstance(e, pickle.UnpicklingError) else None
        if offending is not None:
            raise CheckpointError(
                f"checkpoint {path} holds an object of type {offending.group(1)}, not only tensors, numbers,"
                " strings and containers; it was not loaded, since unpickling it could run code from the file."
                " If you made this file yourself, load it with trainer.load_checkpoint(path, trusted=True)"
            ) from e
        first = str(e).split("\n")[0]
        raise CheckpointError(f"cannot read checkpoint {path}: the file is truncated or corrupt"
                              f" ({type(e).__name__}: {first})") from e
    return Checkpoint.from_dict(data, path)


def _check_shards(ckpt: Checkpoint, folder: Path) -> None:
    shards = ckpt.shards
    ok = (isinstance(shards, Mapping) and isinstance(shards.get("folder"), str)
          and isinstance(shards.get("params"), list)
          and len(shards["params"]) == len(ckpt.optimizers)
          and all(isinstance(names, list) and all(isinstance(n, str) for n in names) for names in shards["params"]))
    if not ok:
        raise CheckpointError(f"{folder / sharded.SIDE_CAR}: its 'shards' entry is damaged (got {shards!r})")
    sharded.check_name(shards["folder"], folder)  # tensors are read from inside the checkpoint folder only


def _with_shard_specs(ckpt: Checkpoint, folder: Path) -> Checkpoint:
    """The side file of a sharded checkpoint completed with meta tensors of the stored shapes and dtypes."""
    _check_shards(ckpt, folder)
    specs = sharded.tensor_specs(sharded.check_name(ckpt.shards["folder"], folder))
    return _completed(ckpt, folder, {key: torch.empty(size, dtype=dtype, device="meta")
                                     for key, (size, dtype) in specs.items()})


def _completed(ckpt: Checkpoint, folder: Path, flat: Mapping) -> Checkpoint:
    """`ckpt` (read from the sharded checkpoint `folder`) with the flat dict's tensors in its model and
    optimizer states."""
    try:
        model, optimizers = sharded.split_tensors(flat, ckpt.shards["params"], ckpt.optimizers)
    except (KeyError, ValueError, IndexError) as e:
        raise CheckpointError(f"{folder}: the shards do not match its {sharded.SIDE_CAR} (tensor of an unknown"
                              f" optimizer or parameter: {e})") from None
    return attrs.evolve(ckpt, model=model if any(k.startswith("model/") for k in flat) else ckpt.model,
                        optimizers=optimizers)


def _folder_of(path: Path) -> Path:
    return path if path.is_dir() else path.parent


def _read_shards(ckpt: Checkpoint, path, trainer=None, model_only: bool = False) -> Checkpoint:
    """`ckpt` (read from the sharded checkpoint at `path`) with its tensors read: under FSDP this rank's
    shards of the trainer's parameters and states, at any world size (every rank calls it: a collective);
    otherwise (one process, DDP, or no trainer) full tensors on the CPU. `model_only`: the model's."""
    folder = _folder_of(Path(path))
    shards = sharded.check_name(ckpt.shards["folder"], folder)
    specs = sharded.tensor_specs(shards)
    if model_only:
        specs = {key: spec for key, spec in specs.items() if key.startswith("model/")}
    distributed = trainer is not None and trainer._dist.shards_model
    likes = {}
    if distributed:  # a DTensor target of the parameter's placement reads just this rank's shard
        likes = {f"model/{k}": v for k, v in trainer.raw_model.state_dict().items()}
        params = dict(trainer.raw_model.named_parameters())
        likes.update({key: params.get(key.split("/", 2)[2].rsplit("/", 1)[0])
                      for key in specs if key.startswith("optim/")})
    targets = {}
    for key, (size, dtype) in specs.items():
        like = likes.get(key)
        sharded_like = like is not None and is_dtensor(like) and like.shape == size
        targets[key] = torch.empty_like(like, dtype=dtype) if sharded_like else torch.empty(size, dtype=dtype)
    try:
        sharded.read_into(targets, shards, distributed)
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"cannot read the shards of checkpoint {folder}: ({type(e).__name__}:"
                              f" {str(e).strip().splitlines()[0] if str(e).strip() else ''})") from e
    return _completed(ckpt, folder, targets)


def read_weights(trainer, path) -> Checkpoint:
    """The checkpoint at `path` with its model state ready for `load_model_state(trainer, ...)` (every rank
    calls it; under FSDP each reads its shards of a sharded checkpoint)."""
    ckpt = read_checkpoint(path)
    return ckpt if ckpt.shards is None else _read_shards(ckpt, path, trainer, model_only=True)


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
    full = attrs.evolve(full, format_version=1 if full.position is None else 2, shards=None)
    return write_atomic(full.to_dict(), target)


def _unwrap_keys(state: Mapping, expected: set) -> Mapping:
    """Strip wrapper prefixes (`_orig_mod.`, `module.`) when that is what makes the keys match.

    Our own files never carry them (we save the unwrapped model), but a state dict saved from a DDP or
    compiled module by other code would; stripping only on a mismatch keeps a real submodule named
    `module` intact.
    """
    keys = set(state)
    while keys != expected:
        prefix = next((p for p in _WRAPPER_PREFIXES if keys and all(k.startswith(p) for k in keys)), None)
        if prefix is None:
            break
        state = {k[len(prefix):]: v for k, v in state.items()}
        keys = set(state)
    return state


def load_model_state(trainer, state: Mapping, path="<memory>") -> None:
    """Load a full model state dict into `trainer.raw_model` (strict, through the distributed policy: every
    rank calls it, and under FSDP rank 0's `state` is what loads); `CheckpointError` names `path`."""
    model = trainer.raw_model
    state = _unwrap_keys(state, set(model.state_dict()))
    try:
        trainer._dist.load_model_state_dict(model, state)
    except (RuntimeError, KeyError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} does not fit the model: {e}") from e


def copied_to_cpu(state: Mapping) -> dict:
    """A copy of a state dict with its tensors detached and on the CPU (a backup the live weights cannot
    change); DTensors (FSDP shards) are copied where they are."""
    def copied(v):
        if not isinstance(v, torch.Tensor):
            return copy.deepcopy(v)
        return v.detach().clone() if is_dtensor(v) else v.detach().to("cpu", copy=True)
    return {k: copied(v) for k, v in state.items()}


def _shape(value):
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def check_fits(trainer, ckpt: Checkpoint, path) -> None:
    """Raise `CheckpointError` (naming `path` and every mismatch found) unless `ckpt` can be loaded into
    `trainer` whole: model keys and shapes, the number of optimizers, each optimizer's kind (its param
    groups' hyper-parameter names), group and parameter counts and per-parameter state shapes, each
    scheduler's kind (its state's keys). Loading checks first and changes nothing when this raises."""
    problems = []
    model_state = trainer.raw_model.state_dict()
    saved = _unwrap_keys(ckpt.model, set(model_state))
    missing, unexpected = sorted(set(model_state) - set(saved)), sorted(set(saved) - set(model_state))
    if missing or unexpected:
        problems.append(f"model keys differ (missing {missing[:5]}, unexpected {unexpected[:5]})")
    problems += [f"model {k}: shape {_shape(saved[k])} in the file, {_shape(v)} in the model"
                 for k, v in model_state.items() if k in saved and _shape(saved[k]) != _shape(v)]
    items = trainer.opt.items
    if len(ckpt.optimizers) != len(items):
        problems.append(f"{len(ckpt.optimizers)} optimizer state(s) in the file, {len(items)} optimizer(s) in the"
                        " trainer")
    for i, (item, state) in enumerate(zip(items, ckpt.optimizers)):
        groups, have = state.get("param_groups", []) if isinstance(state, Mapping) else [], item.opt.param_groups
        kind = type(item.opt).__name__
        if len(groups) != len(have):
            problems.append(f"optimizer {i} ({kind}): {len(groups)} param group(s) in the file, {len(have)} here")
            continue
        for j, (g, h) in enumerate(zip(groups, have)):
            keys, want = set(g) - {"params"}, set(h) - {"params"}
            if not keys >= want - {"differentiable", "foreach", "fused", "capturable", "maximize",
                                   "decoupled_weight_decay"}:
                problems.append(f"optimizer {i} is {kind}, but the file holds another optimizer's state (param"
                                f" group {j} lacks {sorted(want - keys)})")
            elif len(g.get("params", ())) != len(h["params"]):
                problems.append(f"optimizer {i} ({kind}) param group {j}: {len(g.get('params', ()))} parameters"
                                f" in the file, {len(h['params'])} here")
        if not any(p.startswith(f"optimizer {i} ") for p in problems):
            params = [p for h in have for p in h["params"]]
            ids = [pid for g in groups for pid in g.get("params", ())]
            for pid, param in zip(ids, params):
                for name, value in (state.get("state", {}).get(pid) or {}).items():
                    if isinstance(value, torch.Tensor) and value.dim() and value.shape != param.shape:
                        problems.append(f"optimizer {i} ({kind}) state {name!r} of parameter {pid}: shape"
                                        f" {tuple(value.shape)} in the file, {tuple(param.shape)} here")
    for i, (item, state) in enumerate(zip(items, ckpt.schedulers)):
        if item.scheduler is not None and isinstance(state, Mapping):
            want = set(item.scheduler.state_dict())
            if set(state) != want:
                problems.append(f"scheduler {i} is {type(item.scheduler).__name__}, but the file holds another"
                                f" scheduler's state (keys {sorted(set(state) ^ want)} differ)")
    if ckpt.position is not None:
        try:
            position.check(ckpt.position, trainer.world_size, path)
        except CheckpointError as e:
            problems.append(str(e))
    if problems:
        raise CheckpointError(f"checkpoint {path} does not fit this trainer; nothing was loaded: "
                              + "; ".join(problems))


def load_into(trainer, path, ckpt: Checkpoint | None = None, trusted: bool = False) -> Checkpoint:
    """Restore everything a checkpoint holds into `trainer` (model, optimizers, schedulers, scaler,
    completed epoch, monitors, and in one process the generator states of a one-process run); the
    trainer's running id is left alone.

    Monitors absent from the file keep their state; states of monitors the trainer lacks are ignored.
    `trusted` is `read_checkpoint`'s. The file is checked against the trainer first (`check_fits`): a
    mismatch raises `CheckpointError` before anything is changed.
    """
    path = Path(path)
    ckpt = read_checkpoint(path, trusted) if ckpt is None else ckpt
    check_fits(trainer, ckpt, path)  # all or nothing: every mismatch is found before anything changes
    backup = _backup(trainer)  # and what check_fits cannot foresee (a damaged scaler or monitor state)
    run = trainer.loop.run
    run_backup = runstate.capture(run)  # the run state (history, position, random state) as well
    try:
        if ckpt.shards is not None:
            ckpt = _read_shards(ckpt, path, trainer)
        _apply(trainer, ckpt, path)
        if ckpt.position is not None:  # a mid-epoch snapshot: the next fit continues inside its epoch
            position.restore(run, ckpt.position, trainer.dist.rank, trainer.device, trainer.world_size)
    except BaseException as exc:
        _apply(trainer, backup, "<the state before loading>")
        runstate.restore(run, run_backup)
        if isinstance(exc, CheckpointError):
            raise
        first_line = (str(exc).strip().splitlines() or [""])[0]
        raise CheckpointError(f"checkpoint {path} could not be loaded ({type(exc).__name__}: {first_line});"
                              " nothing was changed") from exc
    loop = trainer.loop
    loop.completed_epochs = ckpt.epoch
    loop.epoch = ckpt.epoch
    loop.stop = None
    if ckpt.position is None:
        loop.resume = None  # an interrupted epoch's resume point belongs to the weights we just replaced
        run.random_restore_due, run.random_replay = False, None  # and so do the generators a refit restores
    return ckpt


def _backup(trainer) -> Checkpoint:
    """The trainer's state as an independent `Checkpoint` (tensors copied, the weights to the CPU; under
    FSDP each rank's shards, copied where they are)."""
    backup = _header(trainer, None, copied_to_cpu(trainer.raw_model.state_dict()),
                     copy.deepcopy(trainer.opt.state_dict()))
    return attrs.evolve(backup, scaler=copy.deepcopy(backup.scaler), monitors=copy.deepcopy(backup.monitors))


def _apply(trainer, ckpt: Checkpoint, path) -> None:
    """Load `ckpt`'s model, optimizers, schedulers, scaler, monitors and (one process) generator states."""
    load_model_state(trainer, ckpt.model, path)
    dist, model = trainer.dist, trainer.raw_model
    try:
        trainer.opt.load_state_dict({"optimizers": ckpt.optimizers, "schedulers": ckpt.schedulers},
                                    lambda opt, state: dist.load_optimizer_state_dict(model, opt, state))
    except (ValueError, RuntimeError, KeyError, IndexError) as e:
        raise CheckpointError(f"checkpoint {path}: optimizer or scheduler state does not fit: {e}") from e
    trainer.precision.load_state_dict(ckpt.scaler)
    for monitor in monitors_of(trainer):
        state = ckpt.monitors.get(monitor.monitor_id)
        if state is not None:
            monitor.load_state_dict(state)
    if ckpt.history is not None:  # the run's records so far: a resumed fit() returns the whole run's
        history = trainer.history
        history.clear()
        history.update({"train": {}, "val": {}, **plain_records(ckpt.history)})
    if ckpt.order_seed is not None:  # the training order continues as it was (`sharding.DataOrder`)
        trainer.dist.order_seed = ckpt.order_seed
    if ckpt.rng is not None and trainer.world_size == 1:
        try:
            set_rng_state(ckpt.rng)
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {path}: the random generator states do not fit: {e!r}") from e


# ---- finding ----
def _checkpoints_in(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return [p for p in folder.iterdir() if p.suffix == SUFFIX and not p.name.startswith(".") and exists(p)]


def find_checkpoint(ckpt_dirs, running_id: str | None = None) -> Path | None:
    """The newest checkpoint (by modification time) under `<ckpt_dir>/<run>/` for all `ckpt_dirs`.

    With `running_id`, only that run's folders are searched and finding none is a `CheckpointError`
    naming the folders searched; without it, None means there is no checkpoint at all.
    """
    found = find_checkpoints(ckpt_dirs, running_id)
    return found[0] if found else None


def find_checkpoints(ckpt_dirs, running_id: str | None = None) -> list[Path]:
    """Every checkpoint under `<ckpt_dir>/<run>/` for all `ckpt_dirs`, newest (modification time) first.

    With `running_id`, only that run's folders are searched and finding none is a `CheckpointError`.
    """
    dirs = list(dict.fromkeys(Path(d) for d in ckpt_dirs))
    if running_id is None:
        runs = [run for d in dirs if d.is_dir() for run in d.iterdir() if run.is_dir()]
    else:
        runs = [d / running_id for d in dirs]
    found = [p for run in runs for p in _checkpoints_in(run)]
    if not found:
        if running_id is None:
            return []
        searched = ", ".join(str(r) for r in runs) or "(no CheckCallback, so no ckpt_dir to search)"
        raise CheckpointError(f"resume={running_id!r}: no checkpoint of that run was found;"
                              f" searched {searched}")
    # Newest first by mtime; the path breaks ties so the choice is deterministic.
    return sorted(found, key=lambda p: (modified_ns(p), str(p)), reverse=True)


def _hint_06_folder(dirs, candidates) -> str:
    """When resume found nothing and 0.6's default folder `./logs` holds 0.6 checkpoints, say how to resume
    them (0.6's CheckCallback saved to ./logs/<running id>/checkpoint.ckpt; 0.7's default is ./checkpoints)."""
    legacy = Path("./logs")
    if candidates or any(Path(d).resolve() == legacy.resolve() for d in dirs):
        return ""
    if not any(legacy.glob("*/checkpoint.ckpt")):
        return ""
    return (". deepepochs 0.6 checkpoints are in ./logs, 0.6's default folder: pass"
            " CheckCallback(..., ckpt_dir='./logs') to resume them")


def resume_scope(trainer) -> tuple[str | None, bool, str]:
    """Which run `Trainer(resume=...)` may load, whether that run must exist, and why (for the console).

    `resume='<run>'` names the run, which must have a checkpoint. `resume=True` with a `running_id` given
    to the Trainer is that run only, started fresh when it has no files yet (the requeue pattern: the same
    command line resumes its own run and never another job's). `resume=True` without a `running_id` takes
    the newest checkpoint of any run under the monitors' folders.
    """
    resume = trainer.resume
    if isinstance(resume, str):
        return resume, True, f"resume={resume!r}"
    if trainer.loop.run.running_id_given:
        return str(trainer.running_id), False, f"resume=True with running_id={str(trainer.running_id)!r}"
    return None, False, "resume=True without a running_id: the newest checkpoint of any run"


def _position_text(ckpt: Checkpoint, trainer) -> str:
    """Where the loaded file continues: after a completed epoch, or inside an epoch (a mid-epoch snapshot)."""
    pos = ckpt.position
    if not isinstance(pos, Mapping) or not {"epoch", "batches_done", "task_index"} <= set(pos):
        return f"{ckpt.epoch} epoch(s) completed, continuing with epoch {ckpt.epoch + 1}"
    k = trainer.config.gradient_accumulation_steps
    done = int(pos["batches_done"])
    task = f" of training task {int(pos['task_index']) + 1}" if int(pos["task_index"]) > 0 else ""
    return (f"{ckpt.epoch} epoch(s) completed, continuing epoch {int(pos['epoch'])}{task} at update"
            f" {-(-done // k) + 1} (after {done} batch(es))")


def resume_once(trainer) -> tuple[Path, int] | None:
    """Honour `Trainer(resume=...)` at the first fit, test or predict; a no-op afterwards. Returns the
    loaded file's path and epoch, or None when nothing was loaded.

    The run searched is `resume_scope`'s. Among its checkpoints (under the monitors' `ckpt_dir`s) the
    newest this trainer can load is loaded; with `resume=True` a file it cannot use (unreadable, not a
    checkpoint, one of another model or optimizer, a sharded folder with a missing or damaged shard, a
    mid-epoch snapshot whose position lies outside this fit's data) is skipped with a `DeepEpochsWarning`
    naming it and why, so an old or foreign file in the folder never stops `fit()`, and no usable file means
    a fresh start. `resume='<running id>'` loads that run's newest checkpoint or raises. The run folder's name
    becomes `trainer.running_id`, so new checkpoints go on into the same (possibly renamed) folder. A
    failed resume stays pending, so fixing the files and calling fit again retries it.
    """
    if not trainer.loop.resume_pending:
        return None
    loaded = None
    run, required, why = resume_scope(trainer)
    dirs = [m.ckpt_dir for m in monitors_of(trainer)]
    candidates = find_checkpoints(dirs, run) if required or run is None else _checkpoints_of_run(dirs, run)
    if required:
        candidates = candidates[:1]  # the run was named: its newest file loads, or the error says why
    path, ckpt = _load_newest_usable(trainer, candidates, strict=required)
    if path is None:
        folders = dict.fromkeys(Path(d) if run is None else Path(d) / run for d in dirs)
        searched = ", ".join(map(str, folders)) or "nowhere: no CheckCallback"
        found = f"no checkpoint this trainer can load among {len(candidates)}" if candidates else "no checkpoint"
        trainer.console.info(f"{why}: {found} found (searched {searched}); starting run {trainer.running_id} fresh"
                             + _hint_06_folder(dirs, candidates))
    else:
        trainer.running_id = path.parent.name
        trainer.console.info(f"Resumed run {trainer.running_id} ({why}) from {path}:"
                             f" {_position_text(ckpt, trainer)}")
        loaded = (path, ckpt.epoch)
    trainer.loop.resume_pending = False
    return loaded


def _fit_train_tasks(trainer) -> list | None:
    """The training tasks of the fit that is resuming (None when a test or predict resumes): what a
    snapshot's mid-epoch position is checked against."""
    return trainer.loop.resume_tasks


def _load_newest_usable(trainer, candidates: list[Path], strict: bool) -> tuple[Path | None,
                                                                                Checkpoint | None]:
    """Load the first of `candidates` (newest first) that this trainer can use, into it; returns its path and
    contents, or (None, None). A candidate that cannot be used is skipped with a `DeepEpochsWarning` naming
    it and why, whatever fails: reading it, checking it against the trainer (and a mid-epoch snapshot's
    position against the fit's training data), or reading its tensors (a sharded folder with a damaged
    shard). Loading is all or nothing, so a skipped candidate changed nothing.
    `strict` (a named run): the first candidate loads or its `CheckpointError` is raised."""
    for candidate in candidates:
        try:
            ckpt = read_checkpoint(candidate)
            check_fits(trainer, ckpt, candidate)
            train = _fit_train_tasks(trainer)
            if ckpt.position is not None and train:  # a mid-epoch position must lie inside this fit's data
                position.check_data(ckpt.position, train, trainer.world_size, candidate)
            remove_stale_temps(candidate.parent)
            return candidate, load_into(trainer, candidate, ckpt)
        except CheckpointError as e:
            if strict:
                raise
            warnings.warn(f"resume=True skipped {candidate}: {e}", DeepEpochsWarning, stacklevel=3)
    return None, None


def _checkpoints_of_run(dirs, run: str) -> list[Path]:
    """The run's checkpoints, newest first; none is no error (`resume=True` then starts the run fresh)."""
    try:
        return find_checkpoints(dirs, run)
    except CheckpointError:
        return []
