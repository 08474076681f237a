"""Precision policy: autocast over forward and loss, GradScaler for fp16, finite checks.

The scaler's life cycle inside one training iteration (one DataLoader batch) is:

    scale(loss).backward()   -> every loss of the iteration is scaled with the same scale S
    unscale(optimizers)      -> gradients / S, one host read of the inf/NaN flags for all of them
    step or skip each        -> decided by the machine's grads_finite guard, not by scaler.step
    finish(optimizers, n)    -> the inf records of this update are set aside
    (scale update)           -> S is halved on overflow / grown after enough finite steps

The scale update is what needs care. `GradScaler.update()` must run once per iteration, after every optimizer
of the iteration was unscaled: an optimizer whose gradients were scaled with S but unscaled after S changed
would get gradients off by the ratio of the two scales. A step that calls `self.optimize(0)` and then
`self.optimize(1)` (two halves of a model), or a GAN step whose generator accumulated gradients over a
window, would hit exactly that if the scale changed after the first update. So `finish` applies the scale
update at once only when every optimizer has finished an update; after a partial update it is deferred to
the first `scale()` of a later batch (or to `state_dict()` / `discard_step_state()`), when no gradient scaled
with the old scale is waiting any more.

The scaler's per-optimizer records are reached only through `deepepochs.torch_private`, the one module
allowed private torch attributes (each with its reason and a public fallback).
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch

from deepepochs.config import PRECISIONS, check_choice
from deepepochs.errors import ConfigError
from deepepochs.torch_private import (
    autocast_enabled,
    scaler_forget,
    scaler_forget_all,
    scaler_unscale,
    scaler_update_with,
)

__all__ = ["Precision"]

_DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def _cuda_bf16_supported() -> bool:
    """Native bf16 on the current CUDA device (emulated bf16 on pre-Ampere GPUs is slow: not counted)."""
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # torch < 2.4 has no including_emulation and never counts emulation
        return torch.cuda.is_bf16_supported()


def _check_autocast(precision: str, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ConfigError when autocast to `dtype` is unavailable on `device`.

    torch only *warns* and silently disables autocast for an unsupported (device, dtype) pair; a run would
    then train in fp32 while the user believes it is mixed precision.
    """
    is_available = getattr(torch.amp, "is_autocast_available", None)
    if is_available is not None and not is_available(device.type):
        raise ConfigError(f"precision={precision!r} needs autocast, which torch does not support on"
                          f" {device.type!r} devices (got device {device}); use precision='fp32'")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctx = torch.autocast(device_type=device.type, dtype=dtype)
    if not autocast_enabled(ctx, device.type) or any("not supported" in str(w.message) for w in caught):
        raise ConfigError(f"precision={precision!r} is not supported by autocast on {device} (torch"
                          f" {torch.__version__}); use precision='fp32'"
                          + (" or 'bf16'" if precision == "fp16" else " or 'fp16'"))


