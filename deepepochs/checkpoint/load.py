"""Loading a checkpoint into a trainer, all or nothing: the fit check against the trainer, then
the load transaction (a backup of the trainer's state, applied back when anything fails), and the model
state loading that `CheckCallback`'s test swap uses too.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path

import attrs
import torch

from deepepochs.checkpoint import field_rules, names
from deepepochs.checkpoint.format import COMPILED_PREFIX, Checkpoint, monitors_of, plain_records
from deepepochs.checkpoint.optimizer_rules import whole_state
from deepepochs.checkpoint.read import _read_shards, read_checkpoint
from deepepochs.checkpoint.write import _header, generator_states
from deepepochs.engine import buffers, callback_states, carried, loader_starts, position, runstate
from deepepochs.errors import CheckpointError
from deepepochs.parallel.ddp import is_dtensor
from deepepochs.utils import set_rng_state

__all__ = [
    "check_fits",
    "copied_to_cpu",
    "load_averages",
    "load_into",
    "load_model_state",
]

# Prefixes a wrapped model adds to parameter names: torch.compile's OptimizedModule and DDP.
_WRAPPER_PREFIXES = (COMPILED_PREFIX, "module.")


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
        trainer.dist.load_model_state_dict(model, state)
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
    """A state entry's shape for the fit check: a tensor's shape, else its type's name."""
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def check_fits(trainer, ckpt: Checkpoint, path) -> None:
    """Raise `CheckpointError` (naming `path` and every mismatch found) unless `ckpt` can be loaded into
    `trainer` whole: model keys and shapes, the number of optimizers, each optimizer's kind (its param
    groups' hyper-parameter names), group and parameter counts and per-parameter state shapes, each
    scheduler's kind (its state's keys), and every field's rule (`field_rules`: types, ranges, finiteness, the
    same keys and hyper-parameter types as the trainer's own states, each optimizer state's shape). The
    optimizer states are compared in the trainer's parameter order (`names.by_name`). Loading checks first
    and changes nothing when this raises."""
    try:
        try:
            mapped = names.by_name(trainer, ckpt, path)
        except CheckpointError:
            if not _model_problems(trainer, ckpt):
                raise
            mapped = ckpt  # the file is of another model: that is what the message says
        problems = _problems(trainer, mapped, path)
    except CheckpointError:
        raise
    except Exception as e:  # a damaged field the checks did not foresee: still the file's fault, named
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"checkpoint {path} could not be checked against this trainer ({type(e).__name__}:"
                              f" {first}); nothing was loaded") from e
    if problems:
        raise CheckpointError(f"checkpoint {path} does not fit this trainer; nothing was loaded: "
                              + "; ".join(problems))


def _model_problems(trainer, ckpt: Checkpoint) -> list[str]:
    """How the file's model state differs from the trainer's: keys and shapes."""
    problems = []
    model_state = trainer.raw_model.state_dict()
    saved = _unwrap_keys(ckpt.model, set(model_state))
    missing, unexpected = sorted(set(model_state) - set(saved)), sorted(set(saved) - set(model_state))
    if missing or unexpected:
        problems.append(f"model keys differ (missing {missing[:5]}, unexpected {unexpected[:5]})")
    problems += [f"model {k}: shape {_shape(saved[k])} in the file, {_shape(v)} in the model"
                 for k, v in model_state.items() if k in saved and _shape(saved[k]) != _shape(v)]
    return problems


def _problems(trainer, ckpt: Checkpoint, path) -> list[str]:
    """`check_fits`'s findings, `ckpt` already in the trainer's parameter order."""
    problems = _model_problems(trainer, ckpt)
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
        if not any(p.startswith(f"optimizer {i} ") for p in problems) and not whole_state(item.opt):
            params = [p for h in have for p in h["params"]]
            ids = [pid for g in groups for pid in g.get("params", ())]
            for pid, param in zip(ids, params):
                if isinstance(pid, bool) or not isinstance(pid, int):
                    continue  # the field rules name a damaged index
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
    if not problems:  # the file has this trainer's layout: now every field's rule
        problems += field_rules.problems(trainer, ckpt)
    return problems


