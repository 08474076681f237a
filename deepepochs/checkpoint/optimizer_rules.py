"""The rules of the optimizer states a checkpoint holds, checked before anything is applied.

Each optimizer's `state_dict()` must have the trainer's param groups (hyper-parameters like the trainer's,
`deepepochs.checkpoint.value_rules.like`, learning rates a step can take, parameter indices in order) and a
per-parameter state compared with what the same optimizer keeps for a parameter (the trainer's own state
when it has stepped, else that of a throwaway copy of the optimizer stepped once on a small stand-in
parameter): the same state names, and each tensor of its parameter's shape where the optimizer keeps one
of the parameter's shape, 0-d where it keeps a scalar, finite.

LBFGS keeps no per-parameter state: its whole state (counters, the search direction, the curvature history)
sits under its first parameter, with vectors over all of its parameters flattened (`whole_state`). Its
entries are checked for what they are (`_lbfgs_state`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import torch

from deepepochs.checkpoint.format import Checkpoint
from deepepochs.checkpoint.value_rules import MAX_LR, got, in_range, is_number, like

__all__ = ["optimizer_problems", "whole_state"]

#: Param-group keys a file of another torch version may lack or add; torch fills in what is missing.
_OPTIONAL_GROUP_KEYS = {"differentiable", "foreach", "fused", "capturable", "maximize", "decoupled_weight_decay",
                        "initial_lr", "param_names"}

def whole_state(opt) -> bool:
    """Whether `opt` keeps one state for the whole optimizer under its first parameter (LBFGS), not a state
    per parameter of that parameter's shape."""
    return isinstance(opt, torch.optim.LBFGS)


def optimizer_problems(trainer, ckpt: Checkpoint, out: list) -> None:
    """Adds to `out` every way the optimizer states of `ckpt` break the rules against `trainer`'s optimizers."""
    items = trainer.opt.items
    if len(ckpt.optimizers) != len(items):
        return  # the fit check reports the count
    for i, (item, state) in enumerate(zip(items, ckpt.optimizers)):
        field = f"optimizers[{i}]"
        opt = item.opt
        if not isinstance(state, Mapping) or set(state) != {"state", "param_groups"}:
            out.append(f"{field} must be an optimizer's state_dict(), a dict of 'state' and 'param_groups' (got"
                       f" {got(state) if not isinstance(state, Mapping) else sorted(map(str, state))})")
            continue
        groups = state["param_groups"]
        if not isinstance(groups, (list, tuple)) or len(groups) != len(opt.param_groups):
            out.append(f"{field}['param_groups'] must be a list of {len(opt.param_groups)} (got {got(groups)})")
            continue
        count = 0
        for j, (group, live) in enumerate(zip(groups, opt.param_groups)):
            where = f"{field}['param_groups'][{j}]"
            if not isinstance(group, Mapping):
                out.append(f"{where} must be a dict (got {got(group)})")
                continue
            keys, want = set(group) - {"params"}, set(live) - {"params"}
            if (keys ^ want) - _OPTIONAL_GROUP_KEYS:
                continue  # another optimizer's state: the fit check names it
            before = len(out)
            for key in sorted(keys & want, key=str):
                like(group[key], live[key], f"{where}[{key!r}]", out, key)
            _rate(group, where, out)
            if len(out) == before:
                _steps(opt, j, {k: v for k, v in group.items() if k != "params"}, where, out)
            params = group.get("params")
            wanted = list(range(count, count + len(live["params"])))
            if not isinstance(params, list) or params != wanted:
                out.append(f"{where}['params'] must be the parameter indices {_span(wanted)} (got {got(params)})")
            count += len(live["params"])
        per_param = state["state"]
        if not isinstance(per_param, Mapping):
            out.append(f"{field}['state'] must be a dict (got {got(per_param)})")
            continue
        params = [p for g in opt.param_groups for p in g["params"]]
        groups_of = [j for j, g in enumerate(opt.param_groups) for _ in g["params"]]
        for pid, values in per_param.items():
            where = f"{field}['state'][{pid!r}]"
            if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < len(params):
                out.append(f"{field}['state'] keys must be parameter indices in [0, {len(params) - 1}] (got"
                           f" {got(pid)})")
                continue
            if not isinstance(values, Mapping):
                out.append(f"{where} must be a dict (got {got(values)})")
                continue
            if values and whole_state(opt):
                _lbfgs_state(values, pid, opt, where, out)
            elif values and isinstance(groups[groups_of[pid]], Mapping):
                hyper = {k: v for k, v in groups[groups_of[pid]].items() if k != "params"}
                _param_state(values, params[pid], opt, hyper, where, out)


