"""Reading checkpoints safely: one file or a sharded checkpoint folder, its shards, and the queries on a
checkpoint's path (does it exist, when was it committed).

Files are read with `weights_only=True` only: a file holding other objects is refused unless
loaded with `trusted=True` (`read_checkpoint`).

A sharded checkpoint (`strategy='fsdp'`) is a folder: its `checkpoint.pt` is read like a file, its
tensors from the shards through `shard_storage`, either as meta tensors of the stored shapes (enough to
check a file against a trainer) or as the tensors themselves (this rank's shards under FSDP, full
tensors otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import attrs
import torch

from deepepochs.checkpoint import archive, shard_storage
from deepepochs.checkpoint.format import Checkpoint
from deepepochs.errors import CheckpointError
from deepepochs.parallel.ddp import is_dtensor

__all__ = [
    "exists",
    "modified_ns",
    "read_checkpoint",
    "read_weights",
]


def _shard_folder(path: Path) -> str | None:
    """The shard folder the committed `checkpoint.pt` of the folder `path` names, or None (read alone: the
    shards' metadata is not needed for the name)."""
    try:
        shards = _read_file(path / shard_storage.SIDE_CAR, False).shards
    except CheckpointError:
        return None
    return shards.get("folder") if isinstance(shards, Mapping) else None


def exists(path) -> bool:
    """Whether `path` is a checkpoint: a file, or a committed sharded checkpoint folder."""
    path = Path(path)
    return path.is_file() or shard_storage.is_folder(path)


def modified_ns(path) -> int:
    """When the checkpoint at `path` was last committed (a folder's `checkpoint.pt`'s time)."""
    path = Path(path)
    return (path / shard_storage.SIDE_CAR if path.is_dir() else path).stat().st_mtime_ns


def read_checkpoint(path, trusted: bool = False) -> Checkpoint:
    """Read and validate one checkpoint onto the CPU; `CheckpointError` names the path on failure.

    A sharded checkpoint (a folder, or the `checkpoint.pt` in it) is read without its tensors: `model`
    and the optimizers' states hold tensors on the meta device with the stored shapes and dtypes, enough
    for `check_fits`; `load_into` and `consolidate` read the tensors themselves.

    The file is unpickled with `weights_only=True`: only tensors, numbers, strings and containers come
    out, and nothing in the file can run code. A file holding other objects (a checkpoint of a
    custom scheduler that keeps objects in its state, or a file crafted to run code) is refused, naming
    the type, unless `trusted=True`: then it is fully unpickled, which runs whatever code the file
    carries; pass it only for a file you made yourself.
    """
    path = Path(path)
    if path.is_dir():
        if not (path / shard_storage.SIDE_CAR).is_file():
            raise CheckpointError(f"{path} is a folder but not a sharded checkpoint: it holds no"
                                  f" {shard_storage.SIDE_CAR} (a save into it may have been killed before its first"
                                  " commit)")
        return _with_shard_specs(_read_file(path / shard_storage.SIDE_CAR, trusted), path)
    ckpt = _read_file(path, trusted)
    if ckpt.shards is None:
        return ckpt
    if path.name != shard_storage.SIDE_CAR:
        raise CheckpointError(f"checkpoint {path}: field 'shards' must be None in a single checkpoint file (only a"
                              f" sharded folder's {shard_storage.SIDE_CAR} names shards) (got"
                              f" {type(ckpt.shards).__name__})")
    # the checkpoint.pt of a sharded checkpoint, named itself: the folder around it is the checkpoint
    return _with_shard_specs(ckpt, path.parent)


_TRUST_HINT = ". If you made this file yourself, load it with trainer.load_checkpoint(path, trusted=True)"


def _read_file(path: Path, trusted: bool) -> Checkpoint:
    """One file as a validated `Checkpoint` (weights only unless `trusted`); `CheckpointError` says whether
    it is missing, holds an object that is not plain data (naming its type), or is truncated or corrupt."""
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} does not exist")
    if not trusted:
        return Checkpoint.from_dict(archive.load_plain(path, "checkpoint", hint=_TRUST_HINT), path)
    archive.check_archive(path)  # a trusted file's size is bounded too
    try:
        data = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"cannot read checkpoint {path}: the file is truncated or corrupt"
                              f" ({type(e).__name__}: {first})") from e
    return Checkpoint.from_dict(data, path)


