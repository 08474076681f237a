"""Optimizer states mapped by parameter name.

torch's `Optimizer.state_dict()` numbers the parameters by their position in the param groups, and
`load_state_dict` maps them back by position. A trainer whose parameter list was reordered since the file
was written (its param groups listed in another order, a model whose modules are registered in another
order) would then get each parameter's moments swapped with another's of the same shape, silently. Every
checkpoint therefore records, per optimizer, its parameters' names (the model's `named_parameters()`) in
index order: the `param_names` key (and, in a sharded checkpoint, `shards['params']`, which names the
tensors in the shards). On load `by_name` puts the file's states and param groups into this trainer's
order; a file whose names are not this trainer's (renamed or other parameters, or the same parameters in
other groups) is refused, naming them. A file written before names were recorded is mapped by position,
with a `DeepEpochsWarning` saying so.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import attrs

from deepepochs.checkpoint.format import Checkpoint
from deepepochs.errors import CheckpointError, DeepEpochsWarning

__all__ = ["by_name", "param_names", "saved_names", "warn_positional"]


def param_names(trainer) -> list[list[str | None]]:
    """Per optimizer (in `optimize_index` order), its parameters' names in `state_dict()` index order; None
    for a parameter the model does not hold (a loss's own parameter, say)."""
    names = {id(p): name for name, p in trainer.raw_model.named_parameters()}
    return [[names.get(id(p)) for group in item.opt.param_groups for p in group["params"]]
            for item in trainer.opt.items]


def saved_names(ckpt: Checkpoint, path) -> list | None:
    """The file's parameter names per optimizer (`param_names`, else a sharded checkpoint's `shards['params']`),
    or None for a file written before they were recorded; `CheckpointError` when they are damaged."""
    names = ckpt.param_names
    field = "param_names"
    if names is None and isinstance(ckpt.shards, Mapping):
        names, field = ckpt.shards.get("params"), "shards['params']"
    if names is None:
        return None
    ok = (isinstance(names, list) and len(names) == len(ckpt.optimizers)
          and all(isinstance(order, list) and all(n is None or isinstance(n, str) for n in order) for order in names))
    if not ok:
        raise CheckpointError(f"checkpoint {path}: field {field!r} must be a list of one list of parameter names"
                              f" (str) per optimizer ({len(ckpt.optimizers)} here) (got {_described(names)})")
    return names


def _described(value) -> str:
    if isinstance(value, list):
        inner = sorted({type(v).__name__ for v in value})
        return f"a list of {len(value)} ({', '.join(inner) or 'empty'})"
    return type(value).__name__


def warn_positional(ckpt: Checkpoint, path) -> None:
    """A `DeepEpochsWarning` when `ckpt` records no parameter names but optimizer states (a file of an older
    deepepochs or of other code): they load by position, as torch maps them."""
    if ckpt.param_names is not None or (isinstance(ckpt.shards, Mapping) and ckpt.shards.get("params") is not None):
        return
    if any(isinstance(s, Mapping) and (s.get("state") or len(s.get("param_groups") or ()) > 1)
           for s in ckpt.optimizers):
        warnings.warn(f"checkpoint {path} records no parameter names (it was written by an older deepepochs or"
                      " by other code): its optimizer states are mapped to the parameters by position, as torch"
                      " does; if the parameter list was reordered since, parameters get each other's states."
                      " Save it again with this deepepochs to map them by name", DeepEpochsWarning, stacklevel=3)


def by_name(trainer, ckpt: Checkpoint, path) -> Checkpoint:
    """`ckpt` with each optimizer's state and param groups in this trainer's parameter order (see the
    module docstring); unchanged when it records no names (`warn_positional`). `CheckpointError` names
    the parameters when the file's are not this trainer's."""
    saved = saved_names(ckpt, path)
    if saved is None:
        return ckpt
    live = param_names(trainer)
    if len(live) != len(saved):
        return ckpt  # the fit check reports the optimizer count
    states = list(ckpt.optimizers)
    for i, (have, had) in enumerate(zip(live, saved)):
        if have == had or None in have or None in had or len(set(have)) < len(have) or len(set(had)) < len(had):
            continue  # the same order, or names that cannot map (unnamed or shared parameters): by position
        kind = type(trainer.opt.items[i].opt).__name__
        missing, unexpected = sorted(set(have) - set(had)), sorted(set(had) - set(have))
        if missing or unexpected:
            raise CheckpointError(
                f"checkpoint {path}: optimizer {i} ({kind}) holds the states of parameters {unexpected[:5]}, which"
                f" this model does not have, and lacks {missing[:5]}, which it has (renamed or other parameters);"
                " nothing was loaded. Rename the parameters back, or load the weights alone"
                " (checkpoint.load_model_state(trainer, checkpoint.read_weights(trainer, path).model))")
        states[i] = _reordered(states[i], had, trainer.opt.items[i].opt.param_groups, have, path, i, kind)
    return attrs.evolve(ckpt, optimizers=states, param_names=[list(order) for order in live])


def _reordered(state, had: list[str], live_groups, have: list[str], path, i: int, kind: str):
    """One optimizer's `state_dict()` whose parameters are named `had` (in index order) renumbered to the
    live order `have`, its param groups matched to the live groups by the parameters they hold."""
    if not isinstance(state, Mapping) or not isinstance(state.get("param_groups"), list):
        return state  # damaged: the field rules say how
    groups = state["param_groups"]
    if not all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups):
        return state  # damaged: the field rules say how
    flat = [pid for g in groups for pid in g["params"]]
    plain = all(isinstance(pid, int) and not isinstance(pid, bool) for pid in flat) and len(set(flat)) == len(flat)
    if not plain or len(flat) != len(had):
        return state  # damaged (the field rules say how), or another parameter count (the fit check says so)
    name_of = dict(zip(flat, had))
    index = {name: k for k, name in enumerate(have)}
    by_members = {frozenset(name_of[pid] for pid in g["params"]): g for g in groups}
    new_groups, offset = [], 0
    for j, live in enumerate(live_groups):
        members = have[offset:offset + len(live["params"])]
        offset += len(live["params"])
        group = by_members.get(frozenset(members))
        if group is None:
            raise CheckpointError(
                f"checkpoint {path}: optimizer {i} ({kind}) param group {j} holds parameters {members[:5]} here,"
                " but no param group of the file holds exactly those (the parameters were regrouped); nothing was"
                " loaded")
        new_groups.append({**group, "params": [index[name] for name in members]})
    saved_state = state.get("state")
    new_state = saved_state
    if isinstance(saved_state, Mapping):
        new_state = {index[name_of[pid]] if _hashable(pid) and pid in name_of else pid: value
                     for pid, value in saved_state.items()}
    return {**state, "state": new_state, "param_groups": new_groups}


def _hashable(value) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
