"""The rules every field read back from a checkpoint must follow, checked before anything is applied.

One rule covers the states that mirror a live object's (optimizers, schedulers, the GradScaler, monitors,
the random generators): the file's value must be *like* the trainer's own `state_dict()` value (`like`),
recursively: the same keys, lists of the same length, the same Python type for every hyper-parameter (an
int where the trainer holds a float is accepted: schedulers turn one into the other), numbers finite, and
tensors of the same kind. On top of it, fields with a meaning have a range (`RANGES`: a learning rate is
not negative, a beta lies in [0, 1), a counter lies in [0, `MAX_COUNT`]). An optimizer's per-parameter
state is compared with what the same optimizer keeps for a parameter (the trainer's own state when it has
stepped, else that of a throwaway copy of the optimizer stepped once on a small stand-in parameter): the
same state names, and each tensor of its parameter's shape where the optimizer keeps one of the parameter's
shape, 0-d where it keeps a scalar, finite. The fields a file holds of its own (epoch, world size, order
seed, history, a snapshot's position) have their types and ranges here too.

`problems(trainer, ckpt)` returns what breaks the rules, each naming the field, what it must be and the
type (and value) found; `check_fits` turns them into one `CheckpointError`. The same module checks the
run-end and progress records (`finished_problems`, `progress_problems`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping

import torch

from deepepochs.checkpoint.format import FORMAT_VERSION, Checkpoint, monitors_of
from deepepochs.utils import rng_state

__all__ = ["MAX_COUNT", "MAX_LR", "RANGES", "finished_problems", "like", "problems", "progress_problems"]

#: The largest counter (epoch, step, update, batch) a file may record: far beyond any run, far below the
#: values at which float arithmetic on a counter loses whole units.
MAX_COUNT = 2**40
#: The largest learning rate a file may hold: far above any schedule's, far below where one update
#: takes a weight out of float32's range.
MAX_LR = 1e6
_MAX_INT = 2**64  # any other int (a generator's state word, a time in nanoseconds) fits in 64 bits
_MAX_TEXT = 4096  # characters of a string field (a run id, a stop reason)

_COUNTERS = ("last_epoch", "_step_count", "step", "epoch", "bad_epochs", "best_epoch", "saved_epoch", "updates",
             "num_bad_epochs", "cooldown_counter", "_growth_tracker", "T_cur", "count", "skipped",
             "batches_done", "task_index", "completed_epochs", "target_epochs", "samples_done")
#: Field name -> (least, most, whether the least is excluded) for the fields whose meaning bounds them.
RANGES = {
    **{name: (0, math.inf, False) for name in ("lr", "initial_lr", "max_lr", "min_lr", "eps", "weight_decay",
                                               "lr_decay", "initial_accumulator_value", "eta_min", "base_lr",
                                               "max_momentum", "base_momentum", "lambd", "alpha", "t0",
                                               "patience", "cooldown", "min_lrs", "threshold", "scale",
                                               "total_iters", "rho")},
    **{name: (0, 1, False) for name in ("momentum", "dampening", "end_factor", "factor", "beta1", "beta2")},
    **{name: (0, MAX_COUNT, False) for name in _COUNTERS},
    "last_epoch": (-1, MAX_COUNT, False),
    "start_factor": (0, 1, True),
    "gamma": (0, math.inf, True),
    "step_size": (1, MAX_COUNT, False),
    "T_max": (1, MAX_COUNT, False),
    "T_0": (1, MAX_COUNT, False),
    "T_mult": (1, MAX_COUNT, False),
    "total_steps": (1, MAX_COUNT, False),
    "growth_interval": (1, MAX_COUNT, False),
    "growth_factor": (1, math.inf, True),
    "backoff_factor": (0, 1, True),
}
_BETAS = ("betas",)  # pairs of coefficients in [0, 1)
#: Param-group keys a file of another torch version may lack or add; torch fills in what is missing.
_OPTIONAL_GROUP_KEYS = {"differentiable", "foreach", "fused", "capturable", "maximize", "decoupled_weight_decay",
                        "initial_lr", "param_names"}


def _got(value) -> str:
    """The type (and, for a short value, the value) found, for a message."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return type(value).__name__ + (f" {text}" if len(text) <= 40 else "")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _in_range(field: str, name, value, out: list) -> None:
    """Add a problem to `out` when `value` (of the field `field`, key `name`) lies outside `RANGES[name]`."""
    bounds = RANGES.get(name) if isinstance(name, str) else None
    if bounds is None or not _number(value):
        return
    least, most, open_least = bounds
    if value < least or value > most or (open_least and value == least):
        shown = f"({least}, {most}]" if open_least else f"[{least}, {most}]"
        out.append(f"{field} must lie in {shown} (got {_got(value)})")


