"""Finished runs: a run that ended (epoch target reached or stopped early) says so when
it is resumed, and returns its records without training.

When a fit ends normally, each `CheckCallback` (rank 0) writes `finished.pt` into its run folder, next to
the checkpoints: a `torch.save` dict of numbers, strings, lists and dicts, read with `weights_only=True`:

==================  ==========================================================================
`completed_epochs`  int, epochs the run had completed when it ended.
`target_epochs`     int, the epoch target of that fit.
`stop_reason`       str or None: why it stopped early (None: it reached its target).
`stop_source`       str: what asked for the stop (e.g. `CheckCallback(val-loss.best)`), or ''.
`records`           `{'train': {name: [per epoch]}, 'val': {...}}`: the trainer's history at the end
                    (the epochs of the fits of the trainer that ended the run, those it resumed
                    from a finished run included).
==================  ==========================================================================

`resume=True` (or `resume='<run>'`) reads it from the folder of the checkpoint it loads. The file counts
when it is not older than that checkpoint (`completed_epochs` >= the checkpoint's epoch): a fit that went
on after it and saved later epochs has made it stale. A counting file restores the completed epoch count,
the history and an early stop; `fit()` then trains nothing (the stop, or a reached target, ends it at
once) and returns the run's records. A run that reached its target trains on when `epochs=` is raised;
an early-stopped run stays stopped: to train it further, delete its `finished.pt` (or start a new run).
The file is not a checkpoint (it does not end in `.ckpt`) and is never picked by resume as one.

Progress: a `CheckCallback(save_best=True)` rewrites its checkpoint only when the metric improves, so a
run that crashes after a worse epoch has no file of its last epoch. Such a monitor therefore records, at
every epoch's end, `progress.pt` (`{'completed_epochs': int}`) next to its checkpoints; a resume that
loads an older epoch than that says which epochs are trained again and why (`report_retrained`).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from deepepochs.checkpoint import plain_records, write_atomic

__all__ = ["FINISHED_FILE", "PROGRESS_FILE", "apply_finished", "read_finished", "report_retrained",
           "write_finished", "write_progress"]

FINISHED_FILE = "finished.pt"
PROGRESS_FILE = "progress.pt"


def write_finished(trainer, folder) -> Path:
    """Record in `folder` that the trainer's run ended now (called at the end of a fit, on rank 0)."""
    loop = trainer.loop
    stop = loop.stop
    data = {
        "completed_epochs": int(loop.completed_epochs),
        "target_epochs": int(loop.target_epochs),
        "stop_reason": None if stop is None else str(stop.reason),
        "stop_source": "" if stop is None else str(stop.source),
        "records": plain_records(trainer.history),
    }
    return write_atomic(data, Path(folder) / FINISHED_FILE)


def read_finished(folder) -> dict | None:
    """The run-end record in `folder`, or None when there is none or it cannot be read (a run without a
    readable record is resumed as unfinished, as before this record existed)."""
    path = Path(folder) / FINISHED_FILE
    if not path.is_file():
        return None
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # a damaged marker must not block a resume: the checkpoint itself is what counts
        return None
    keys = {"completed_epochs", "target_epochs", "stop_reason", "stop_source", "records"}
    if not isinstance(data, dict) or not keys <= set(data) or not isinstance(data["completed_epochs"], int):
        return None
    return data


def apply_finished(trainer, folder, ckpt_epoch: int) -> dict | None:
    """After a resume loaded a checkpoint of epoch `ckpt_epoch` from `folder`: if the run's end record
    counts, restore its epoch count, history and early stop, say so, and return its records when the next
    fit has nothing to train (else None)."""
    finished = read_finished(folder)
    if finished is None or finished["completed_epochs"] < ckpt_epoch:
        return None
    loop = trainer.loop
    loop.completed_epochs = loop.epoch = finished["completed_epochs"]
    records = finished["records"]
    for stage, metrics in trainer.history.items():
        metrics.clear()
        metrics.update(copy.deepcopy(records.get(stage, {})))
    if finished["stop_reason"] is not None:
        trainer.request_stop(finished["stop_reason"], finished["stop_source"])
        how = f"stopped early after epoch {loop.completed_epochs}: {finished['stop_reason']}"
    else:
        how = f"completed {loop.completed_epochs} of {finished['target_epochs']} epoch(s)"
    if loop.stop is None and loop.completed_epochs < loop.target_epochs:
        trainer.console.decision(f"Run {trainer.running_id} had {how}; training on to epoch {loop.target_epochs}")
        return None
    if finished["stop_reason"] is not None:
        on = (f"to train on from its last checkpoint (as deepepochs 0.6 did), delete {Path(folder) / FINISHED_FILE}"
              " and fit again; to start afresh, pass a new running_id")
    else:
        on = (f"to train on, raise epochs= above {loop.completed_epochs} (Trainer(epochs=...) or"
              " fit(epochs=...)); to start afresh, pass a new running_id")
    trainer.console.decision(f"Run {trainer.running_id} is finished ({how}); fit() returns its records without"
                              f" training. {on[0].upper()}{on[1:]}")
    return copy.deepcopy(records)


def write_progress(trainer, folder) -> Path:
    """Record in `folder` how many epochs the run has completed (at an epoch's end, on rank 0)."""
    return write_atomic({"completed_epochs": int(trainer.loop.completed_epochs)}, Path(folder) / PROGRESS_FILE)


def report_retrained(trainer, folder, ckpt_epoch: int) -> int:
    """After a resume loaded a checkpoint of epoch `ckpt_epoch` from `folder`: when the run had completed
    more epochs (its progress record says so), say which epochs will be trained again and why. Returns
    how many."""
    path = Path(folder) / PROGRESS_FILE
    try:
        data = torch.load(path, map_location="cpu", weights_only=True) if path.is_file() else None
    except Exception:  # a damaged record must not block a resume: the checkpoint itself is what counts
        data = None
    done = data.get("completed_epochs") if isinstance(data, dict) else None
    if not isinstance(done, int) or done <= ckpt_epoch or trainer.loop.completed_epochs >= done:
        return 0
    again = f"epoch {done}" if done == ckpt_epoch + 1 else f"epochs {ckpt_epoch + 1} to {done}"
    trainer.console.decision(
        f"Run {trainer.running_id} had completed {done} epoch(s), but its newest checkpoint is of epoch"
        f" {ckpt_epoch}: {again} will be trained again (a CheckCallback with save_best=True saves only"
        " improving epochs; add CheckCallback(..., save_best=False) or a SnapshotCallback to resume from"
        " the last epoch)")
    return done - ckpt_epoch
