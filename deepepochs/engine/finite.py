"""The non-finite check of an update: whether the window's losses and the update's gradients are finite
(fp32/bf16; fp16 asks the GradScaler), and what `nonfinite='raise'` does when they are not.

`unscale_gradients` (`deepepochs.engine.actions`) asks `window_finite` once per update; `steps.loss_value`
asks `reads_on_host` whether a loss is read as a float when computed.
"""

from __future__ import annotations

import math

import torch

from deepepochs import torch_private
from deepepochs.engine.context import Context

__all__ = ["reads_on_host", "window_finite"]


def reads_on_host(value: torch.Tensor) -> bool:
    """Whether reading `value` costs no device sync (a CPU tensor); elsewhere the fp32 finite check with
    nonfinite='raise' stays on the device until the task's end."""
    return value.is_cpu


def window_finite(ctx: Context, grads: list[torch.Tensor]) -> bool:
    """Whether the update window's losses and the update's gradients `grads` are all finite (fp32/bf16;
    fp16 asks the scaler, whose unscale checks the gradients).

    On the CPU the losses were read as floats when computed (`steps.loss`) and the gradients' flag is read
    at no sync cost: one fused pass over the gradients (`torch_private.grads_nonfinite`). Elsewhere the
    losses' and gradients' flags are combined on the device and read once per update (the guard needs a
    Python bool), or not at all with nonfinite='raise': the flag is kept and checked at the task's end.
    Under DDP the flag is summed over the ranks first, so every rank takes the same step/skip
    edge. Raises FloatingPointError with nonfinite='raise'.
    """
    parts, loop = ctx.parts, ctx.loop
    dist, raise_ = parts.dist, parts.config.nonfinite == "raise"
    window, step_loss = loop.meters.window_losses, ctx.step_loss
    flag = None  # a device-side flag, when the losses were not read on the host
    if not window and type(step_loss) is float:  # the common case: one loss, read on the host already
        bad = not math.isfinite(step_loss)
    else:
        values = [loss for loss, _ in window]
        if step_loss is not None:
            values.append(step_loss)
        if all(type(v) is float for v in values):  # read on the host already (or no loss at all)
            bad = not all(map(math.isfinite, values))
        else:  # detached tensors on an accelerator
            bad = False
            flags = [~torch.isfinite(v.detach().reshape(())) for v in values]
            flag = flags[0] if len(flags) == 1 else torch.stack(flags).any()
    if bad:
        return _finite_or_raise(ctx, bad, raise_, dist, "loss")
    if grads:
        if dist.shards_model:  # FSDP: this rank's shards; the flag is agreed over the ranks below
            grads = dist.local_shards(grads)
        if flag is None and grads[0].is_cpu:
            bad = not torch_private.grads_finite_on_host(grads, parts.opts.sum_check)  # no sync on the CPU
        else:
            found = torch_private.grads_nonfinite(grads).reshape(()) != 0.0
            flag = found if flag is None else flag | found.to(flag.device)
    if flag is not None:
        if dist.world_size == 1 and raise_:
            ctx.pending_nonfinite = flag if ctx.pending_nonfinite is None else ctx.pending_nonfinite | flag
            return True
        bad = bool(flag) if dist.world_size == 1 else dist.reduce_sum(flag.float().reshape(1)).item() != 0.0
        return _finite_or_raise(ctx, bad, raise_, None, "loss or gradient")
    if not bad and dist.world_size == 1:  # the common case: nothing to agree on over ranks, nothing to raise
        return True
    return _finite_or_raise(ctx, bad, raise_, dist, "gradient (the loss is finite)")


def _finite_or_raise(ctx: Context, bad: bool, raise_: bool, dist, what: str) -> bool:
    """`not bad` (agreed over the ranks first when `dist` is given), or FloatingPointError naming `what`
    was non-finite with nonfinite='raise'."""
    loop, parts = ctx.loop, ctx.parts
    if dist is not None and dist.world_size > 1:  # every rank takes the same step/skip edge
        bad = dist.reduce_sum(torch.tensor([float(bad)], device=parts.device)).item() != 0.0
    if bad and raise_:
        raise FloatingPointError(
            f"non-finite {what} in the update window ending at epoch {loop.epoch} batch {loop.batch_idx}"
            f" (precision={parts.config.precision!r}); pass nonfinite='skip' to Trainer to skip such updates"
        )
    return not bad