def _bounded(field: str, name, value, out: list) -> None:
    """A number that must fit in 64 bits and in the range its field name has (if any)."""
    if abs(value) >= _MAX_INT:
        out.append(f"{field} must fit in 64 bits (got {_got(value)})")
    else:
        _in_range(field, name, value, out)


def like(saved, live, field: str, out: list, name=None) -> None:
    """Add to `out` a problem for every way `saved` (a value read from a file, at `field`) is not like the
    trainer's own `live` value (see the module docstring); `name` is the key it is stored under (its range)."""
    if isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            out.append(f"{field} must be a tensor like the trainer's (got {_got(saved)})")
        elif saved.dtype != live.dtype or tuple(saved.shape) != tuple(live.shape):
            out.append(f"{field} must be a {live.dtype} tensor of shape {tuple(live.shape)} (got {_got(saved)})")
        return
    if isinstance(live, bool):
        if not isinstance(saved, bool):
            out.append(f"{field} must be a bool (got {_got(saved)})")
        return
    if isinstance(live, int):
        if isinstance(saved, bool) or not isinstance(saved, int):
            out.append(f"{field} must be an int (got {_got(saved)})")
        else:
            _bounded(field, name, saved, out)
        return
    if isinstance(live, float):
        if not _number(saved):
            out.append(f"{field} must be a number (got {_got(saved)})")
        elif not math.isfinite(saved) and not (math.isinf(saved) and math.isinf(live)):
            out.append(f"{field} must be a finite number (got {_got(saved)})")
        else:
            _in_range(field, name, saved, out)
        return
    if isinstance(live, str):
        if not isinstance(saved, str) or len(saved) > _MAX_TEXT:
            out.append(f"{field} must be a string of at most {_MAX_TEXT} characters (got {_got(saved)})")
        return
    if live is None:  # the trainer has no value yet (a best value before the first epoch): a scalar or None
        if saved is None or isinstance(saved, bool):
            return
        if not _number(saved) or (isinstance(saved, float) and math.isnan(saved)):
            out.append(f"{field} must be None or a number, not NaN (got {_got(saved)})")
        else:
            _bounded(field, name, saved, out)
        return
    if isinstance(live, Mapping):
        if not isinstance(saved, Mapping):
            out.append(f"{field} must be a dict (got {_got(saved)})")
            return
        if set(saved) != set(live):
            out.append(f"{field} must have the keys {sorted(map(str, live))} (got {sorted(map(str, saved))})")
            return
        for key, value in live.items():
            like(saved[key], value, f"{field}[{key!r}]", out, key)
        return
    if isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(live):
            out.append(f"{field} must be a list of {len(live)} (got {_got(saved)})")
            return
        for i, (s, v) in enumerate(zip(saved, live)):
            like(s, v, f"{field}[{i}]", out, name)
        if name in _BETAS:
            out.extend(f"{field}[{i}] must lie in [0, 1) (got {_got(s)})"
                       for i, s in enumerate(saved) if _number(s) and not 0 <= s < 1)
        return
    if type(saved) is not type(live):
        out.append(f"{field} must be a {type(live).__name__} (got {_got(saved)})")


