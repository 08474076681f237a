"""Gradients an update leaves in place: those of the optimizers that did not step.

An update zeroes only the gradients of the optimizers it stepped, as a plain loop's `opt.step();
opt.zero_grad()` does; the other optimizers' gradients keep adding up until their turn (a step that calls
`self.optimize(self.n % 2)` after one backward updates each optimizer every other batch, with two batches'
gradients). What they hold right after an update belongs to that commit point, so the run state keeps a
copy (`RunState.grads`, keyed `"<optimizer>.<group>.<position>"`): a rollback writes it back instead of
the gradients the discarded window added, and a fit starts from it (a refit after a fault continues as
the uninterrupted run would, a later fit as a longer plain loop would), after dropping any gradient user
code left between fits. Mid-epoch snapshots store it with the run state's generic fields.

With one optimizer, or when every optimizer stepped, nothing is left and nothing is copied.
"""

from __future__ import annotations

import torch

from deepepochs.engine.context import Context

__all__ = ["forget", "keep", "put_back"]


def _params(opts):
    """`(key, parameter)` for every parameter of every optimizer, in optimizer, group, position order."""
    for i, item in enumerate(opts.items):
        for g, group in enumerate(item.opt.param_groups):
            for j, p in enumerate(group["params"]):
                yield f"{i}.{g}.{j}", p


def keep(ctx: Context) -> None:
    """A commit point: the run state's `grads` become copies of the gradients the optimizers' parameters
    hold now (None when they hold none)."""
    kept = {key: p.grad.detach().clone() for key, p in _params(ctx.parts.opts) if p.grad is not None}
    ctx.run.grads = kept or None


def put_back(ctx: Context) -> None:
    """Every optimizer's gradients as the last commit point kept them: the kept ones written back, every
    other one dropped (set to None)."""
    opts = ctx.parts.opts
    opts.zero_grad(opts.all_indices)
    kept = ctx.run.grads
    if not kept:
        return
    with torch.no_grad():
        for key, p in _params(opts):
            saved = kept.get(key)
            if saved is not None and saved.shape == p.shape:
                p.grad = saved.to(device=p.device, dtype=p.dtype, copy=True)


def forget(ctx: Context) -> None:
    """Nothing is kept (a checkpoint was loaded: its model's gradients start empty)."""
    ctx.run.grads = None
