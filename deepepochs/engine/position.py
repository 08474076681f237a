"""A training position inside an epoch, as stored in a snapshot, and put back on resume.

A mid-epoch snapshot is taken at a commit point (a committed window's update). What a fit needs to
continue from there, besides the training state every checkpoint holds:

==================  ==========================================================================
`epoch`             int, the 1-based epoch in progress (the file's `epoch` key counts completed ones).
`task_index`        int, the training task in progress (0-based).
`batches_done`      int, that task's batches whose windows were committed (the data position: a
                    seeded-order DataLoader skips them at the sampler, `sampling.skip_batches`).
`world_size`        int, processes that trained (every rank ran `batches_done` batches of its shard).
`batch_size`        int or None, the task's per-rank DataLoader batch size (None: not a DataLoader).
`samples_done`      int or None, samples the task consumed over all ranks (`batches_done` x
                    `batch_size` x `world_size`): the global position another world size continues at.
`ranks`             list, per rank: `{'meters': per training task of the stage so far, its loss sums
                    and metric patches (`encode_meters`), so the epoch's metrics cover the batches
                    before the resume; 'random': {'commit': torch's generator states at the commit
                    point, 'task': those just before the task made its data iterator, 'host':
                    Python's, NumPy's and torch's generators when the snapshot was written (a
                    dropped window's draws rewound: `generators.put_back_host_state`)},
                    (`generators.random_state`), so dropout and DataLoader worker seeds replay exactly;
                    'data': a stateful DataLoader's `state_dict()` at the commit point, or None;
                    'run': the run state's fields stored as they are (`runstate.GENERIC`: those
                    the rest of the file does not hold), by name}`.
==================  ==========================================================================

Everything is tensors, numbers, strings, lists, dicts and None (`torch.load(weights_only=True)`). A metric
patch is stored as its class's name and its attributes; its metric function is not stored but taken
from the task's metric of the same name when the snapshot is loaded. A patch class is found among the
`PatchBase` subclasses already defined (nothing is imported from a name in a file).
"""

from __future__ import annotations

import hashlib
import sys
import warnings

import attrs
import torch

from deepepochs.engine import generators, runstate
from deepepochs.engine.context import Context, ResumePoint
from deepepochs.engine.runstate import RunState
from deepepochs.errors import CheckpointError, DeepEpochsWarning
from deepepochs.patches import PatchBase
from deepepochs.tasks import TaskMeters
from deepepochs.utils import rng_state, set_rng_state

__all__ = ["capture", "check", "check_data", "check_point", "decode", "decode_meters", "encode", "encode_meters",
           "restore"]

#: Modules that held a stored class before the package layout moved them: a snapshot written before the
#: move names the old module, which is read as the new one.
_MOVED_MODULES = {"deepepochs.confusion": "deepepochs.patches.confusion",
                  "deepepochs.streaming": "deepepochs.patches.streaming"}


class _Unstorable(TypeError):
    """A value a snapshot cannot hold with `weights_only=True` (names what it is)."""


def capture(ctx: Context) -> dict | None:
    """The mid-epoch position of the last commit point, or None at an epoch's end (the file's epoch count
    says it all). After the epoch's training stage (a stop in its validation) that is the last training
    task's end: a resume skips all its batches and validates next. At a validation point of the update
    clock (its files: `save_checkpoints`) it is the point's update, with torch's generators as the
    validation left them (what `commit_val_point` keeps): the resume does not validate that point again.
    Under DDP a collective: every rank's meters and random states are gathered (every rank calls it at the
    same commit point)."""
    loop, dist = ctx.loop, ctx.parts.dist
    point = loop.resume
    batch_size = getattr(getattr(ctx.task, "data", None), "batch_size", None)
    if point is not None and point.task_index < 0 and point.trained is not None:
        # the training stage is done (a stop during validation): its last commit point is the last task's end
        index, done, batch_size = point.trained
        point = ResumePoint(point.epoch, index, done)
    if point is None or point.task_index < 0 or ctx.train_meters is None:
        return None
    data_state = ctx.data_state
    # a validated point: torch's generators as its validation left them; else those of the last commit point
    commit = (generators.random_state(ctx) if runstate.val_point_validated(loop, ctx.last_metrics)
              else ctx.random_state)
    mine = {"random": {"commit": _states(commit), "task": _states(ctx.task_random_state),
                       "host": rng_state()},  # Python's and NumPy's (and torch's) as of now: the commit point
            "meters": [encode_meters(meters) for meters in ctx.train_meters],
            "data": None if data_state is None or data_state[:3] != (point.epoch, point.task_index, point.batches_done)
            else data_state[3],
            "run": _encode_run(ctx.run)}
    ranks = dist.all_gather_object(mine) if dist.world_size > 1 else [mine]
    samples = None if not isinstance(batch_size, int) else point.batches_done * batch_size * dist.world_size
    return {"epoch": int(point.epoch), "task_index": int(point.task_index),
            "batches_done": int(point.batches_done), "world_size": int(dist.world_size),
            "batch_size": batch_size if isinstance(batch_size, int) else None, "samples_done": samples,
            "ranks": ranks}