def _int_field(value, field: str, least: int, most: int, out: list, none: bool = False) -> None:
    if value is None and none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        out.append(f"{field} must be an int in [{least}, {most}]{' or None' if none else ''} (got {_got(value)})")


# ---- the whole file ----
def problems(trainer, ckpt: Checkpoint) -> list[str]:
    """Every way `ckpt` (its optimizer states already in the trainer's parameter order,
    `names.by_name`) breaks the rules against `trainer`; empty when it may be applied."""
    out: list[str] = []
    _int_field(ckpt.format_version, "format_version", 1, FORMAT_VERSION, out)
    _int_field(ckpt.epoch, "epoch", 0, MAX_COUNT, out)
    _int_field(ckpt.world_size, "world_size", 1, 1 << 20, out)
    _int_field(ckpt.order_seed, "order_seed", 0, _MAX_INT - 1, out, none=True)
    if not isinstance(ckpt.running_id, str) or len(ckpt.running_id) > _MAX_TEXT:
        out.append(f"running_id must be a string of at most {_MAX_TEXT} characters (got {_got(ckpt.running_id)})")
    _model(trainer, ckpt.model, out)
    _optimizers(trainer, ckpt, out)
    if not isinstance(ckpt.schedulers, (list, tuple)) or len(ckpt.schedulers) != len(ckpt.optimizers):
        out.append(f"schedulers must be a list of one state (or None) per optimizer (got {_got(ckpt.schedulers)})")
    else:
        for i, (item, state) in enumerate(zip(trainer.opt.items, ckpt.schedulers)):
            if state is not None and item.scheduler is not None:
                like(state, item.scheduler.state_dict(), f"schedulers[{i}]", out)
            elif state is not None and not isinstance(state, Mapping):
                out.append(f"schedulers[{i}] must be a dict or None (got {_got(state)})")
    live_scaler = trainer.precision.state_dict()
    if ckpt.scaler is not None and live_scaler is not None:
        like(ckpt.scaler, live_scaler, "scaler", out)
    elif ckpt.scaler is not None and not isinstance(ckpt.scaler, Mapping):
        out.append(f"scaler must be a dict or None (got {_got(ckpt.scaler)})")
    for monitor in monitors_of(trainer):
        saved = ckpt.monitors.get(monitor.monitor_id)
        if saved is None:
            continue
        live = monitor.state_dict()
        field = f"monitors[{monitor.monitor_id!r}]"
        if not isinstance(saved, Mapping) or not set(saved) <= set(live):
            out.append(f"{field} must be a dict with keys among {sorted(live)} (got {_got(saved)})")
            continue
        for key, value in saved.items():
            like(value, live[key], f"{field}[{key!r}]", out, key)
    if ckpt.rng is not None:
        _rng(ckpt.rng, "rng", out)
    _history(ckpt.history, ckpt.epoch, "history", out)
    if ckpt.position is not None:
        _position(ckpt.position, ckpt.epoch, out)
    return out


def _model(trainer, saved, out: list) -> None:
    """The model's entries must be tensors, its parameters finite (a buffer may hold inf: a mask); keys and
    shapes are the fit check's."""
    parameters = {name for name, _ in trainer.raw_model.named_parameters()}
    bad = []
    for key, value in saved.items():
        if not isinstance(value, torch.Tensor):
            if not (isinstance(key, str) and key.endswith("_extra_state")):
                bad.append(f"model[{key!r}] must be a tensor (got {_got(value)})")
        elif key in parameters and value.device.type != "meta" and value.is_floating_point() \
                and not bool(torch.isfinite(value).all()):
            bad.append(f"model[{key!r}] must be finite, it is a parameter (got {_got(value)} holding inf or NaN)")
    out.extend(bad[:5])


