"""The checkpoint file format: the `Checkpoint` record, what each key holds, the conversion of
deepepochs 0.6 files, and which callbacks' states the `monitors` key holds.

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
                    run (`deepepochs.utils.rng_state`), and under 'loaders' those of the generators
                    its training DataLoaders were given (their own order, `data_order='loader'`, or a
                    sampler of torch's with replacement, `num_samples`, weights or a subset; absent in
                    files of older versions), and under 'streams' the `state_dict()` of the stateful
                    datasets its training data streams from (`deepepochs.data.streams.epoch_stream`;
                    absent in files of older versions); under DDP `{'ranks': [...]}`, each rank's such dict in
                    rank order (None in files of older versions). Restored on load at the same world
                    size, each rank its own, so a resumed run shuffles and drops out exactly as the
                    uninterrupted one would; on another world size each process keeps its own.
`order_seed`        int or None, the seed of the training order (`deepepochs.data.sampling.DataOrder`):
                    with it, later epochs of a resumed run see the order the uninterrupted run saw,
                    in any process and at any world size. None in files of older versions.
`position`          dict or None: where inside epoch `epoch + 1` a mid-epoch snapshot was taken
                    (`SnapshotCallback`), or a `CheckCallback` file written at a validation point of
                    the update clock: the data position, the task meters, every rank's generator
                    states; see `deepepochs.engine.position`. None at an epoch's end.
`shards`            dict or None: in a sharded checkpoint's `checkpoint.pt`, `{'folder': shard folder
                    name, 'params': per optimizer, its parameters' names in index order}`; `model` is
                    then empty and `optimizers` hold no tensors (they are in the shards). None in a
                    single file.
`param_names`       list or None: per optimizer, its parameters' names (the model's `named_parameters()`)
                    in the index order of its state, so a reordered parameter list loads by name
                    (`deepepochs.checkpoint.names`); None for a parameter the model does not hold. None in
                    files of older versions (mapped by position, with a warning).
`history`           dict or None: the run's records up to `epoch`, `{'train': {name: [per epoch]},
                    'val': {...}}` (floats), so a resumed `fit()` returns the whole run's records.
                    None in files of older versions (the resumed history then starts empty).
                    With `fit(val_every_n_updates=M)` the `val` records hold one row per validation
                    point, its update count in the column `updates`.
`updates`           int, the update windows the run committed (skipped ones included): the update
                    clock (`max_updates`) and the snapshots' count continue from it. 0 in files of
                    older versions (then a `SnapshotCallback`'s recorded count, if any).
`averages`          dict or None: the weight averages (`EMACallback`, `SWACallback`) by their id
                    (`'ema'`, `'swa'`): `{'model': the AveragedModel's state_dict() ('n_averaged',
                    'module.<name>'), 'updates': times averaged, 'epochs': SWALR steps}`, as of the
                    file's commit point. None without one (or in files of older versions). In a
                    sharded folder's `checkpoint.pt` the tensors are in the shards (`average/<id>/<key>`).
`carried`           list or None: per rank in rank order, what the run's steps carry across batches
                    (`trainer.carried`) as of the file's commit point (the epoch's end, or a mid-epoch
                    snapshot's last committed update), each dict stored as a snapshot stores run state
                    (`{'__dict__': {...}}`, tensors on the CPU). Loading gives each rank its own at the
                    same world size, rank 0's on another. None in files of older versions
                    (`trainer.carried` is then left as it is).
`callbacks`         dict or None: the states of the callbacks with `state_dict()` and `load_state_dict()`
                    (not the monitors) by name (class name, `[state_key]` appended when given), as of the
                    file's commit point, each stored as a snapshot stores run state (tensors on the CPU).
                    Loading gives each attached callback its own. None without such callbacks, and in files
                    of older versions (the callbacks are then left as they are).
==================  ==========================================================================

Under `strategy='fsdp'` a checkpoint is a folder of that name instead of a file, written by every rank
without gathering anything (`deepepochs.checkpoint.shard_storage`: `checkpoint.pt` as above, plus the shards in
Distributed Checkpoint format). It loads at any world size, with any strategy and in one process, and
`consolidate(folder, file)` (or `python -m deepepochs consolidate FOLDER FILE`) turns it into the single
file described here.

Files live at `<ckpt_dir>/<running_id>/<monitor file>.ckpt` and contain no absolute paths, so a run
folder (or a whole `ckpt_dir`) can be moved or renamed (how they are written: `deepepochs.checkpoint.write`).

A deepepochs 0.6 file (`{'model_state', 'opt_state', 'best_value', 'epoch'}`) is read too
(`Checkpoint.from_dict` converts it): its weights, its optimizers' and schedulers' states and its epoch
load; 0.6's `best_value` is not carried over (its monitors start afresh).

Monitors are found by duck typing, like gradient clippers: a callback with a `monitor_id` string,
a `ckpt_dir`, `state_dict()` and `load_state_dict(state)` (see `deepepochs.callbacks.check`).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from deepepochs.errors import CheckpointError
from deepepochs.protocols import monitors_in  # re-exported: `from deepepochs.checkpoint import monitors_in`

__all__ = [
    "COMPILED_PREFIX",
    "CONVERT_HINT",
    "FORMAT_VERSION",
    "SUFFIX",
    "Checkpoint",
    "monitors_in",
    "monitors_of",
    "plain_records",
]

FORMAT_VERSION = 3  # the newest version this deepepochs reads (and writes, for sharded checkpoints)
SUFFIX = ".ckpt"
#: What `torch.compile`'s wrapper prefixes its module's keys with; files hold the module's keys.
COMPILED_PREFIX = "_orig_mod."


#: How to write a state of another layout in this format, for the errors that refuse one.
CONVERT_HINT = (" (convert it with torch.save({'format_version': 1, 'epoch': <completed epochs>, 'model':"
                " model.state_dict(), 'optimizers': [optimizer.state_dict()], 'schedulers': [None]}, path);"
                " a deepepochs 0.6 file holds model_state, opt_state and epoch and loads as it is)")


def _non_negative_int(_instance, attribute, value):
    """attrs validator: an int >= 0 (not a bool), else `CheckpointError` naming the key."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"checkpoint key {attribute.name!r} must be a non-negative int (got {value!r})")


