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
A run that reached its target after the epoch of the checkpoint loaded (a `save_best=True` monitor whose
best epoch was not the last) has no saved latest state: the record is not restored, the run says so and
continues from the loaded file with that file's progress and history (the epochs after it are trained
again, each recorded once under its own number).
The file is not a checkpoint (it does not end in `.ckpt`) and is never picked by resume as one.

Progress: a `CheckCallback(save_best=True)` rewrites its checkpoint only when the metric improves, so a
run that crashes after a worse epoch has no file of its last epoch. Such a monitor therefore records, at
every epoch's end, `progress.pt` (`{'completed_epochs': int}`) next to its checkpoints; a resume that
loads an older epoch than that says which epochs are trained again and why (`report_retrained`).
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

from deepepochs.checkpoint import archive, field_rules, plain_records, write_atomic
from deepepochs.config import UNBOUNDED_EPOCHS
from deepepochs.errors import CheckpointError, DeepEpochsWarning

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


def _ignored(path: Path, why: str) -> None:
    """Say that a damaged record beside the checkpoints is not used (the checkpoint itself still loads)."""
    warnings.warn(f"resume ignored {path}: {why}; the checkpoint itself was loaded. Delete the file (it is"
                  " rewritten at the run's next epoch end or finish)", DeepEpochsWarning, stacklevel=3)


def _read_record(path: Path, what: str):
    """The record at `path` (bounded and weights-only, `archive.load_plain`), or None with a warning when it
    cannot be read."""
    try:
        return archive.load_plain(path, what)
    except CheckpointError as e:
        _ignored(path, str(e))
        return None


def read_finished(folder, ckpt_epoch: int = 0, history=None) -> dict | None:
    """The run-end record in `folder` that a resume from a checkpoint of `ckpt_epoch` completed epochs (whose
    history is `history`, None when unknown) may use, or None: there is none, it is older than the
    checkpoint (stale), or it breaks its rules (`field_rules.finished_problems`: then with a `DeepEpochsWarning`;
    a run without a usable record is resumed as unfinished, as before this record existed)."""
    path = Path(folder) / FINISHED_FILE
    if not path.is_file():
        return None
    data = _read_record(path, "run-end record")
    if data is None:
        return None
    done = data.get("completed_epochs") if isinstance(data, dict) else None
    if isinstance(done, int) and not isinstance(done, bool) and 0 <= done < ckpt_epoch:
        return None  # stale: a fit went on after it and saved later epochs
    problems = field_rules.finished_problems(data, ckpt_epoch, history)
    if problems:
        _ignored(path, "its fields break the run-end record's rules: " + "; ".join(problems))
        return None
    return data


def _latest_not_saved(trainer, finished: dict, ckpt_epoch: int) -> bool:
    """Whether the run reached its target after the epoch of the checkpoint loaded (a `save_best=True`
    monitor kept an earlier, better epoch): then its end is not restored and the run continues from the
    loaded file, whose progress is the run's; say so (True)."""
    done = finished["completed_epochs"]
    if finished["stop_reason"] is not None or done <= ckpt_epoch:
        return False
    target = finished["target_epochs"]
    of = f" of {target}" if target < UNBOUNDED_EPOCHS else ""  # a fit by updates has no epoch target to name
    loaded, again = _retrained(trainer, ckpt_epoch, done)
    trainer.console.decision(
        f"Run {trainer.running_id} had completed {done}{of} epoch(s), but its latest state was not saved: its"
        f" newest checkpoint is of {loaded}, so the run continues from there and {again} (a CheckCallback with"
        " save_best=True saves only improving epochs; add CheckCallback(..., save_best=False) or a"
        " SnapshotCallback to keep the last epoch)")
    return True


def _loaded(trainer, ckpt_epoch: int) -> str:
    """What the file a resume loaded is of: an epoch's end, or a validation point inside an epoch (its
    position is loaded)."""
    point = trainer.loop.resume
    if point is None or point.task_index < 0:
        return f"epoch {ckpt_epoch}"
    return f"update {trainer.loop.run.updates} (inside epoch {point.epoch})"