def _optimizers(trainer, ckpt: Checkpoint, out: list) -> None:
    items = trainer.opt.items
    if len(ckpt.optimizers) != len(items):
        return  # the fit check reports the count
    for i, (item, state) in enumerate(zip(items, ckpt.optimizers)):
        field = f"optimizers[{i}]"
        opt = item.opt
        if not isinstance(state, Mapping) or set(state) != {"state", "param_groups"}:
            out.append(f"{field} must be an optimizer's state_dict(), a dict of 'state' and 'param_groups' (got"
                       f" {_got(state) if not isinstance(state, Mapping) else sorted(map(str, state))})")
            continue
        groups = state["param_groups"]
        if not isinstance(groups, (list, tuple)) or len(groups) != len(opt.param_groups):
            out.append(f"{field}['param_groups'] must be a list of {len(opt.param_groups)} (got {_got(groups)})")
            continue
        count = 0
        for j, (group, live) in enumerate(zip(groups, opt.param_groups)):
            where = f"{field}['param_groups'][{j}]"
            if not isinstance(group, Mapping):
                out.append(f"{where} must be a dict (got {_got(group)})")
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
                out.append(f"{where}['params'] must be the parameter indices {_span(wanted)} (got {_got(params)})")
            count += len(live["params"])
        per_param = state["state"]
        if not isinstance(per_param, Mapping):
            out.append(f"{field}['state'] must be a dict (got {_got(per_param)})")
            continue
        params = [p for g in opt.param_groups for p in g["params"]]
        groups_of = [j for j, g in enumerate(opt.param_groups) for _ in g["params"]]
        for pid, values in per_param.items():
            where = f"{field}['state'][{pid!r}]"
            if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < len(params):
                out.append(f"{field}['state'] keys must be parameter indices in [0, {len(params) - 1}] (got"
                           f" {_got(pid)})")
                continue
            if not isinstance(values, Mapping):
                out.append(f"{where} must be a dict (got {_got(values)})")
                continue
            if values and isinstance(groups[groups_of[pid]], Mapping):
                hyper = {k: v for k, v in groups[groups_of[pid]].items() if k != "params"}
                _param_state(values, params[pid], opt, hyper, where, out)


def _rate(group: Mapping, field: str, out: list) -> None:
    """A param group's learning rate at most `MAX_LR`, and `lr * weight_decay` below 1: beyond that every
    update's decay overshoots zero (the weights flip sign and grow), which no schedule intends."""
    lr, decay = group.get("lr"), group.get("weight_decay")
    if _number(lr) and math.isfinite(lr) and lr > MAX_LR:
        out.append(f"{field}['lr'] must be at most {MAX_LR:g} (got {_got(lr)})")
    elif _number(lr) and _number(decay) and math.isfinite(lr) and math.isfinite(decay) and lr * decay >= 1:
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
                out.append(f"{where} must be a tensor (got {_got(value)})")
                continue
            if ref.dim() == 0:
                wanted = ()
            elif tuple(ref.shape) == proxy_shape:
                wanted = tuple(param.shape)
            else:
                wanted = None  # a shape of its own (a factored state): not compared
            if wanted is not None and tuple(value.shape) != wanted:
                what = "a 0-d tensor" if wanted == () else f"of its parameter's shape {wanted}"
                out.append(f"{where} must be {what} (got {_got(value)})")
                continue
            if value.is_floating_point() != ref.is_floating_point():
                out.append(f"{where} must be a {'floating point' if ref.is_floating_point() else 'integer'} tensor"
                           f" (got {_got(value)})")
                continue
        elif ref is not None:
            like(value, ref, where, out, key)
            continue
        if isinstance(value, torch.Tensor):
            _finite_tensor(value, where, key, out)
        elif _number(value) and not math.isfinite(value):
            out.append(f"{where} must be finite (got {_got(value)})")


