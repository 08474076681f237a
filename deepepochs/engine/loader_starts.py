"""DataLoaders with persistent workers: their iterators made anew by a refit or a resume draw as the
uninterrupted run's did.

torch draws an iterator's base seed (its workers' seeds) from the DataLoader's `generator`, or from torch's
global generator when it has none, each time the DataLoader makes an iterator. With `persistent_workers=True`
it makes one at its first `iter()` and reuses it after, so the epochs and validation points after the first
draw no base seed. A stage that failed shuts those workers down (`deepepochs.data.workers.stage`), and a
resumed run holds new DataLoaders: their next `iter()` would draw a base seed the uninterrupted run never
drew, and every draw after it (a shuffle, dropout) would differ.

So the run state keeps, per stage and task of the running fit, where its persistent DataLoader first made an
iterator and the base seed it drew (`RunState.loader_starts`), and `start` makes an iterator the
uninterrupted run would have reused without that draw, its new workers seeded from the kept seed. Their own
generators start afresh there (the uninterrupted run's had drawn since; no process but the worker sees
them), which `start` says once per trainer.
"""

from __future__ import annotations

import warnings

from deepepochs import torch_private
from deepepochs.data import workers
from deepepochs.engine.context import Context
from deepepochs.errors import DeepEpochsWarning

__all__ = ["at_epoch_end", "start"]

#: The stages of a fit whose DataLoaders `start` keeps track of.
_FIT_STAGES = ("train", "val")


def start(ctx: Context, data):
    """`workers.start(data)` for the running fit's stage: a DataLoader with persistent workers whose iterator
    the uninterrupted run made earlier (`RunState.loader_starts`) and reused here makes one, if it holds
    none, without drawing its base seed; its first iterator in the run is kept there (see the module doc)."""
    stage = ctx.loop.stage
    if stage not in _FIT_STAGES or not (getattr(data, "persistent_workers", False) and data.num_workers):
        return workers.start(data)
    run, key = ctx.run, f"{stage}/{ctx.task_index}"
    starts = run.loader_starts or {}
    first = starts.get(key) or starts.get(f"{stage}/*")
    now = (run.epoch, run.updates)
    # A training task makes its iterator once an epoch: a refit of the epoch that made the first one makes
    # it again from that epoch's states (`engine.continuation`). A validation stage runs whole after a
    # commit point: one that ran before the current point had made it.
    earlier = first is not None and (first[0] < now[0] if stage == "train" else tuple(first[:2]) < now)
    remade = earlier and not torch_private.holds_iterator(data)
    iterator = workers.start(data, seed=first[2] if earlier else None)
    if first is None:
        run.loader_starts = {**starts, key: (*now, torch_private.base_seed(iterator))}
    if remade and "persistent workers" not in ctx.told:
        ctx.told.add("persistent workers")
        warnings.warn(
            f"continuing the fit after an interrupt, the {stage} DataLoader's persistent workers start anew:"
            " the batches, their order and the random draws of the main process continue exactly, but random"
            " draws inside the workers (augmentation in the dataset) start again from the workers' seeds"
            " instead of where the uninterrupted run's workers stood; seed them per sample or per epoch"
            " (e.g. from the index in __getitem__), or use persistent_workers=False, for an exact resume",
            DeepEpochsWarning, stacklevel=2)
    return iterator


def at_epoch_end(run, completed_epochs: int, updates: int) -> dict | None:
    """`RunState.loader_starts` as an epoch-end checkpoint implies it (it stores no position): the training
    tasks' DataLoaders made their iterators in the epochs completed, the validation tasks' at a validation
    the records hold (`"<stage>/*"`: every task of the stage; the base seed unknown, 0)."""
    starts = {}
    if completed_epochs:
        starts["train/*"] = (completed_epochs, updates, 0)
    if any(run.history.get("val", {}).values()):
        starts["val/*"] = (completed_epochs, updates, 0)
    return starts or None