def _check_shards(ckpt: Checkpoint, folder: Path) -> None:
    """`CheckpointError` unless the `shards` entry read from `folder`'s side file is well formed and names a
    shard folder inside `folder`."""
    shards = ckpt.shards
    ok = (isinstance(shards, Mapping) and isinstance(shards.get("folder"), str)
          and isinstance(shards.get("params"), list)
          and len(shards["params"]) == len(ckpt.optimizers)
          and all(isinstance(names, list) and all(isinstance(n, str) for n in names) for names in shards["params"]))
    if not ok:
        raise CheckpointError(f"{folder / shard_storage.SIDE_CAR}: its 'shards' entry is damaged (got {shards!r})")
    shard_storage.check_name(shards["folder"], folder)  # tensors are read from inside the checkpoint folder only


def _with_shard_specs(ckpt: Checkpoint, folder: Path) -> Checkpoint:
    """The side file of a sharded checkpoint completed with meta tensors of the stored shapes and dtypes."""
    _check_shards(ckpt, folder)
    specs = shard_storage.tensor_specs(shard_storage.check_name(ckpt.shards["folder"], folder))
    return _completed(ckpt, folder, {key: torch.empty(size, dtype=dtype, device="meta")
                                     for key, (size, dtype) in specs.items()})


def _completed(ckpt: Checkpoint, folder: Path, flat: Mapping) -> Checkpoint:
    """`ckpt` (read from the sharded checkpoint `folder`) with the flat dict's tensors in its model and
    optimizer states."""
    try:
        model, optimizers = shard_storage.split_tensors(flat, ckpt.shards["params"], ckpt.optimizers)
        averages = shard_storage.split_averages(flat, ckpt.averages)
    except (KeyError, ValueError, IndexError) as e:
        raise CheckpointError(f"{folder}: the shards do not match its {shard_storage.SIDE_CAR} (tensor of an unknown"
                              f" optimizer, parameter or weight average: {e})") from None
    return attrs.evolve(ckpt, model=model if any(k.startswith("model/") for k in flat) else ckpt.model,
                        optimizers=optimizers, averages=averages)


def _folder_of(path: Path) -> Path:
    """The sharded checkpoint folder of `path`: the folder itself, or the folder around its `checkpoint.pt`."""
    return path if path.is_dir() else path.parent


def _read_shards(ckpt: Checkpoint, path, trainer=None, model_only: bool = False) -> Checkpoint:
    """`ckpt` (read from the sharded checkpoint at `path`) with its tensors read: under FSDP this rank's
    shards of the trainer's parameters and states, at any world size (every rank calls it: a collective);
    otherwise (one process, DDP, or no trainer) full tensors on the CPU. `model_only`: the model's and the
    weight averages' (what `test()` swaps in)."""
    folder = _folder_of(Path(path))
    shards = shard_storage.check_name(ckpt.shards["folder"], folder)
    specs = shard_storage.tensor_specs(shards)
    if model_only:
        specs = {key: spec for key, spec in specs.items() if key.startswith(("model/", "average/"))}
    distributed = trainer is not None and trainer.dist.shards_model
    likes = {}
    if distributed:  # a DTensor target of the parameter's placement reads just this rank's shard
        likes = {f"model/{k}": v for k, v in trainer.raw_model.state_dict().items()}
        params = dict(trainer.raw_model.named_parameters())
        likes.update({key: params.get(key.split("/", 2)[2].rsplit("/", 1)[0])
                      for key in specs if key.startswith("optim/")})
        likes.update(shard_storage.flat_averages(trainer.loop.run.averages)[0])  # sharded like the parameters
    targets = {}
    for key, (size, dtype) in specs.items():
        like = likes.get(key)
        sharded_like = like is not None and is_dtensor(like) and like.shape == size
        targets[key] = torch.empty_like(like, dtype=dtype) if sharded_like else torch.empty(size, dtype=dtype)
    try:
        shard_storage.read_into(targets, shards, distributed)
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
