"""`GradClipCallback`: clip gradients by value or by norm, after unscaling, before the step."""

from __future__ import annotations

import math
from numbers import Real

import torch

from deepepochs.callbacks.base import Callback
from deepepochs.errors import ConfigError

__all__ = ["GradClipCallback"]


def _check_max_value(value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not (0 < value < math.inf):
        raise ConfigError(f"max_value must be a positive finite number (got {value!r}); e.g."
                          " GradClipCallback(1.0) clips every gradient element to [-1, 1]")
    return float(value)


def _check_norm_type(norm_type) -> float | None:
    if norm_type is None:
        return None
    if norm_type == "inf":
        return math.inf
    if isinstance(norm_type, bool) or not isinstance(norm_type, Real) or not norm_type > 0:
        raise ConfigError(f"norm_type must be None (clip by value), a positive number or 'inf' (got"
                          f" {norm_type!r}); e.g. norm_type=2 clips the gradients' joint L2 norm")
    return float(norm_type)


class GradClipCallback(Callback):
    """Clip gradients before the optimizers step: element-wise by value, or their joint norm.

    The trainer runs `clip` in the loop's `clip_gradients` action: after fp16 gradients are unscaled and
    accumulated gradients are normalised by the window's sample count, before any optimizer steps, so
    `max_value` is in the units of the true gradient whatever the precision or accumulation.

    With several optimizers, norm clipping uses the joint norm of the parameters of the optimizers being
    updated whose gradients are finite. Groups with inf/NaN gradients are left alone: they skip this update,
    and counting them would turn every other group's clip coefficient into 0 or NaN.

    Args:
        max_value: the largest allowed absolute gradient element (by value) or total norm (by norm).
        norm_type: None clips by value (`torch.nn.utils.clip_grad_value_`); a positive number or 'inf'
            clips the total norm of that order (`torch.nn.utils.clip_grad_norm_`).

    Attributes:
        last_norm: the total norm before clipping at the last update (a 0-dim tensor on the device, or None;
            by-norm clipping only). Reading it as a float is a host sync: do it rarely.

    Example:
        >>> trainer = Trainer(model, F.cross_entropy, opt, precision="fp16",
        ...                   callbacks=[GradClipCallback(1.0, norm_type=2)])
    """

    def __init__(self, max_value: float, norm_type: float | str | None = None):
        self.max_value = _check_max_value(max_value)
        self.norm_type = _check_norm_type(norm_type)
        self.last_norm: torch.Tensor | None = None

    def __repr__(self):
        return f"{type(self).__name__}(max_value={self.max_value}, norm_type={self.norm_type})"

    def clip(self, trainer, indices, finite) -> None:
        """Clip the gradients of optimizers `indices` whose entry in `finite` (index -> bool) is True."""
        params, seen = [], set()
        for i in indices:
            if not finite.get(i, True):
                continue
            for group in trainer.opt[i].opt.param_groups:
                for p in group["params"]:
                    if p.grad is not None and id(p) not in seen:  # a parameter in two optimizers counts once
                        seen.add(id(p))
                        params.append(p)
        if not params:
            return
        if self.norm_type is None:
            torch.nn.utils.clip_grad_value_(params, self.max_value)
        else:
            # clip_grad_norm_ scales by min(1, max/norm) on the device: no host sync. Under FSDP the gradients
            # are sharded DTensors: their norm is the global one (a collective), returned as a replicated
            # DTensor, kept here as the plain tensor it replicates.
            norm = torch.nn.utils.clip_grad_norm_(params, self.max_value, norm_type=self.norm_type)
            self.last_norm = norm.to_local() if hasattr(norm, "to_local") else norm
