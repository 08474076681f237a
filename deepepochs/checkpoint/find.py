"""Finding checkpoints and honouring `Trainer(resume=...)`: the newest checkpoint of a run or of
any run under the monitors' folders, which run a resume may load, and loading the newest usable one
(skipping, with a warning, the files this trainer cannot use).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path

from deepepochs.checkpoint.format import SUFFIX, Checkpoint, monitors_of
from deepepochs.checkpoint.load import check_fits, load_into
from deepepochs.checkpoint.read import exists, modified_ns, read_checkpoint
from deepepochs.checkpoint.write import remove_stale_temps
from deepepochs.engine import position
from deepepochs.errors import CheckpointError, DeepEpochsWarning

__all__ = [
    "find_checkpoint",
    "find_checkpoints",
    "resume_once",
    "resume_scope",
]


def _checkpoints_in(folder: Path) -> list[Path]:
    """The checkpoints in one run folder: `.ckpt` files and committed sharded folders, never a hidden
    temporary file of a save in progress."""
    if not folder.is_dir():
        return []
    return [p for p in folder.iterdir() if p.suffix == SUFFIX and not p.name.startswith(".") and exists(p)]


def find_checkpoint(ckpt_dirs, running_id: str | None = None) -> Path | None:
    """The newest checkpoint (by modification time) under `<ckpt_dir>/<run>/` for all `ckpt_dirs`.

    With `running_id`, only that run's folders are searched and finding none is a `CheckpointError`
    naming the folders searched; without it, None means there is no checkpoint at all.
    """
    found = find_checkpoints(ckpt_dirs, running_id)
    return found[0] if found else None


def find_checkpoints(ckpt_dirs, running_id: str | None = None) -> list[Path]:
    """Every checkpoint under `<ckpt_dir>/<run>/` for all `ckpt_dirs`, newest (modification time) first.

    With `running_id`, only that run's folders are searched and finding none is a `CheckpointError`.
    """
    dirs = list(dict.fromkeys(Path(d) for d in ckpt_dirs))
    if running_id is None:
        runs = [run for d in dirs if d.is_dir() for run in d.iterdir() if run.is_dir()]
    else:
        runs = [d / running_id for d in dirs]
    found = [p for run in runs for p in _checkpoints_in(run)]
    if not found:
        if running_id is None:
            return []
        searched = ", ".join(str(r) for r in runs) or "(no CheckCallback, so no ckpt_dir to search)"
        raise CheckpointError(f"resume={running_id!r}: no checkpoint of that run was found;"
                              f" searched {searched}")
    # Newest first by mtime; the path breaks ties so the choice is deterministic.
    return sorted(found, key=lambda p: (modified_ns(p), str(p)), reverse=True)


def _hint_06_folder(dirs, candidates) -> str:
    """When resume found nothing and 0.6's default folder `./logs` holds 0.6 checkpoints, say how to resume
    them (0.6's CheckCallback saved to ./logs/<running id>/checkpoint.ckpt; 0.7's default is ./checkpoints)."""
    legacy = Path("./logs")
    if candidates or any(Path(d).resolve() == legacy.resolve() for d in dirs):
        return ""
    if not any(legacy.glob("*/checkpoint.ckpt")):
        return ""
    return (". deepepochs 0.6 checkpoints are in ./logs, 0.6's default folder: pass"
            " CheckCallback(..., ckpt_dir='./logs') to resume them")


def resume_scope(trainer) -> tuple[str | None, bool, str]:
    """Which run `Trainer(resume=...)` may load, whether that run must exist, and why (for the console).

    `resume='<run>'` names the run, which must have a checkpoint. `resume=True` with a `running_id` given
    to the Trainer is that run only, started fresh when it has no files yet (the requeue pattern: the same
    command line resumes its own run and never another job's). `resume=True` without a `running_id` takes
    the newest checkpoint of any run under the monitors' folders.
    """
    resume = trainer.resume
    if isinstance(resume, str):
        return resume, True, f"resume={resume!r}"
    if trainer.loop.run.running_id_given:
        return str(trainer.running_id), False, f"resume=True with running_id={str(trainer.running_id)!r}"
    return None, False, "resume=True without a running_id: the newest checkpoint of any run"


def _position_text(ckpt: Checkpoint, trainer) -> str:
    """Where the loaded file continues: after a completed epoch, or inside an epoch (a mid-epoch snapshot)."""
    pos = ckpt.position
    if not isinstance(pos, Mapping) or not {"epoch", "batches_done", "task_index"} <= set(pos):
        return f"{ckpt.epoch} epoch(s) completed, continuing with epoch {ckpt.epoch + 1}"
    k = trainer.config.gradient_accumulation_steps
    done = int(pos["batches_done"])
    task = f" of training task {int(pos['task_index']) + 1}" if int(pos["task_index"]) > 0 else ""
    return (f"{ckpt.epoch} epoch(s) completed, continuing epoch {int(pos['epoch'])}{task} at update"
            f" {-(-done // k) + 1} (after {done} batch(es))")


def resume_once(trainer) -> tuple[Path, int] | None:
    """Honour `Trainer(resume=...)` at the first fit, test or predict; a no-op afterwards. Returns the
    loaded file's path and epoch, or None when nothing was loaded.

    The run searched is `resume_scope`'s. Among its checkpoints (under the monitors' `ckpt_dir`s) the
    newest this trainer can load is loaded; with `resume=True` a file it cannot use (unreadable, not a
    checkpoint, one of another model or optimizer, a sharded folder with a missing or damaged shard, a
    mid-epoch snapshot whose position lies outside this fit's data) is skipped with a `DeepEpochsWarning`
    naming it and why, so an old or foreign file in the folder never stops `fit()`, and no usable file means
    a fresh start. `resume='<running id>'` loads that run's newest checkpoint or raises. The run folder's name
    becomes `trainer.running_id`, so new checkpoints go on into the same (possibly renamed) folder. A
    failed resume stays pending, so fixing the files and calling fit again retries it.
    """
    if not trainer.loop.resume_pending:
        return None
    loaded = None
    run, required, why = resume_scope(trainer)
    dirs = [m.ckpt_dir for m in monitors_of(trainer)]
    candidates = find_checkpoints(dirs, run) if required or run is None else _checkpoints_of_run(dirs, run)
    if required:
        candidates = candidates[:1]  # the run was named: its newest file loads, or the error says why
    path, ckpt = _load_newest_usable(trainer, candidates, strict=required)
    if path is None:
        folders = dict.fromkeys(Path(d) if run is None else Path(d) / run for d in dirs)
        searched = ", ".join(map(str, folders)) or "nowhere: no CheckCallback"
        found = f"no checkpoint this trainer can load among {len(candidates)}" if candidates else "no checkpoint"
        trainer.console.info(f"{why}: {found} found (searched {searched}); starting run {trainer.running_id} fresh"
                              + _hint_06_folder(dirs, candidates))
    else:
        trainer.running_id = path.parent.name
        trainer.console.info(f"Resumed run {trainer.running_id} ({why}) from {path}:"
                              f" {_position_text(ckpt, trainer)}")
        loaded = (path, ckpt.epoch)
    trainer.loop.resume_pending = False
    return loaded


def _fit_train_tasks(trainer) -> list | None:
    """The training tasks of the fit that is resuming (None when a test or predict resumes): what a
    snapshot's mid-epoch position is checked against."""
    return trainer.loop.resume_tasks


def _load_newest_usable(trainer, candidates: list[Path], strict: bool) -> tuple[Path | None,
                                                                                Checkpoint | None]:
    """Load the first of `candidates` (newest first) that this trainer can use, into it; returns its path and
    contents, or (None, None). A candidate that cannot be used is skipped with a `DeepEpochsWarning` naming
    it and why, whatever fails: reading it, checking it against the trainer (and a mid-epoch snapshot's
    position against the fit's training data), or reading its tensors (a sharded folder with a damaged
    shard). Loading is all or nothing, so a skipped candidate changed nothing.
    `strict` (a named run): the first candidate loads or its `CheckpointError` is raised."""
    for candidate in candidates:
        try:
            ckpt = read_checkpoint(candidate)
            check_fits(trainer, ckpt, candidate)
            train = _fit_train_tasks(trainer)
            if ckpt.position is not None and train:  # a mid-epoch position must lie inside this fit's data
                position.check_data(ckpt.position, train, trainer.world_size, candidate)
            remove_stale_temps(candidate.parent)
            return candidate, load_into(trainer, candidate, ckpt)
        except CheckpointError as e:
            if strict:
                raise
            warnings.warn(f"resume=True skipped {candidate}: {e}", DeepEpochsWarning, stacklevel=3)
    return None, None


def _checkpoints_of_run(dirs, run: str) -> list[Path]:
    """The run's checkpoints, newest first; none is no error (`resume=True` then starts the run fresh)."""
    try:
        return find_checkpoints(dirs, run)
    except CheckpointError:
        return []