def _finite_tensor(value: torch.Tensor, field: str, key, out: list) -> None:
    if value.device.type == "meta" or not (value.is_floating_point() or value.is_complex()):
        return
    if not bool(torch.isfinite(value).all()):
        out.append(f"{field} must be finite (got {_got(value)} holding inf or NaN)")
    elif value.dim() == 0:
        _in_range(field, key, float(value), out)


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


def _rng(saved, field: str, out: list) -> None:
    live = rng_state()
    if not isinstance(saved, Mapping) or not {"python", "numpy", "torch"} <= set(saved):
        out.append(f"{field} must be a dict of the 'python', 'numpy', 'torch' and 'cuda' generator states (got"
                   f" {_got(saved)})")
        return
    python = saved["python"]
    ok = (isinstance(python, (list, tuple)) and len(python) == 3 and isinstance(python[0], int)
          and isinstance(python[1], (list, tuple)) and len(python[1]) == len(live["python"][1])
          and all(isinstance(k, int) and not isinstance(k, bool) and 0 <= k < 2**32 for k in python[1])
          and (python[2] is None or (_number(python[2]) and math.isfinite(python[2]))))
    if not ok:  # (version, 625 words of 32 bits, the cached gaussian: None or a number)
        out.append(f"{field}['python'] must be Python's generator state [version, {len(live['python'][1])} ints"
                   f" in [0, 2**32), None or a finite number] (got {_got(python)})")
    for key in ("numpy", "torch"):
        like(saved[key], live[key], f"{field}[{key!r}]", out, key)
    cuda = saved.get("cuda", [])
    if not isinstance(cuda, list) or not all(isinstance(s, torch.Tensor) and s.dtype == torch.uint8 and s.dim() == 1
                                             for s in cuda):
        out.append(f"{field}['cuda'] must be a list of uint8 generator states (got {_got(cuda)})")


def _history(history, epochs: int, field: str, out: list) -> None:
    """A run's records: `{stage: {name: [number per epoch]}}`, no list longer than the epochs completed."""
    if history is None:
        return
    if not isinstance(history, Mapping):
        out.append(f"{field} must be a dict of stages (got {_got(history)})")
        return
    for stage, metrics in history.items():
        where = f"{field}[{stage!r}]"
        if not isinstance(stage, str) or not isinstance(metrics, Mapping):
            out.append(f"{where} must be a dict of metric names to lists (got {_got(metrics)})")
            continue
        for name, values in metrics.items():
            if not isinstance(name, str) or not isinstance(values, list) or not all(map(_number, values)):
                out.append(f"{where}[{name!r}] must be a list of numbers (got {_got(values)})")
            elif isinstance(epochs, int) and len(values) > epochs:
                out.append(f"{where}[{name!r}] holds {len(values)} values, more than the {epochs} epoch(s) completed")


# ---- a snapshot's position ----
def _position(pos, epoch, out: list) -> None:
    """A mid-epoch snapshot's position (`deepepochs.engine.position`): its counters, its ranks' records."""
    if not isinstance(pos, Mapping):
        out.append(f"position must be a dict or None (got {_got(pos)})")
        return
    keys = {"epoch", "task_index", "batches_done", "world_size", "batch_size", "samples_done", "ranks"}
    if not keys - {"batch_size", "samples_done"} <= set(pos) or not set(pos) <= keys:
        out.append(f"position must have the keys {sorted(keys)} (got {sorted(map(str, pos))})")
        return
    if isinstance(epoch, int) and pos["epoch"] != epoch + 1:
        out.append(f"position['epoch'] must be the epoch after the {epoch} completed, {epoch + 1} (got"
                   f" {_got(pos['epoch'])})")
    _int_field(pos["task_index"], "position['task_index']", 0, 1 << 16, out)
    _int_field(pos["batches_done"], "position['batches_done']", 0, MAX_COUNT, out)
    _int_field(pos["world_size"], "position['world_size']", 1, 1 << 20, out)
    _int_field(pos.get("batch_size"), "position['batch_size']", 1, MAX_COUNT, out, none=True)
    _int_field(pos.get("samples_done"), "position['samples_done']", 0, MAX_COUNT, out, none=True)
    size, samples = pos.get("batch_size"), pos.get("samples_done")
    if (size is None) != (samples is None):
        out.append(f"position['batch_size'] and position['samples_done'] must both be None (data without a batch"
                   f" size) or both ints (got {_got(size)} and {_got(samples)})")
    elif all(isinstance(v, int) and not isinstance(v, bool) for v in (size, samples, pos["batches_done"],
                                                                        pos["world_size"])) \
            and samples != pos["batches_done"] * size * pos["world_size"]:
        out.append(f"position['samples_done'] must be batches_done x batch_size x world_size,"
                   f" {pos['batches_done'] * size * pos['world_size']} (got {_got(samples)})")
    ranks = pos["ranks"]
    if not isinstance(ranks, list) or (isinstance(pos["world_size"], int) and len(ranks) != pos["world_size"]):
        out.append(f"position['ranks'] must be a list of one record per process (got {_got(ranks)})")
        return
    for r, rank in enumerate(ranks):
        _rank(rank, pos["task_index"], f"position['ranks'][{r}]", out)


