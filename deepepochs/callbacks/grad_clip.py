"""`GradClipCallback`: clip gradients by value or by norm, after unscaling, before the step."""

from __future__ import annotations

import math
from numbers import Real

import torch

from deepepochs.callbacks.base import Callback
from deepepochs.errors import ConfigError

__all__ = ["GradClipCallback"]


def _clipped_params(model: torch.nn.Module, optimizers) -> list[torch.Tensor]:
    """The parameters with a gradient that `optimizers` update, in the order a plain loop's
    `clip_grad_norm_(model.parameters(), ...)` takes them: `model.parameters()` order first, then any that
    are not the model's, in the optimizers' order. The order is the norm's summation order, so it is what
    makes a clipped update bit-identical to the plain loop's whatever the optimizers' parameter groups (AdamW
    with decay and no-decay groups lists them in another order than the model). A parameter in two
    optimizers counts once."""
    chosen = {id(p): p for opt in optimizers for group in opt.param_groups for p in group["params"]
              if p.grad is not None}
    ordered = [p for p in model.parameters() if chosen.pop(id(p), None) is not None]
    return ordered + list(chosen.values())


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

    What is clipped, in which order: the parameters (with a gradient) of the optimizers being updated, in
    `model.parameters()` order, as `clip_grad_norm_(model.parameters(), max_value)` in a plain loop takes
    them whatever the optimizers' parameter groups, then any parameter of an optimizer that is not the
    model's, in the optimizers' order. The order is the norm's summation order: it keeps a clipped update
    bit-identical to the plain loop's. With several optimizers, norm clipping uses the joint norm of the
    parameters of the optimizers being updated whose gradients are finite. Groups with inf/NaN gradients
    are left alone: they skip this update, and counting them would turn every other group's clip
    coefficient into 0 or NaN.

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
        params = _clipped_params(trainer.raw_model, [trainer.opt[i].opt for i in indices if finite.get(i, True)])
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