def check(position, world_size: int, path) -> None:
    """Raise `CheckpointError` (naming `path`) when a stored position cannot continue here."""
    keys = {"epoch", "task_index", "batches_done", "world_size", "ranks"}
    if not isinstance(position, dict) or not keys <= set(position):
        raise CheckpointError(f"{path}: the snapshot's position is damaged (got {type(position).__name__})")
    bad = [f"{key}={position[key]!r}" for key, least in (("epoch", 1), ("task_index", 0), ("batches_done", 0),
                                                         ("world_size", 1))
           if isinstance(position[key], bool) or not isinstance(position[key], int) or position[key] < least]
    samples = position.get("samples_done")
    if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 0):
        bad.append(f"samples_done={samples!r}")
    if bad or not isinstance(position["ranks"], list):
        raise CheckpointError(f"{path}: the snapshot's position is damaged ({', '.join(bad) or 'ranks'}: epoch and"
                              " world_size must be ints >= 1, task_index, batches_done and samples_done ints >= 0)")
    saved = position["world_size"]
    if saved != world_size and any(r.get("data") is not None for r in position["ranks"]):
        raise CheckpointError(
            f"{path} is a mid-epoch snapshot of {saved} process(es) whose training data is a stateful DataLoader;"
            f" its position cannot be carried to {world_size}: resume it with {saved} process(es), or from an"
            " epoch-end checkpoint")
    if saved != world_size and position.get("samples_done") is None:
        raise CheckpointError(
            f"{path} is a mid-epoch snapshot of {saved} process(es) whose training data has no batch size (not"
            f" a DataLoader), so its position cannot be carried to {world_size}; resume it with {saved}"
            " process(es), or from an epoch-end checkpoint")


def check_data(position: dict, tasks, world_size: int, path) -> None:
    """Raise `CheckpointError` (naming `path`) when the stored position (checked by `check`) lies outside
    this fit's training data: a task it does not have, or more batches than its task has here (a smaller
    dataset, a larger batch size); continuing would silently skip the rest of that epoch."""
    samples = position.get("samples_done") if position["world_size"] != world_size else None
    point = ResumePoint(position["epoch"], position["task_index"], position["batches_done"], samples)
    check_point(point, tasks, world_size, f"{path} is a mid-epoch snapshot whose position")


def check_point(point: ResumePoint, tasks, world_size: int, what: str = "the mid-epoch position loaded") -> None:
    """Raise `CheckpointError` when the resume point `point` (a task in progress) lies outside `tasks`."""
    if point.task_index >= len(tasks):
        raise CheckpointError(f"{what} is in training task {point.task_index}, but this fit has {len(tasks)}"
                              " training task(s); resume with the data the snapshot was taken with, or from an"
                              " epoch-end checkpoint")
    data = tasks[point.task_index].data
    try:
        length = len(data)
    except TypeError:  # no length (an IterableDataset, a generator): the data says when it ends
        return
    done, unit = point.batches_done, "batches"
    if point.samples is not None:  # another world size: the global sample count, in this rank's batches
        batch_size = getattr(data, "batch_size", None) or 1
        done, unit = point.samples // (batch_size * world_size), "batches (from its sample count)"
    if done > length:
        raise CheckpointError(f"{what} is after {done} {unit} of training task {point.task_index}, which has"
                              f" {length} batches here (a smaller dataset or a larger batch size?); continuing"
                              " would skip the rest of that epoch. Resume with the data the snapshot was taken"
                              " with, or from an epoch-end checkpoint")