class Precision:
    """What `precision='fp32'|'fp16'|'bf16'` means on one device.

    fp16 uses `torch.amp.GradScaler` on CUDA and on CPU (the CPU scaler makes overflow handling testable
    without a GPU); bf16 has the fp32 exponent range, so it needs no scaler.

    Args:
        precision: 'fp32', 'fp16' or 'bf16'.
        device: the training device; the combination is validated here, not at the first batch.

    Raises:
        ConfigError: unknown precision, bf16 on a CUDA GPU without native bf16, or autocast/GradScaler
            unavailable on the device.
    """

    def __init__(self, precision: str, device: torch.device):
        check_choice("precision", precision, PRECISIONS, "use 'fp16' for float16 autocast")
        self.name = precision
        self.device = device
        self.dtype = _DTYPES[precision]
        if precision == "bf16" and device.type == "cuda" and not _cuda_bf16_supported():
            raise ConfigError(
                f"precision='bf16' is not supported on {device} ({torch.cuda.get_device_name(device)}: no"
                " native bfloat16); use precision='fp16' (with loss scaling) or 'fp32'"
            )
        if self.dtype is not None:
            _check_autocast(precision, device, self.dtype)
        # The fp16 `GradScaler` (None for fp32/bf16); read per micro-batch, so a plain attribute.
        self.scaler: torch.amp.GradScaler | None = None
        if precision == "fp16":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # an unusable scaler warns and disables itself: checked below
                self.scaler = torch.amp.GradScaler(device.type)
            if not self.scaler.is_enabled():
                raise ConfigError(f"precision='fp16' needs torch.amp.GradScaler, which is unavailable on"
                                  f" {device}; use precision='bf16' or 'fp32'")
        # inf records of updates finished since the last scale update, and who finished them
        self._done: list[list[torch.Tensor]] = []
        self._done_ids: set[int] = set()
        self._done_token = None
        if self.dtype is None:
            self.autocast = self.no_autocast = contextlib.nullcontext
        else:
            self.autocast = functools.partial(torch.autocast, device_type=device.type, dtype=self.dtype)
            self.no_autocast = functools.partial(torch.autocast, device_type=device.type, enabled=False)

    def scale(self, loss: torch.Tensor, token=None) -> torch.Tensor:
        """The loss to backpropagate: multiplied by the scaler's scale under fp16.

        `token` identifies the current iteration (batch); a scale update deferred by a partial update of an
        earlier iteration is applied first, so this backward already uses the new scale.
        """
        if self.scaler is None:
            return loss
        if self._done and token != self._done_token:
            self._apply_update()
        return self.scaler.scale(loss)

    def unscale(self, optimizers) -> list[bool] | None:
        """Unscale each optimizer's gradients in place; return per optimizer whether they are finite.

        Returns None without a scaler (fp32/bf16: the caller checks the loss instead). The inf/NaN flags of
        all optimizers are read with one host sync: the one `GradScaler.step` would do anyway. We take it
        here so that the machine's `grads_finite` guard picks the step or skip edge, and then step the
        optimizers ourselves instead of calling `scaler.step`, which would read the flags a second time.
        """
        scaler = self.scaler
        if scaler is None:
            return None
        flags, owners = [], []
        for n, opt in enumerate(optimizers):
            for flag in scaler_unscale(scaler, opt):
                flags.append(flag)
                owners.append(n)
        found = [False] * len(optimizers)
        if flags:
            first = flags[0].device
            host = torch.stack([f.to(first) for f in flags]).tolist()  # the one host sync of an fp16 update
            for n, value in zip(owners, host):
                found[n] = found[n] or value != 0.0
        return [not f for f in found]

    def finish(self, optimizers, n_total: int, token=None) -> None:
        """Record that `optimizers` finished their update (stepped or skipped) in iteration `token`.

        Their inf records are set aside, which also lets the same optimizer be unscaled again later in the
        iteration (e.g. two discriminator updates per batch). The scale is updated at once when every one
        of the trainer's `n_total` optimizers has finished an update; otherwise later (see the module doc).
        """
        scaler = self.scaler
        if scaler is None:
            return
        for opt in optimizers:
            record = scaler_forget(scaler, opt, self.device)
            if record is not None:
                self._done.append(record)
            self._done_ids.add(id(opt))
        self._done_token = token
        if len(self._done_ids) >= n_total:
            self._apply_update()

    def _apply_update(self) -> None:
        """Adjust the scale from the set-aside inf records (halve on overflow, grow after enough finite
        updates), exactly as `GradScaler.update()` does after `scaler.step` of each optimizer."""
        done, self._done, self._done_ids, self._done_token = self._done, [], set(), None
        if any(done):
            scaler_update_with(self.scaler, done)  # also consumes records still held; resets them all
        # no record at all: the updated optimizers had no gradients; the scale stays as it is

    def discard_step_state(self) -> None:
        """Rollback: forget the unscale/inf records of an interrupted update so the next `unscale_` is
        allowed; updates that completed before the interrupt still adjust the scale."""
        if self.scaler is None:
            return
        scaler_forget_all(self.scaler, self.device)
        if self._done:
            self._apply_update()
        self._done_ids.clear()

    def state_dict(self) -> dict | None:
        """The scaler's state for checkpoints (None without a scaler); applies a deferred scale update."""
        if self.scaler is None:
            return None
        if self._done:
            self._apply_update()
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        """Restore `state_dict()` output; a missing state leaves the scaler as it is."""
        if self.scaler is not None and state:
            self._done, self._done_ids, self._done_token = [], set(), None
            scaler_forget_all(self.scaler, self.device)
            self.scaler.load_state_dict(state)