def _rate(group: Mapping, field: str, out: list) -> None:
    """A param group's learning rate at most `MAX_LR`, and `lr * weight_decay` below 1: beyond that every
    update's decay overshoots zero (the weights flip sign and grow), which no schedule intends."""
    lr, decay = group.get("lr"), group.get("weight_decay")
    if is_number(lr) and math.isfinite(lr) and lr > MAX_LR:
        out.append(f"{field}['lr'] must be at most {MAX_LR:g} (got {got(lr)})")
    elif is_number(lr) and is_number(decay) and math.isfinite(lr) and math.isfinite(decay) and lr * decay >= 1:
        out.append(f"{field}: lr * weight_decay must be below 1, else each update's decay overshoots zero (got lr"
                   f" {lr!r}, weight_decay {decay!r})")


def _span(ids: list) -> str:
    return f"[{ids[0]}..{ids[-1]}]" if len(ids) > 1 else str(ids)


def _param_state(values: Mapping, param, opt, hyper: Mapping, field: str, out: list) -> None:
    """One parameter's optimizer state against what this optimizer keeps for it under the file's
    hyper-parameters `hyper` of its group (a flag such as Adam's `amsgrad` decides which states it keeps)."""
    reference = _reference_state(opt, hyper, param.device)
    proxy_shape = (2,)
    if reference is None:  # the optimizer cannot be stepped on a stand-in: the trainer's own, if it stepped
        live = opt.state.get(param)
        reference = dict(live) if live else {key: None for key in values}
        proxy_shape = tuple(param.shape)
    if set(values) != set(reference):
        out.append(f"{field} must hold the states {sorted(map(str, reference))} that {type(opt).__name__} keeps (got"
                   f" {sorted(map(str, values))})")
        return
    for key, ref in reference.items():
        value, where = values[key], f"{field}[{key!r}]"
        if isinstance(ref, torch.Tensor):
            if not isinstance(value, torch.Tensor):
                out.append(f"{where} must be a tensor (got {got(value)})")
                continue
            if ref.dim() == 0:
                wanted = ()
            elif tuple(ref.shape) == proxy_shape:
                wanted = tuple(param.shape)
            else:
                wanted = None  # a shape of its own (a factored state): not compared
            if wanted is not None and tuple(value.shape) != wanted:
                what = "a 0-d tensor" if wanted == () else f"of its parameter's shape {wanted}"
                out.append(f"{where} must be {what} (got {got(value)})")
                continue
            if value.is_floating_point() != ref.is_floating_point():
                out.append(f"{where} must be a {'floating point' if ref.is_floating_point() else 'integer'} tensor"
                           f" (got {got(value)})")
                continue
        elif ref is not None:
            like(value, ref, where, out, key)
            continue
        if isinstance(value, torch.Tensor):
            _finite_tensor(value, where, key, out)
        elif is_number(value) and not math.isfinite(value):
            out.append(f"{where} must be finite (got {got(value)})")


_LBFGS_COUNTS = ("func_evals", "n_iter")  # set at its first step
_LBFGS_SEARCH = ("d", "t", "old_dirs", "old_stps", "ro", "H_diag", "prev_flat_grad", "prev_loss")  # at its end
_LBFGS_VECTORS = ("d", "prev_flat_grad")  # over all parameters, flattened
_LBFGS_HISTORY = ("old_dirs", "old_stps")  # lists of such vectors, as long as `ro`, at most history_size