def load_into(trainer, path, ckpt: Checkpoint | None = None, trusted: bool = False) -> Checkpoint:
    """Restore everything a checkpoint holds into `trainer` (model, optimizers, schedulers, scaler,
    completed epoch, monitors, and the generator states of a run of the same world size: each rank its own); the
    trainer's running id is left alone.

    Monitors absent from the file keep their state; states of monitors the trainer lacks are ignored.
    `trusted` is `read_checkpoint`'s. The file is checked against the trainer first (`check_fits`): a
    mismatch raises `CheckpointError` before anything is changed.
    """
    path = Path(path)
    ckpt = read_checkpoint(path, trusted) if ckpt is None else ckpt
    check_fits(trainer, ckpt, path)  # all or nothing: every mismatch is found before anything changes
    names.warn_positional(ckpt, path)
    backup = _backup(trainer)  # and what check_fits cannot foresee (a damaged scaler or monitor state)
    run = trainer.loop.run
    run_backup = runstate.capture(run)  # the run state (history, position, random state) as well
    carried_backup = carried.copied(trainer.carried)  # and the dict the steps hold, as it is (storable or not)
    try:
        if ckpt.shards is not None:
            ckpt = _read_shards(ckpt, path, trainer)
            check_fits(trainer, ckpt, path)  # the tensors themselves now (finite optimizer states)
        ckpt = names.by_name(trainer, ckpt, path)
        _apply(trainer, ckpt, path)
        run.buffers = None  # the loaded model's buffers are the next fit's start
        run.grads = None  # and it starts without gradients (a mid-epoch snapshot's kept ones come back below)
        if ckpt.position is not None:  # a mid-epoch snapshot: the next fit continues inside its epoch
            position.restore(run, ckpt.position, trainer.dist.rank, trainer.device, trainer.world_size)
            # this rank's buffers at the snapshot's commit point (non-persistent ones too); the fit takes them
            buffers.write(trainer.raw_model, run.buffers)
            run.buffers = None
    except BaseException as exc:
        _apply(trainer, backup, "<the state before loading>")
        runstate.restore(run, run_backup)
        carried.write(trainer.carried, carried_backup)
        if isinstance(exc, CheckpointError):
            raise
        first_line = (str(exc).strip().splitlines() or [""])[0]
        raise CheckpointError(f"checkpoint {path} could not be loaded ({type(exc).__name__}: {first_line});"
                              " nothing was changed") from exc
    loop = trainer.loop
    loop.completed_epochs = ckpt.epoch
    loop.epoch = ckpt.epoch
    loop.stop = None
    run.updates = ckpt.updates or _recorded_updates(ckpt)
    if ckpt.position is None:
        loop.resume = None  # an interrupted epoch's resume point belongs to the weights we just replaced
        run.random_restore_due, run.random_replay = False, None  # and so do the generators a refit restores
        run.loader_starts = loader_starts.at_epoch_end(run, ckpt.epoch, run.updates)
    return ckpt


def _recorded_updates(ckpt: Checkpoint) -> int:
    """A file of an older version has no `updates`: the count a `SnapshotCallback` recorded in it, else 0."""
    counts = [s.get("updates") for s in ckpt.monitors.values() if isinstance(s, Mapping)]
    return max((c for c in counts if isinstance(c, int) and not isinstance(c, bool)), default=0)


def _own_generator_states(trainer, rng: Mapping | None) -> Mapping | None:
    """This process's generator states in a file's `rng`: a one-process file's in one process, rank r's of a
    DDP file on rank r at the same world size; None on another world size (each process keeps its own)."""
    if rng is None:
        return None
    ranks = rng.get("ranks")
    if ranks is None:
        return rng if trainer.world_size == 1 else None
    return ranks[trainer.dist.rank] if len(ranks) == trainer.world_size else None


def _backup(trainer) -> Checkpoint:
    """The trainer's state as an independent `Checkpoint` (tensors copied, the weights to the CPU; under
    FSDP each rank's shards, copied where they are)."""
    backup = _header(trainer, None, copied_to_cpu(trainer.raw_model.state_dict()),
                     copy.deepcopy(trainer.opt.state_dict()), generator_states(trainer, gather=False), None)
    return attrs.evolve(backup, scaler=copy.deepcopy(backup.scaler), monitors=copy.deepcopy(backup.monitors),
                        callbacks=copy.deepcopy(backup.callbacks))


def load_averages(trainer, saved) -> None:
    """The weight averages the trainer holds (`RunState.averages`) take `saved` (a file's `averages`, or
    what `copy.deepcopy(trainer.loop.run.averages)` kept), written into the averaged modules' own tensors;
    one `saved` lacks stays as it is, one the trainer lacks is ignored."""
    live = trainer.loop.run.averages
    if saved and live:
        for average_id, state in saved.items():
            if average_id in live:
                runstate.write_in_place(live[average_id], _as_shards(live[average_id], state))


def _as_shards(live: Mapping, saved: Mapping) -> Mapping:
    """`saved` with each full tensor cut to this rank's shard where the live average holds a DTensor (a
    single file loaded under FSDP: every rank read the whole file, so each keeps its part, no collective)."""
    model, own = saved.get("model"), live.get("model") or {}
    if not isinstance(model, Mapping) or not any(is_dtensor(v) for v in own.values()):
        return saved
    from torch.distributed.tensor import distribute_tensor  # noqa: PLC0415 (heavy import, FSDP runs only)

    def cut(key, value):
        now = own.get(key)
        if not is_dtensor(now) or is_dtensor(value) or not isinstance(value, torch.Tensor):
            return value
        return distribute_tensor(value.to(now.device), now.device_mesh, now.placements, src_data_rank=None)
    return {**saved, "model": {key: cut(key, value) for key, value in model.items()}}


def _apply(trainer, ckpt: Checkpoint, path) -> None:
    """Load `ckpt`'s model, optimizers, schedulers, scaler, monitors, weight averages, carried state, callbacks'
    states and (same
    world size) generator states."""
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
    load_averages(trainer, ckpt.averages)
    # what the steps carry across batches, as of the file's commit point (every kind of file: one path)
    carried.load(trainer.carried, ckpt.carried, trainer.dist.rank, trainer.world_size, trainer.device)
    callback_states.load(callback_states.stateful(trainer.callbacks), ckpt.callbacks, trainer.device)
    if ckpt.order_seed is not None:  # the training order continues as it was (`sampling.DataOrder`)
        trainer.dist.order_seed = ckpt.order_seed
    rng = _own_generator_states(trainer, ckpt.rng)
    if rng is not None:
        try:
            set_rng_state(rng)
            trainer.dist.continue_loader_generators(list(rng.get("loaders") or []))
            trainer.dist.continue_streams(list(rng.get("streams") or []))
        except (KeyError, TypeError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"checkpoint {path}: the random generator states do not fit: {e!r}") from e