def _rank(rank, task_index, field: str, out: list) -> None:
    if not isinstance(rank, Mapping) or not {"meters", "random"} <= set(rank) \
            or not set(rank) <= {"meters", "random", "data", "run"}:
        out.append(f"{field} must be a dict of 'meters', 'random', 'data' and 'run' (got {_got(rank)})")
        return
    meters = rank["meters"]
    if not isinstance(meters, list) or (isinstance(task_index, int) and len(meters) != task_index + 1):
        out.append(f"{field}['meters'] must be a list of one record per training task so far (got {_got(meters)})")
    else:
        for t, state in enumerate(meters):
            _meters(state, f"{field}['meters'][{t}]", out)
    random_states = rank["random"]
    if not isinstance(random_states, Mapping) or "commit" not in random_states:
        out.append(f"{field}['random'] must be a dict of generator states (got {_got(random_states)})")
    else:
        for key in ("commit", "task"):
            _generator_pair(random_states.get(key), f"{field}['random'][{key!r}]", out, none=key == "task")
        if random_states.get("host") is not None:
            _rng(random_states["host"], f"{field}['random']['host']", out)
    run = rank.get("run")
    if run is not None and (not isinstance(run, Mapping) or not all(isinstance(k, str) for k in run)):
        out.append(f"{field}['run'] must be a dict of run-state fields by name (got {_got(run)})")


def _generator_pair(value, field: str, out: list, none: bool) -> None:
    """torch's (CPU, accelerator) generator states: a list of two, each a uint8 tensor or None."""
    if value is None and none:
        return
    ok = (isinstance(value, (list, tuple)) and len(value) == 2 and isinstance(value[0], torch.Tensor)
          and all(s is None or (isinstance(s, torch.Tensor) and s.dtype == torch.uint8 and s.dim() == 1)
                  for s in value))
    if ok:
        ok = value[0].shape == torch.get_rng_state().shape
    if not ok:
        out.append(f"{field} must be [CPU generator state, accelerator generator state or None] (uint8 tensors)"
                   f" (got {_got(value)})")