def restore(run: RunState, position: dict, rank: int, device: torch.device, world: int) -> None:
    """Make the next fit continue at `position` (checked by `check`): write into the run state `run` (of
    rank `rank` of `world` processes training on `device`) the epoch's resume point, its task meters, the
    fields stored as they are (`runstate.GENERIC`), and set this rank's generators as of the commit point.

    On another world size the global data position carries over (`ResumePoint.samples`,
    turned into this run's batches when the task starts), rank 0 continues the meters of all saved ranks
    merged (the epoch's metrics stay global), and the generators are re-derived from (epoch, position,
    rank), with a `DeepEpochsWarning`: dropout then differs from an uninterrupted run's."""
    ranks = position["ranks"]
    point = ResumePoint(position["epoch"], position["task_index"], position["batches_done"])
    if position["world_size"] == world:
        own = ranks[rank]
        meters = [decode_meters(state, device) for state in own["meters"]]
        commit, task = _tuple(own["random"]["commit"]), _tuple(own["random"].get("task"))
        if own.get("data") is not None:
            run.data_state = (point.epoch, point.task_index, point.batches_done, own["data"])
        if own["random"].get("host") is not None:
            set_rng_state(own["random"]["host"])  # Python, NumPy (torch is set from `commit` below)
    else:
        point.samples = position["samples_done"]
        tasks = len(ranks[0]["meters"])
        meters = [_merged([decode_meters(r["meters"][i], device) for r in ranks]) if rank == 0 else TaskMeters()
                  for i in range(tasks)]
        commit = task = _derived_random_state(device, position, rank)
        warnings.warn(f"resuming a mid-epoch snapshot of {position['world_size']} process(es) on {world}: the"
                      " random generators are re-derived from (epoch, position, rank), so dropout and other"
                      " random draws differ from an uninterrupted run's from here on", DeepEpochsWarning,
                      stacklevel=2)
    _restore_run(run, (ranks[rank] if position["world_size"] == world else ranks[0]).get("run"), device)
    run.resume = point
    run.train_meters = meters
    run.random_state = commit
    run.random_replay = (task, commit)
    run.random_restore_due = False
    if commit is not None:
        generators.set_generators(device, commit)


def _encode_run(run) -> dict:
    """The run state's fields no other part of a snapshot holds (`runstate.generic_fields`), as plain data;
    one that cannot be stored is left out with a `DeepEpochsWarning`."""
    out = {}
    for name in runstate.generic_fields(run):
        try:
            out[name] = encode(getattr(run, name))
        except _Unstorable as e:
            warnings.warn(f"a snapshot cannot store the run state's {name!r} ({e}); a resume keeps that field as"
                          " it is in the resuming trainer", DeepEpochsWarning, stacklevel=3)
    return out


def _restore_run(run, stored: dict | None, device: torch.device) -> None:
    """Put back what `_encode_run` stored (on another world size, rank 0's); fields this run state does not
    have are ignored, and fields the snapshot lacks (an older snapshot) keep their value."""
    names = set(runstate.generic_fields(run))
    for name, value in (stored or {}).items():
        if name in names:
            setattr(run, name, decode(value, device))


def _merged(parts: list[TaskMeters]) -> TaskMeters:
    """One task's meters of several ranks as one (loss sums, counts and patches added, in rank order)."""
    merged = parts[0]
    for other in parts[1:]:
        if other.loss_sum is not None:
            merged.loss_sum = other.loss_sum if merged.loss_sum is None else merged.loss_sum + other.loss_sum
        merged.host_sum += other.host_sum
        merged.host = merged.host if merged.host is not None else other.host
        merged.count += other.count
        merged.skipped = max(merged.skipped, other.skipped)  # every rank skipped the same updates
        merged.fold_patches(other.patches)
    return merged


def _derived_random_state(device: torch.device, position: dict, rank: int) -> tuple:
    """torch's generator states seeded from (epoch, global position, rank): the same on every resume."""
    key = f"deepepochs/{int(position['epoch'])}/{int(position['samples_done'] or 0)}/{rank}".encode()
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little") % 2**62
    cpu = torch.Generator().manual_seed(seed).get_state()
    gpu = None
    if device.type == "cuda":
        generator = torch.Generator(device=device).manual_seed(seed)
        gpu = generator.get_state()
    return cpu, gpu


def _states(state):
    return None if state is None else [None if s is None else generators.state_tensor(s) for s in state]


def _tuple(state):
    return None if state is None else tuple(state)


