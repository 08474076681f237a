"""Sharded checkpoint storage: each rank writes its own shards through Distributed Checkpoint.

Under `strategy='fsdp'` a checkpoint is a folder named like a checkpoint file (`val-loss.best.ckpt/`):

    val-loss.best.ckpt/
        checkpoint.pt        what a checkpoint file holds except the model's and optimizers' tensors
                             (`deepepochs.checkpoint`, format_version 3); its `shards` key names:
        shards-<id>/         the tensors, written by every rank through `torch.distributed.checkpoint`
                             (DCP): `.metadata` and one `__<rank>_0.distcp` per rank

The tensors are stored as one flat dict: `model/<key>` for each entry of the model's `state_dict()`,
`optim/<i>/<parameter name>/<state name>` for each tensor of optimizer i's per-parameter state
(`flat_tensors`), `average/<id>/<key>` for each tensor of a weight average's `AveragedModel` state
(`flat_averages`; under FSDP its tensors are DTensors sharded like the parameters). Each rank writes
its own shards of the sharded tensors (DTensors) and nothing is gathered; DCP writes replicated tensors
(buffers, step counts) once.

`checkpoint.pt` is written last, atomically, by rank 0: it is the commit. A save killed midway leaves
the previous `checkpoint.pt` and the shard folder it names intact; the next save removes shard folders
that no `checkpoint.pt` names (`remove_unnamed`).

Reading (`read_into`) fills whatever targets it is given: this rank's shards of the trainer's DTensors
under FSDP, at any world size (DCP reshards), or full tensors in one process and under DDP. DCP's own
reader unpickles `.metadata` with `pickle.load`, which would run code from a crafted file; this module
reads it with an unpickler that admits DCP's metadata classes by exact name only, and the
tensors themselves are read with `weights_only=True` by DCP.

This module is storage only; `deepepochs.checkpoint` composes checkpoints from it.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

from deepepochs.errors import CheckpointError

__all__ = [
    "SIDE_CAR",
    "check_name",
    "flat_averages",
    "flat_tensors",
    "foreign_entries",
    "is_folder",
    "new_folder_name",
    "read_into",
    "remove_unnamed",
    "split_averages",
    "split_tensors",
    "tensor_specs",
    "write",
]

#: The file inside a sharded checkpoint folder holding everything but the tensors; its writing commits.
SIDE_CAR = "checkpoint.pt"
_PREFIX = "shards-"


def is_folder(path) -> bool:
    """Whether `path` is a sharded checkpoint: a folder holding a committed `checkpoint.pt`."""
    path = Path(path)
    return path.is_dir() and (path / SIDE_CAR).is_file()


def check_name(name, folder) -> Path:
    """The shard folder `name` inside the checkpoint folder `folder`, or `CheckpointError` when `name` could
    lead elsewhere: it must be one plain name (no separator, not `.` or `..`) whose resolved path (links
    followed) lies directly inside `folder`, so a crafted `checkpoint.pt` never has tensors read from outside."""
    folder = Path(folder)
    plain = (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
             and os.sep not in name and "\0" not in name)
    if plain and (folder / name).resolve().parent == folder.resolve():
        return folder / name
    raise CheckpointError(f"{folder / SIDE_CAR}: its shard folder name {name!r} does not name a folder inside"
                          f" {folder} (one plain name, no path separators, not '.' or '..', no link leading"
                          " out of it); nothing was read from it")


# What a sharded save ever puts in a checkpoint folder: its `checkpoint.pt` (and that file's temporary
# files while it is written, `checkpoint.write_atomic`), and shard folders holding DCP's files.
_OWN_TEMP = re.compile(r"^\." + re.escape(SIDE_CAR) + r"\.\d+-[0-9a-f]{8}\.tmp$")
_DCP_FILE = re.compile(r"^(__\d+)?\.metadata(\.tmp)?$|^__\d+_\d+\.distcp$")


def foreign_entries(path) -> list[str]:
    """What the folder `path` holds besides what a sharded save writes there (see above), as paths relative
    to it, sorted; empty when a save may replace or write into it. Links are foreign."""
    foreign = []
    for entry in sorted(Path(path).iterdir()):
        if entry.is_symlink():
            foreign.append(entry.name)
        elif entry.name == SIDE_CAR or _OWN_TEMP.match(entry.name):
            if not entry.is_file():
                foreign.append(entry.name)
        elif entry.name.startswith(_PREFIX) and entry.is_dir():
            foreign += [f"{entry.name}/{inner.name}" for inner in sorted(entry.iterdir())
                        if inner.is_symlink() or not inner.is_file() or not _DCP_FILE.match(inner.name)]
        else:
            foreign.append(entry.name)
    return foreign


def new_folder_name() -> str:
    """A fresh name for the shard folder of one save."""
    return f"{_PREFIX}{uuid.uuid4().hex[:12]}"


def remove_unnamed(path, keep: str | None) -> list[Path]:
    """Remove the shard folders inside the checkpoint folder `path` other than `keep` (left by earlier saves,
    or by a save killed before its commit); returns what was removed."""
    removed = []
    for entry in Path(path).iterdir() if Path(path).is_dir() else ():
        if entry.name.startswith(_PREFIX) and entry.name != keep and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


# ---- the flat layout ----
def flat_tensors(model: torch.nn.Module, optimizers) -> tuple[dict, list[list[str]]]:
    """The model's and optimizers' tensors as one flat dict (the live tensors, not copies), and per
    optimizer the names of its parameters in `state_dict()` index order."""
    names = {p: name for name, p in model.named_parameters()}
    flat = {f"model/{key}": value for key, value in model.state_dict().items()}
    params = []
    for i, opt in enumerate(optimizers):
        order = [names[p] for group in opt.param_groups for p in group["params"]]
        params.append(order)
        for index, state in opt.state_dict()["state"].items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    flat[f"optim/{i}/{order[index]}/{key}"] = value
    return flat, params


def split_tensors(flat: Mapping, params: list[list[str]], optimizer_states: list) -> tuple[dict, list]:
    """The inverse of `flat_tensors`: the model state dict, and `optimizer_states` (index-keyed, as
    `Optimizer.state_dict()`, holding their non-tensor entries) completed with the flat dict's tensors."""
    model = {key[len("model/"):]: value for key, value in flat.items() if key.startswith("model/")}
    index = [{name: i for i, name in enumerate(order)} for order in params]
    states = [{**state, "state": {k: dict(v) for k, v in state.get("state", {}).items()}}
              for state in optimizer_states]
    for key, value in flat.items():
        if not key.startswith("optim/"):
            continue
        i, rest = key[len("optim/"):].split("/", 1)
        param, name = rest.rsplit("/", 1)
        slot = index[int(i)][param]
        states[int(i)]["state"].setdefault(slot, {})[name] = value
    return model, states