def _str(_instance, attribute, value):
    """attrs validator: a str, else `CheckpointError` naming the key and the type found."""
    if not isinstance(value, str):
        raise CheckpointError(f"checkpoint key {attribute.name!r} must be a str (got {type(value).__name__})")


def _mapping(_instance, attribute, value):
    """attrs validator: a mapping, else `CheckpointError` naming the key."""
    if not isinstance(value, Mapping):
        raise CheckpointError(f"checkpoint key {attribute.name!r} must be a dict"
                              f" (got {type(value).__name__})")


def _list(_instance, attribute, value):
    """attrs validator: a list or tuple, else `CheckpointError` naming the key."""
    if not isinstance(value, (list, tuple)):
        raise CheckpointError(f"checkpoint key {attribute.name!r} must be a list"
                              f" (got {type(value).__name__})")


@attrs.define(kw_only=True)
class Checkpoint:
    """The typed contents of a checkpoint file; `to_dict()` is exactly what `torch.save` writes.

    Attributes mirror the file's keys (see the module docstring).
    """

    format_version: int = attrs.field(default=1, validator=_non_negative_int)
    running_id: str = attrs.field(default="", validator=_str)
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
    param_names: list | None = None
    history: Mapping | None = None
    updates: int = attrs.field(default=0, validator=_non_negative_int)
    averages: Mapping | None = None
    carried: list | None = None
    callbacks: Mapping | None = None

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

        A file 0.6.18 wrote after resuming a run holds, in each `sched_state`, the optimizer's `state` and
        `param_groups` too: its resume loaded the optimizer's state into the scheduler (so the scheduler's own
        counters restarted there). Those two keys are the optimizer's, which `opt_state` holds: they are
        dropped, and the scheduler continues from the counters 0.6.18 kept.
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
                schedulers.append(_scheduler_06(item.get("sched_state")))
            else:
                raise CheckpointError(f"{path}: an opt_state entry of the 0.6 checkpoint is neither an optimizer"
                                      f" state nor {{'opt_state', 'sched_state'}} (got {type(item).__name__}){hint}")
        model = data["model_state"]
        if not isinstance(model, Mapping):
            raise CheckpointError(f"{path}: the 0.6 checkpoint's model_state must be a state dict (got"
                                  f" {type(model).__name__}){hint}")
        return cls(epoch=epoch + 1, model=model, optimizers=optimizers, schedulers=schedulers)


def _scheduler_06(state):
    """A 0.6 file's scheduler state without the optimizer's `state` and `param_groups`, which 0.6.18 put
    there at a resume (`Checkpoint.from_06`); any other state as it is."""
    if isinstance(state, Mapping) and {"state", "param_groups"} <= set(state):
        return {k: v for k, v in state.items() if k not in ("state", "param_groups")}
    return state


def monitors_of(trainer) -> list:
    """The trainer's checkpoint monitors, in declaration order."""
    return monitors_in(trainer.callbacks)


def plain_records(records: Mapping) -> dict:
    """`{'train': {name: [...]}, 'val': {...}}` as new lists of floats, ints kept (a validation point's
    update count), what a file may hold."""
    return {stage: {name: [v if type(v) is int else float(v) for v in values] for name, values in metrics.items()}
            for stage, metrics in records.items()}