def _lbfgs_state(values: Mapping, pid, opt, field: str, out: list) -> None:
    """LBFGS's whole state, under parameter 0: two counts, and once an iteration ran, the search direction
    `d` and last gradient `prev_flat_grad` (vectors of all its parameters' elements), the step size `t`, the
    curvature history (`old_dirs`, `old_stps`: vectors, `ro`: scalars; at most `history_size` each), the
    Hessian scale `H_diag`, the last loss `prev_loss`, and `al` (the history's coefficients, None before use)."""
    if pid != 0:
        out.append(f"{field}: LBFGS keeps its state under parameter 0 only (got a state for parameter {pid})")
        return
    keys = set(values)
    known = {*_LBFGS_COUNTS, *_LBFGS_SEARCH, "al"}
    search = keys & set(_LBFGS_SEARCH)
    if keys - known or not set(_LBFGS_COUNTS) <= keys or search and search != set(_LBFGS_SEARCH):
        out.append(f"{field} must hold the states LBFGS keeps, {list(_LBFGS_COUNTS)} and after an iteration"
                   f" {list(_LBFGS_SEARCH)} (and 'al') (got {sorted(map(str, keys))})")
        return
    for key in _LBFGS_COUNTS:
        int_count = isinstance(values[key], int) and not isinstance(values[key], bool) and values[key] >= 0
        if not int_count:
            out.append(f"{field}[{key!r}] must be a count, an int >= 0 (got {got(values[key])})")
    size = sum(p.numel() for group in opt.param_groups for p in group["params"])
    history = opt.param_groups[0]["history_size"]

    def vector(value, where):
        if not (isinstance(value, torch.Tensor) and value.is_floating_point() and tuple(value.shape) == (size,)):
            out.append(f"{where} must be a floating point vector of the optimizer's {size} parameter elements (got"
                       f" {got(value)})")
        else:
            _finite_tensor(value, where, None, out)

    def scalar(value, where):
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            _finite_tensor(value, where, None, out)
        elif not is_number(value) or not math.isfinite(value):
            out.append(f"{where} must be a finite number or 0-d tensor (got {got(value)})")

    if search:
        for key in _LBFGS_VECTORS:
            vector(values[key], f"{field}[{key!r}]")
        for key in ("t", "H_diag", "prev_loss"):
            scalar(values[key], f"{field}[{key!r}]")
        lists = {key: values[key] for key in (*_LBFGS_HISTORY, "ro")}
        if not all(isinstance(v, list) for v in lists.values()) or len({len(v) for v in lists.values()}) != 1 \
                or len(lists["ro"]) > history:
            out.append(f"{field}: 'old_dirs', 'old_stps' and 'ro' must be lists of one length, at most"
                       f" history_size={history} (got {', '.join(got(v) for v in lists.values())})")
        else:
            for key in _LBFGS_HISTORY:
                for n, value in enumerate(lists[key]):
                    vector(value, f"{field}[{key!r}][{n}]")
            for n, value in enumerate(lists["ro"]):
                scalar(value, f"{field}['ro'][{n}]")
    if "al" in values:
        al = values["al"]
        if not isinstance(al, list) or len(al) != history:
            out.append(f"{field}['al'] must be a list of history_size={history} entries (got {got(al)})")
        else:
            for n, value in enumerate(al):
                if value is not None:
                    scalar(value, f"{field}['al'][{n}]")


def _finite_tensor(value: torch.Tensor, field: str, key, out: list) -> None:
    if value.device.type == "meta" or not (value.is_floating_point() or value.is_complex()):
        return
    if not bool(torch.isfinite(value).all()):
        out.append(f"{field} must be finite (got {got(value)} holding inf or NaN)")
    elif value.dim() == 0:
        in_range(field, key, float(value), out)


_REFERENCES: dict = {}


def _reference_state(opt, hyper: Mapping, device) -> dict | None:
    """What `opt` keeps per parameter, from a throwaway optimizer of its class with the hyper-parameters
    `hyper`, stepped once on a zero-gradient stand-in parameter of 2 elements on `device` (so a state of
    the parameter's shape has shape (2,)); None when it cannot be made or stepped."""
    try:
        key = (type(opt), str(device), repr(sorted(hyper.items(), key=lambda kv: str(kv[0]))))
    except Exception:
        return None
    if key in _REFERENCES:
        return _REFERENCES[key]
    reference = None
    try:
        reference = _stepped(type(opt), hyper, device)
    except Exception:  # another constructor, a device it needs: see `_steps`
        reference = None
    if len(_REFERENCES) < 64:
        _REFERENCES[key] = reference
    return reference


def _stepped(cls, hyper: Mapping, device) -> dict:
    """The per-parameter state of a `cls` optimizer with the param group `hyper` after one step on a
    stand-in; raises what the optimizer raises."""
    stand_in = torch.zeros(2, device=device, requires_grad=True)
    stand_in.grad = torch.zeros(2, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        proxy = cls([{**hyper, "params": [stand_in]}])
        try:
            proxy.step()
        except TypeError:  # an optimizer that needs a closure (LBFGS)
            proxy.step(lambda: torch.zeros((), device=device))
    state = proxy.state.get(stand_in, {})
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def _steps(opt, group: int, hyper: Mapping, field: str, out: list) -> None:
    """A problem when the file's hyper-parameters `hyper` make the optimizer fail a step that its own
    (group `group`'s) take (a flag such as `capturable` or `fused` on a device that lacks it)."""
    live = {k: v for k, v in opt.param_groups[group].items() if k != "params"}
    if not opt.param_groups[group]["params"] or hyper == live:
        return
    device = opt.param_groups[group]["params"][0].device
    try:
        _stepped(type(opt), live, device)
    except Exception:
        return  # the optimizer cannot be stepped on a stand-in at all: nothing to compare
    try:
        _stepped(type(opt), hyper, device)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:160]
        out.append(f"{field} holds hyper-parameters with which {type(opt).__name__} fails its step here"
                   f" ({type(e).__name__}: {first})")
