"""State a step carries from one batch to the next (`trainer.carried`): an RNN's hidden state, a queue.

A step reads and writes the dict `trainer.carried` (`Context.carried`) as it likes. Like the model's buffers,
what it holds changes before the window's update commits, so the run state keeps a copy of it at every
commit point (`RunState.carried`, `keep`: at the fit's start, after each update, at each epoch's end) and a
rollback writes that copy back (`put_back`), so a refit continues from the state the last commit point
saw. Being a generic field of the run state, the copy is stored per rank in mid-epoch snapshots (a resume
puts it back with `write`), and `find_lr` and a failed checkpoint load restore it like every other field.

Values are copied with their tensors detached and cloned (a hidden state still holding its graph is kept
as its value), containers rebuilt; anything else is deep-copied.
"""

from __future__ import annotations

import copy

import torch

from deepepochs.engine.context import Context

__all__ = ["copied", "forget", "keep", "put_back", "write"]


def copied(value):
    """An independent copy of `value`: tensors detached and cloned, lists, tuples and dicts rebuilt."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: copied(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(copied(item) for item in value)
    return copy.deepcopy(value)


def keep(ctx: Context, fresh: bool = False) -> None:
    """A commit point: make the run state's `carried` a copy of `trainer.carried` as it is now. Nothing is
    copied while both are empty (a run that carries nothing pays one check per update); `fresh`, at a fit's
    start, always takes it."""
    live, run = ctx.carried, ctx.run
    if fresh or live or run.carried:
        run.carried = copied(live)


def write(live: dict, saved: dict | None) -> None:
    """Make `live` (`trainer.carried`, the dict the step holds) equal to a copy of `saved`, in place;
    nothing when `saved` is None (nothing was kept)."""
    if saved is not None:
        live.clear()
        live.update(copied(saved))


def put_back(ctx: Context) -> None:
    """Rollback: `trainer.carried` as the last commit point of the running fit kept it. The copy is then
    dropped, as the buffers' are (`buffers.put_back`): outside a fit nothing is kept, so a rollback of a
    test never undoes what the user did in between; the next fit takes it afresh."""
    write(ctx.carried, ctx.run.carried)
    forget(ctx)


def forget(ctx: Context) -> None:
    """The fit is over: nothing is kept outside a fit (see `put_back`)."""
    ctx.run.carried = None