def _meters(state, field: str, out: list) -> None:
    keys = {"loss_sum", "host_sum", "host", "count", "skipped", "patches"}
    if not isinstance(state, Mapping) or not set(state) <= keys or not keys - {"skipped"} <= set(state):
        out.append(f"{field} must be a dict of {sorted(keys)} (got {_got(state)})")
        return
    loss = state["loss_sum"]
    if loss is not None and (not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point()):
        out.append(f"{field}['loss_sum'] must be None or a 0-d float tensor (got {_got(loss)})")
    if not _number(state["host_sum"]) or not math.isfinite(state["host_sum"]):
        out.append(f"{field}['host_sum'] must be a finite number (got {_got(state['host_sum'])})")
    if state["host"] is not None and not isinstance(state["host"], bool):
        out.append(f"{field}['host'] must be None or a bool (got {_got(state['host'])})")
    _int_field(state["count"], f"{field}['count']", 0, MAX_COUNT, out)
    _int_field(state.get("skipped", 0), f"{field}['skipped']", 0, MAX_COUNT, out)
    patches = state["patches"]
    if not isinstance(patches, Mapping):
        out.append(f"{field}['patches'] must be a dict of metric names to patches (got {_got(patches)})")
        return
    for name, patch in patches.items():
        ok = (isinstance(name, str) and isinstance(patch, Mapping) and set(patch) == {"class", "fields", "callables"}
              and isinstance(patch["class"], str) and isinstance(patch["fields"], Mapping)
              and isinstance(patch["callables"], list) and all(isinstance(c, str) for c in patch["callables"]))
        if not ok:
            out.append(f"{field}['patches'][{name!r}] must be a dict of 'class' (str), 'fields' (dict) and"
                       f" 'callables' (list of str) (got {_got(patch)})")


# ---- the run-end and progress records ----
def finished_problems(data, ckpt_epoch: int, ckpt_history) -> list[str]:
    """Every way a run-end record (`finished.pt`) breaks its rules, for a resume that loaded a checkpoint of
    `ckpt_epoch` completed epochs whose history is `ckpt_history`: ints in range, a stop reason that is a
    string or None, records of numbers no longer than the epochs completed, continuing the checkpoint's."""
    keys = {"completed_epochs", "target_epochs", "stop_reason", "stop_source", "records"}
    if not isinstance(data, Mapping) or set(data) != keys:
        found = _got(data) if not isinstance(data, Mapping) else f"keys {sorted(map(str, data))}"
        return [f"it must be a dict of {sorted(keys)} (got {found})"]
    out: list[str] = []
    _int_field(data["completed_epochs"], "completed_epochs", 0, MAX_COUNT, out)
    _int_field(data["target_epochs"], "target_epochs", 0, MAX_COUNT, out)
    if data["stop_reason"] is not None and (not isinstance(data["stop_reason"], str)
                                            or len(data["stop_reason"]) > _MAX_TEXT):
        out.append(f"stop_reason must be None or a string (got {_got(data['stop_reason'])})")
    if not isinstance(data["stop_source"], str) or len(data["stop_source"]) > _MAX_TEXT:
        out.append(f"stop_source must be a string (got {_got(data['stop_source'])})")
    if out:
        return out
    done = data["completed_epochs"]
    records = data["records"]
    _history(records, done, "records", out)
    if out or not isinstance(ckpt_history, Mapping):
        return out
    # The record ends the run of the checkpoint: its records continue the checkpoint's by the epochs after it.
    extra = done - ckpt_epoch
    for stage, metrics in ckpt_history.items():
        for name, values in metrics.items() if isinstance(metrics, Mapping) else ():
            mine = records.get(stage, {}).get(name) if isinstance(records.get(stage), Mapping) else None
            if not isinstance(values, list) or len(values) != ckpt_epoch:
                continue  # a history that does not cover every epoch (started from an older file)
            if mine is None or len(mine) != len(values) + extra:
                out.append(f"records[{stage!r}][{name!r}] must hold {len(values) + extra} values (the checkpoint's"
                           f" {len(values)} and one per epoch after it, to the {done} completed) (got"
                           f" {_got(mine) if mine is None else f'{len(mine)} values'})")
                return out
    return out


def progress_problems(data) -> list[str]:
    """Every way a progress record (`progress.pt`) breaks its rule: `{'completed_epochs': int in range}`."""
    if not isinstance(data, Mapping) or set(data) != {"completed_epochs"}:
        return [f"it must be a dict of 'completed_epochs' (got {_got(data)})"]
    out: list[str] = []
    _int_field(data["completed_epochs"], "completed_epochs", 0, MAX_COUNT, out)
    return out