# ---- task meters -----------------------------------------------------------------------------------------
def encode_meters(meters: TaskMeters) -> dict:
    """A committed task's loss sums and metric patches as plain data. A patch holding something a
    snapshot cannot store is left out with a `DeepEpochsWarning` (after a resume its metric covers only
    the batches after the snapshot)."""
    patches = {}
    for name, patch in meters.patches.items():
        try:
            patches[name] = _encode_patch(patch)
        except _Unstorable as e:
            warnings.warn(f"a snapshot cannot store the partial epoch state of metric {name!r} ({e}); after a"
                          " mid-epoch resume that metric covers only the batches after the snapshot",
                          DeepEpochsWarning, stacklevel=2)
    loss_sum = meters.loss_sum
    return {"loss_sum": None if loss_sum is None else loss_sum.detach().cpu(), "host_sum": float(meters.host_sum),
            "host": meters.host, "count": int(meters.count), "skipped": int(meters.skipped), "patches": patches}


def decode_meters(state: dict, device: torch.device) -> TaskMeters:
    """`TaskMeters` from `encode_meters` output, tensors on `device`; its patches get their metric
    functions when the resumed task adopts them (`continuation._adopt`)."""
    meters = TaskMeters()
    loss_sum = state["loss_sum"]
    meters.loss_sum = None if loss_sum is None else loss_sum.to(device)
    meters.host_sum, meters.host = state["host_sum"], state["host"]
    meters.count, meters.skipped = state["count"], state.get("skipped", 0)
    meters.patches = {name: _decode_patch(patch, device) for name, patch in state["patches"].items()}
    return meters


def _encode_patch(patch: PatchBase) -> dict:
    cls = type(patch)
    fields, callables = {}, []
    for key, value in vars(patch).items():
        if callable(value) and not isinstance(value, torch.Tensor):
            callables.append(key)
        else:
            fields[key] = encode(value)
    if set(callables) - {"metric"}:
        raise _Unstorable(f"its {', '.join(sorted(set(callables) - {'metric'}))} attribute holds a function")
    return {"class": f"{cls.__module__}:{cls.__qualname__}", "fields": fields, "callables": callables}


def _decode_patch(state: dict, device: torch.device) -> PatchBase:
    cls = _patch_class(state["class"])
    patch = cls.__new__(cls)
    patch.__dict__.update({key: decode(value, device) for key, value in state["fields"].items()})
    patch.__dict__.update(dict.fromkeys(state["callables"]))  # filled in by the resumed task (`_adopt`)
    return patch


def _patch_class(name: str) -> type:
    # The module the name gives first: a class it re-exports resolves too (`deepepochs.patches:TensorPatch`,
    # as files written before deepepochs.patches became a package name it).
    module, _, qualname = name.partition(":")
    module = _MOVED_MODULES.get(module, module)
    name = f"{module}:{qualname}"
    found = getattr(sys.modules.get(module), qualname, None)
    if isinstance(found, type) and issubclass(found, PatchBase):
        return found
    todo, seen = [PatchBase], set()
    while todo:
        cls = todo.pop()
        if f"{cls.__module__}:{cls.__qualname__}" == name:
            return cls
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                todo.append(sub)
    raise CheckpointError(f"the snapshot holds a metric patch of class {name}, which is not defined in this"
                          " process (import the module that defines it before resuming)")


def encode(value):
    """`value` as what `torch.load(weights_only=True)` reads back as it was: tensors on the CPU, tuples as
    `{'__tuple__': [...]}`, str-keyed dicts as `{'__dict__': {...}}`, attrs records by class name and fields;
    `_Unstorable` (a `TypeError`) names anything else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu() if value.device.type != "meta" else value
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"__dict__": {k: encode(v) for k, v in value.items()}}
    if attrs.has(type(value)):
        cls = type(value)
        return {"__attrs__": f"{cls.__module__}:{cls.__qualname__}",
                "fields": {f.name: encode(getattr(value, f.name)) for f in attrs.fields(cls)}}
    raise _Unstorable(f"a {type(value).__name__} value")


def decode(value, device: torch.device):
    """What `encode` stored, tensors moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, list):
        return [decode(v, device) for v in value]
    if isinstance(value, dict):
        if "__tuple__" in value:
            return tuple(decode(v, device) for v in value["__tuple__"])
        if "__dict__" in value:
            return {k: decode(v, device) for k, v in value["__dict__"].items()}
        if "__attrs__" in value:
            module, _, qualname = value["__attrs__"].partition(":")
            cls = getattr(sys.modules.get(_MOVED_MODULES.get(module, module)), qualname, None)
            if cls is None or not attrs.has(cls):
                raise CheckpointError(f"the snapshot holds a {value['__attrs__']} record, which is not defined in"
                                      " this process")
            return cls(**{k: decode(v, device) for k, v in value["fields"].items()})
    return value