def _retrained(trainer, ckpt_epoch: int, done: int) -> tuple[str, str]:
    """For the messages of a resume from a file older than the run's `done` completed epochs: what the loaded
    file is of (`_loaded`), and what the run trains again."""
    point, updates, loaded = trainer.loop.resume, trainer.loop.run.updates, _loaded(trainer, ckpt_epoch)
    if point is None or point.task_index < 0:
        again = f"epoch {done}" if done == ckpt_epoch + 1 else f"epochs {ckpt_epoch + 1} to {done}"
        return loaded, f"{again} will be trained again"
    budget = trainer.config.max_updates
    if budget is not None and updates >= budget:
        return loaded, f"epoch {point.epoch} ends at once (that update reached max_updates: nothing is trained again)"
    return loaded, f"the updates after it to the end of epoch {done} will be trained again"


def apply_finished(trainer, folder, ckpt_epoch: int) -> bool:
    """After a resume loaded a checkpoint of epoch `ckpt_epoch` from `folder`: if the run's end record
    counts, restore its epoch count, history and early stop and say so. A run that reached its target
    after the loaded epoch keeps the file's progress (a count from the record would label the epochs
    trained next wrongly and record some twice) and says that it continues from the file.

    Returns:
        Whether a message already said which epochs are trained again (`report_retrained` then says
        nothing more)."""
    finished = read_finished(folder, ckpt_epoch, trainer.history)
    if finished is None:
        return False
    if _latest_not_saved(trainer, finished, ckpt_epoch):
        return True
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
        target = finished["target_epochs"]
        how = (f"completed {loop.completed_epochs} of {target} epoch(s)" if target < UNBOUNDED_EPOCHS else
               f"completed {loop.completed_epochs} epoch(s), {loop.run.updates} update(s)")
    if loop.stop is None and loop.completed_epochs < loop.target_epochs:
        to = (f"epoch {loop.target_epochs}" if loop.target_epochs < UNBOUNDED_EPOCHS else
              f"update {trainer.config.max_updates} (max_updates)")
        trainer.console.decision(f"Run {trainer.running_id} had {how}; training on to {to}")
        return False
    if finished["stop_reason"] is not None:
        on = (f"to train on from its last checkpoint (as deepepochs 0.6 did), delete {Path(folder) / FINISHED_FILE}"
              " and fit again; to start afresh, pass a new running_id")
    else:
        on = (f"to train on, raise epochs= above {loop.completed_epochs} (Trainer(epochs=...) or"
              " fit(epochs=...)); to start afresh, pass a new running_id")
    if ckpt_epoch < loop.completed_epochs:  # stopped early after its best epoch: say which weights are loaded
        how += f"; the weights loaded are those of {_loaded(trainer, ckpt_epoch)}, its checkpoint"
    trainer.console.decision(f"Run {trainer.running_id} is finished ({how}); fit() returns its records without"
                              f" training. {on[0].upper()}{on[1:]}")
    return False


def write_progress(trainer, folder) -> Path:
    """Record in `folder` how many epochs the run has completed (at an epoch's end, on rank 0)."""
    return write_atomic({"completed_epochs": int(trainer.loop.completed_epochs)}, Path(folder) / PROGRESS_FILE)


def report_retrained(trainer, folder, ckpt_epoch: int) -> int:
    """After a resume loaded a checkpoint of epoch `ckpt_epoch` from `folder`: when the run had completed
    more epochs (its progress record says so), say which epochs will be trained again and why. Returns
    how many."""
    path = Path(folder) / PROGRESS_FILE
    data = _read_record(path, "progress record") if path.is_file() else None
    if data is None:
        return 0
    problems = field_rules.progress_problems(data)
    if problems:  # a damaged record must not block a resume: the checkpoint itself is what counts
        _ignored(path, "its fields break the progress record's rule: " + "; ".join(problems))
        return 0
    done = data["completed_epochs"]
    if done <= ckpt_epoch or trainer.loop.completed_epochs >= done:
        return 0
    loaded, again = _retrained(trainer, ckpt_epoch, done)
    trainer.console.decision(
        f"Run {trainer.running_id} had completed {done} epoch(s), but its newest checkpoint is of {loaded}:"
        f" {again} (a CheckCallback with save_best=True saves only improving epochs; add"
        " CheckCallback(..., save_best=False) or a SnapshotCallback to resume from the last epoch)")
    return done - ckpt_epoch
