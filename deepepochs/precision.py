"""Precision policy (AMP-1): autocast over forward and loss, GradScaler for fp16, finite checks."""

from __future__ import annotations

import contextlib
import functools

import torch

from deepepochs.errors import ConfigError

__all__ = ["Precision"]


class Precision:
    """What `precision='fp32'|'fp16'|'bf16'` means on one device.

    fp16 uses `torch.amp.GradScaler` on CUDA and on CPU (the CPU scaler makes overflow handling testable
    without a GPU); bf16 has the fp32 exponent range, so it needs no scaler.
    """

    def __init__(self, precision: str, device: torch.device):
        self.name = precision
        self.device = device
        self.dtype = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]
        if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ConfigError(
                f"precision='bf16' is not supported on {device} ({torch.cuda.get_device_name(device)});"
                " use precision='fp16' or 'fp32'"
            )
        if self.dtype is not None and device.type not in ("cuda", "cpu", "mps", "xpu"):
            raise ConfigError(f"precision={precision!r} needs a cuda, cpu, mps or xpu device (got {device})")
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        if self.dtype is None:
            self.autocast = contextlib.nullcontext
        else:
            self.autocast = functools.partial(torch.autocast, device_type=device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to backpropagate (multiplied by the scaler's scale under fp16)."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale(self, optimizer: torch.optim.Optimizer) -> bool | None:
        """Unscale `optimizer`'s gradients in place; return whether they are finite (None without scaler).

        The finiteness read is the one host sync `GradScaler.step` would do anyway; we take it here so the
        machine's `grads_finite` guard can pick the step or skip edge, and then step the optimizer
        ourselves instead of calling `scaler.step`, which would read it a second time.
        """
        if self.scaler is None:
            return None
        self.scaler.unscale_(optimizer)
        state = self.scaler._per_optimizer_states[id(optimizer)]  # filled by unscale_ just above
        return not sum(v.item() for v in state["found_inf_per_device"].values())

    def update(self) -> None:
        """Adjust the scale after an update (halve on overflow, grow after enough finite steps)."""
        if self.scaler is not None:
            self.scaler.update()

    def discard_step_state(self) -> None:
        """Forget unscale/inf records of an interrupted update so the next `unscale_` is allowed."""
        if self.scaler is not None:
            self.scaler._per_optimizer_states.clear()  # a defaultdict: entries are recreated on demand

    def state_dict(self) -> dict | None:
        """The scaler's state for checkpoints (None when there is no scaler)."""
        return None if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        """Restore `state_dict()` output; a missing state leaves the scaler as it is."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
