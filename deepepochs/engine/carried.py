"""State a step carries from one batch to the next (`trainer.carried`): an RNN's hidden state, a queue.

A step reads and writes the dict `trainer.carried` (`Context.carried`) as it likes. Like the model's buffers,
what it holds changes before the window's update commits, so the run state keeps a copy of it at every
commit point (`RunState.carried`, `keep`: at the fit's start, after each update, at each epoch's end) and a
rollback writes that copy back (`put_back`), so a refit continues from the state the last commit point
saw. `find_lr` and a failed checkpoint load restore it like every other field of the run state.

Every checkpoint file holds it under `carried`, per rank (`stored`, read back by `load`, the only code
path for every kind of file: an epoch's end, a mid-epoch snapshot, a sharded folder's `checkpoint.pt`, a
consolidated file). What a file holds is the state of its commit point (`at_commit_point`): at an epoch's
end (saves run just before `commit_epoch` keeps it) and outside a fit the dict as it is, validation
steps' writes included; in a mid-epoch snapshot the copy its last committed update kept.

Values are copied with their tensors detached and cloned (a hidden state still holding its graph is kept
as its value), containers rebuilt; anything else is deep-copied.
"""

from __future__ import annotations

import copy
import warnings

import torch

from deepepochs.engine import position
from deepepochs.engine.context import Context
from deepepochs.errors import DeepEpochsWarning

__all__ = ["at_commit_point", "copied", "forget", "keep", "load", "put_back", "stored", "write"]


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
    live, run = ctx.carried, ctx.loop.run  # the run state, without `ctx.run`'s property call: once per update
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


def at_commit_point(live: dict, run, mid_epoch: bool) -> dict | None:
    """What a checkpoint file holds of the carried state: with `mid_epoch` (a snapshot) the copy the run
    state kept at its last committed update (`run.carried`), else `live` as it is (an epoch's end: the
    save runs just before `commit_epoch` keeps it; outside a fit nothing is kept)."""
    return run.carried if mid_epoch and run.carried is not None else live


def stored(value: dict | None) -> dict | None:
    """One rank's carried state as a file holds it (`position.encode`: tensors on the CPU, tuples and dicts
    tagged), or None with a `DeepEpochsWarning` when it holds what a file cannot store (a resume then
    leaves `trainer.carried` as it is)."""
    if value is None:
        return None
    try:
        return position.encode(dict(value))
    except TypeError as e:
        warnings.warn(f"a checkpoint cannot store trainer.carried ({e}): store tensors, numbers, strings and"
                      " lists, tuples or str-keyed dicts of them; a resume from it keeps trainer.carried as it is",
                      DeepEpochsWarning, stacklevel=3)
        return None


def load(live: dict, entries: list | None, rank: int, world_size: int, device: torch.device) -> None:
    """Make `live` (`trainer.carried`) what a file's `carried` (`entries`, one `stored` value per rank of the
    run that wrote it) holds for this rank: its own at the same world size, rank 0's on another (as a
    mid-epoch snapshot's run state). Nothing changes when the file has none (an older file) or none for this
    rank."""
    if not entries:
        return
    entry = entries[rank] if len(entries) == world_size else entries[0]
    if entry is not None:
        write(live, position.decode(entry, device))