def flat_averages(averages: Mapping | None) -> tuple[dict, dict | None]:
    """The weight averages' tensors (`RunState.averages[id]['model']`, the live tensors) as flat
    `average/<id>/<key>` entries, and the averages without them (their counters, for `checkpoint.pt`)."""
    flat, rest = {}, None
    if averages:
        rest = {}
        for average_id, state in averages.items():
            model = state.get("model", {}) if isinstance(state, Mapping) else {}
            flat.update({f"average/{average_id}/{key}": value for key, value in model.items()})
            rest[average_id] = {**state, "model": {}}
    return flat, rest


def split_averages(flat: Mapping, averages: Mapping | None) -> Mapping | None:
    """The inverse of `flat_averages`: `averages` (from `checkpoint.pt`) with the flat dict's tensors."""
    if not averages:
        return averages
    full = {average_id: {**state, "model": dict(state.get("model") or {})} for average_id, state in averages.items()}
    for key, value in flat.items():
        if key.startswith("average/"):
            average_id, name = key[len("average/"):].split("/", 1)
            if average_id not in full:
                raise KeyError(f"weight average {average_id!r}")
            full[average_id]["model"][name] = value
    return full


# ---- DCP ----
def _failures(e: BaseException) -> str:
    """What failed inside DCP, one line per rank: its `CheckpointException` derives from `BaseException`
    (so `except Exception` misses it) and its text is a list of tracebacks."""
    failures = getattr(e, "failures", None)
    if not isinstance(failures, Mapping):
        first = (str(e).strip().splitlines() or [""])[0]
        return f"{type(e).__name__}: {first}"
    lines = []
    for rank, (exc, _trace) in sorted(failures.items()):
        first = (str(exc).strip().splitlines() or [""])[0]
        lines.append(f"rank {rank}: {type(exc).__name__}: {first}")
    return "; ".join(lines)


