"""The rule every value read back from a checkpoint must follow, against the trainer's own value.

A state that mirrors a live object's (optimizers, schedulers, the GradScaler, monitors, the random
generators) must be *like* the trainer's own `state_dict()` value (`like`), recursively: the same keys,
lists of the same length, the same Python type for every hyper-parameter (an int where the trainer holds a
float is accepted when it is a float exactly, at most 2**53 in size: the float it equals behaves the same in
every scheduler's and optimizer's arithmetic; a larger one is refused), numbers finite, and tensors of the
same kind. On
top of it, fields with a meaning have a range (`RANGES`: a learning rate is not negative, a beta lies in
[0, 1), a counter lies in [0, `MAX_COUNT`]). The checks of whole files build on these
(`deepepochs.checkpoint.field_rules`, `deepepochs.checkpoint.optimizer_rules`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

__all__ = ["MAX_COUNT", "MAX_EXACT_FLOAT_INT", "MAX_INT", "MAX_LR", "MAX_TEXT", "RANGES", "bounded", "got",
           "in_range", "int_field", "is_number", "like"]

#: The largest counter (epoch, step, update, batch) a file may record: far beyond any run, far below the
#: values at which float arithmetic on a counter loses whole units.
MAX_COUNT = 2**40
#: The largest learning rate a file may hold: far above any schedule's, far below where one update
#: takes a weight out of float32's range.
MAX_LR = 1e6
MAX_INT = 2**64  # any other int (a generator's state word, a time in nanoseconds) fits in 64 bits
MAX_TEXT = 4096  # characters of a string field (a run id, a stop reason)
#: The largest int accepted where the trainer holds a float: every int up to it is exactly a float.
MAX_EXACT_FLOAT_INT = 2**53

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


def got(value) -> str:
    """The type (and, for a short value, the value) found, for a message."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return type(value).__name__ + (f" {text}" if len(text) <= 40 else "")


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def in_range(field: str, name, value, out: list) -> None:
    """Add a problem to `out` when `value` (of the field `field`, key `name`) lies outside `RANGES[name]`."""
    bounds = RANGES.get(name) if isinstance(name, str) else None
    if bounds is None or not is_number(value):
        return
    least, most, open_least = bounds
    if value < least or value > most or (open_least and value == least):
        shown = f"({least}, {most}]" if open_least else f"[{least}, {most}]"
        out.append(f"{field} must lie in {shown} (got {got(value)})")


def bounded(field: str, name, value, out: list) -> None:
    """A number that must fit in 64 bits and in the range its field name has (if any)."""
    if abs(value) >= MAX_INT:
        out.append(f"{field} must fit in 64 bits (got {got(value)})")
    else:
        in_range(field, name, value, out)


def like(saved, live, field: str, out: list, name=None) -> None:
    """Add to `out` a problem for every way `saved` (a value read from a file, at `field`) is not like the
    trainer's own `live` value (see the module docstring); `name` is the key it is stored under (its range)."""
    if isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            out.append(f"{field} must be a tensor like the trainer's (got {got(saved)})")
        elif saved.dtype != live.dtype or tuple(saved.shape) != tuple(live.shape):
            out.append(f"{field} must be a {live.dtype} tensor of shape {tuple(live.shape)} (got {got(saved)})")
        return
    if isinstance(live, bool):
        if not isinstance(saved, bool):
            out.append(f"{field} must be a bool (got {got(saved)})")
        return
    if isinstance(live, int):
        if isinstance(saved, bool) or not isinstance(saved, int):
            out.append(f"{field} must be an int (got {got(saved)})")
        else:
            bounded(field, name, saved, out)
        return
    if isinstance(live, float):
        if not is_number(saved):
            out.append(f"{field} must be a number (got {got(saved)})")
        elif isinstance(saved, int) and abs(saved) > MAX_EXACT_FLOAT_INT:
            out.append(f"{field} must be a float like the trainer's (got {got(saved)}: an int beyond 2**53, which"
                       " no float equals)")
        elif not math.isfinite(saved) and not (math.isinf(saved) and math.isinf(live)):
            out.append(f"{field} must be a finite number (got {got(saved)})")
        else:
            in_range(field, name, saved, out)
        return
    if isinstance(live, str):
        if not isinstance(saved, str) or len(saved) > MAX_TEXT:
            out.append(f"{field} must be a string of at most {MAX_TEXT} characters (got {got(saved)})")
        return
    if live is None:  # the trainer has no value yet (a best value before the first epoch): a scalar or None
        if saved is None or isinstance(saved, bool):
            return
        if not is_number(saved) or (isinstance(saved, float) and math.isnan(saved)):
            out.append(f"{field} must be None or a number, not NaN (got {got(saved)})")
        else:
            bounded(field, name, saved, out)
        return
    if isinstance(live, Mapping):
        if not isinstance(saved, Mapping):
            out.append(f"{field} must be a dict (got {got(saved)})")
            return
        if set(saved) != set(live):
            out.append(f"{field} must have the keys {sorted(map(str, live))} (got {sorted(map(str, saved))})")
            return
        for key, value in live.items():
            like(saved[key], value, f"{field}[{key!r}]", out, key)
        return
    if isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(live):
            out.append(f"{field} must be a list of {len(live)} (got {got(saved)})")
            return
        for i, (s, v) in enumerate(zip(saved, live)):
            like(s, v, f"{field}[{i}]", out, name)
        if name in _BETAS:
            out.extend(f"{field}[{i}] must lie in [0, 1) (got {got(s)})"
                       for i, s in enumerate(saved) if is_number(s) and not 0 <= s < 1)
        return
    if type(saved) is not type(live):
        out.append(f"{field} must be a {type(live).__name__} (got {got(saved)})")


def int_field(value, field: str, least: int, most: int, out: list, none: bool = False) -> None:
    if value is None and none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        out.append(f"{field} must be an int in [{least}, {most}]{' or None' if none else ''} (got {got(value)})")