def write(tensors: Mapping, folder) -> None:
    """Write this rank's part of `tensors` into `folder` (every rank calls it: a collective); a failure on
    any rank is a `CheckpointError` on every rank, saying what failed where."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415 (heavy import, sharded runs only)
    from torch.distributed.checkpoint.api import CheckpointException  # noqa: PLC0415
    try:
        dcp.save(dict(tensors), storage_writer=dcp.FileSystemWriter(folder, overwrite=True))
    except CheckpointException as e:
        raise CheckpointError(f"writing the shards into {folder} failed ({_failures(e)})") from e


# Every global DCP's `.metadata` pickle may name, as exact (module, name) pairs: DCP's metadata records, the
# storage record of its file-system writer, `torch.Size`, the helper that rebuilds a layout from its name,
# and paths. Nothing is admitted by module: `torch.distributed.checkpoint.metadata` imports `os`, and pickle
# protocol 4 resolves a dotted name ('os.system') from there, so a module-wide rule would admit any callable
# reachable from that module.
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ADMITTED = frozenset({
    *((_DCP_METADATA, name) for name in ("Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata",
                                          "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
                                          "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    *(("pathlib", name) for name in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
})


def _admitted(module: str, name: str) -> bool:
    """Whether the metadata unpickler may resolve `module`.`name`: an exact pair of `_ADMITTED`, or a dtype,
    layout or memory format of `torch` (values, not callables). Dotted names are never admitted."""
    if "." in name:
        return False
    if (module, name) in _ADMITTED:
        return True
    return module == "torch" and isinstance(vars(torch).get(name), (torch.dtype, torch.layout, torch.memory_format))


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata records, `torch.Size`, dtypes and paths by exact name; refuses every other
    global."""

    def find_class(self, module, name):
        if not _admitted(module, name):
            raise CheckpointError(f"the shard metadata refers to {module}.{name}, which DCP metadata never holds;"
                                  " it was not loaded, since unpickling it could run code from the file")
        return super().find_class(module, name)


def _reader(folder):
    """A DCP `FileSystemReader` over `folder` whose metadata is read by `_MetadataUnpickler`."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415 (heavy import)

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(Path(self.path) / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                from torch.distributed.checkpoint.metadata import StorageMeta  # noqa: PLC0415
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(folder)


def tensor_specs(folder) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every stored tensor's key, global shape and dtype, from the shard folder's metadata."""
    folder = Path(folder)
    if not (folder / ".metadata").is_file():
        raise CheckpointError(f"shard folder {folder} is missing or incomplete (no .metadata)")
    try:
        metadata = _reader(folder).read_metadata()
    except CheckpointError as e:
        raise CheckpointError(f"{folder}: {e}") from None
    except Exception as e:
        raise CheckpointError(f"cannot read the shard metadata in {folder}: the file is truncated or corrupt"
                              f" ({type(e).__name__}: {e})") from e
    _check_files(folder, metadata)
    specs = {}
    for key, entry in metadata.state_dict_metadata.items():
        size, props = getattr(entry, "size", None), getattr(entry, "properties", None)
        if size is None or props is None:
            raise CheckpointError(f"shard folder {folder} holds a non-tensor entry {key!r}; deepepochs stores"
                                  " tensors only there")
        specs[key] = (torch.Size(size), props.dtype)
    return specs


def _check_files(folder: Path, metadata) -> None:
    """`CheckpointError` unless every shard file the metadata names is a plain file inside `folder`, holding
    at least the bytes recorded for it (a missing or truncated shard is found before any tensor is read)."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not _DCP_FILE.match(name) or name.endswith((".metadata", ".tmp")):
            raise CheckpointError(f"shard folder {folder}: its metadata names the shard file {name!r}; shard files"
                                  " are named __<rank>_<n>.distcp inside the folder; nothing was read")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"shard folder {folder}: {name} is stored with transforms"
                                  f" {info.transform_descriptors!r}, which deepepochs never writes; nothing was read")
        end = int(info.offset) + int(info.length)
        needed[name] = max(needed.get(name, 0), end)
    for name, end in sorted(needed.items()):
        file = folder / name
        if file.is_symlink() or not file.is_file():
            raise CheckpointError(f"shard folder {folder} is incomplete: its shard file {name} is missing")
        size = file.stat().st_size
        if size < end:
            raise CheckpointError(f"shard folder {folder} is damaged: its shard file {name} holds {size} bytes,"
                                  f" its metadata records data up to byte {end} (a truncated file)")


def read_into(targets: Mapping, folder, distributed: bool) -> None:
    """Fill `targets` (flat key -> tensor, DTensors for this rank's shards) from the shard folder, in place.

    `distributed`: every rank of the process group calls it with its own targets (a collective); else
    this process reads alone (one process, or each DDP rank reading full tensors)."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415 (heavy import)
    from torch.distributed.checkpoint.api import CheckpointException  # noqa: PLC0415
    with warnings.catch_warnings():
        # reading alone is what no_dist asks for; DCP still says it assumes so
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        try:
            dcp.load(dict(targets), storage_reader=_reader(folder), no_dist=not distributed)
        except CheckpointException as e:
            raise CheckpointError(f"cannot read the shards in {folder}: a shard file is damaged"
                                  f" ({_failures(e)})") from e
