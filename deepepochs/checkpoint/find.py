"""Finding checkpoints and honouring `Trainer(resume=...)`: the checkpoints of a run or of any run
under the monitors' folders, most progressed first, which run a resume may load, and loading the first
usable one (skipping, with a warning, the files this trainer cannot use).

A run's files are ordered by the progress they record (`by_progress`): completed epochs, then updates
(`SnapshotCallback`'s count, kept in every file), and only then the modification time, which breaks ties.
A run started afresh under the name of an older one in the same folder (`resume=False`) counts anew: its
files rank above the older run's, by the start time its `SnapshotCallback` records in them.
A file's time is not trusted beyond that: a run folder copied without its times, or a node whose clock
runs ahead, would otherwise make a requeued job resume an older file. A time that disagrees with the
recorded progress is warned about. Snapshot pruning (`SnapshotCallback(keep=)`) uses the same order.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path

from deepepochs.checkpoint import archive, shard_storage
from deepepochs.checkpoint.format import SUFFIX, Checkpoint, monitors_of
from deepepochs.checkpoint.load import check_fits, load_into
from deepepochs.checkpoint.read import exists, modified_ns, read_checkpoint
from deepepochs.checkpoint.write import remove_stale_temps
from deepepochs.engine import position
from deepepochs.engine.update_clock import counts_updates
from deepepochs.errors import CheckpointError, DeepEpochsWarning

__all__ = [
    "by_progress",
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


def _recorded_progress(path: Path) -> tuple[int, int, int] | None:
    """(run start, completed epochs, updates) that the checkpoint at `path` records, or None when it cannot
    be read.

    Only the small header is read: the file is memory-mapped, so its tensors are not loaded (a sharded
    checkpoint's `checkpoint.pt` holds none). The run start (when the run's first fit began) and the
    updates are what a `SnapshotCallback` recorded in every checkpoint of the run, 0 without one."""
    target = path / shard_storage.SIDE_CAR if path.is_dir() else path
    try:
        data = archive.load_plain(target, "checkpoint", mmap=True)
    except Exception:  # unreadable: ordered last, and the loader says why it is skipped
        return None
    if not isinstance(data, Mapping):
        return None
    epoch, monitors = data.get("epoch"), data.get("monitors")
    if isinstance(epoch, bool) or not isinstance(epoch, int):
        return None
    states = [s for s in monitors.values() if isinstance(s, Mapping)] if isinstance(monitors, Mapping) else []

    def largest(key):
        values = [s.get(key) for s in states]
        return max((v for v in values if isinstance(v, int) and not isinstance(v, bool)), default=0)

    return largest("started_ns"), epoch, largest("updates")


def by_progress(paths) -> list[Path]:
    """The checkpoints `paths` (of one run), the most progressed first: completed epochs, then updates, then
    the newest modification time, then the path (the files of a run started afresh under the same name
    before those of the older run). A file whose progress cannot be read (damaged, refused) comes first
    when it is newer than the most progressed file, else last. A file dated after one of the same
    run that records more progress gets a `DeepEpochsWarning` (its time is wrong: a copy that did not keep
    the times, or a clock running ahead)."""
    readable, unreadable = [], []
    for path in paths:
        progress = _recorded_progress(path)
        if progress is None:
            unreadable.append((modified_ns(path), str(path), path))
        else:
            readable.append((progress, modified_ns(path), str(path), path))
    readable.sort(reverse=True)
    for i, (progress, mtime, _, path) in enumerate(readable):
        ahead = next((other for other in readable[:i]
                      if other[0][0] == progress[0] and other[0] > progress and other[1] < mtime), None)
        if ahead is not None:
            warnings.warn(f"checkpoint {path} is dated after {ahead[3]} but records less progress ({progress[1]}"
                          f" epoch(s) and {progress[2]} update(s) completed, against {ahead[0][1]} and"
                          f" {ahead[0][2]}): the"
                          " files are ordered by the progress they record, not by their times (was the folder"
                          " copied without its times, or does a clock run ahead?)", DeepEpochsWarning,
                          stacklevel=3)
            break
    # A file whose progress cannot be read stands where its time puts it against the most progressed one,
    # so a named resume still reports a damaged newest file instead of passing over it.
    unreadable.sort(reverse=True)
    top = readable[0][1] if readable else None
    newer = [entry[-1] for entry in unreadable if top is None or entry[0] > top]
    return newer + [entry[-1] for entry in readable] + [entry[-1] for entry in unreadable if entry[-1] not in newer]


def find_checkpoint(ckpt_dirs, running_id: str | None = None) -> Path | None:
    """The most progressed checkpoint under `<ckpt_dir>/<run>/` for all `ckpt_dirs` (see `find_checkpoints`).

    With `running_id`, only that run's folders are searched and finding none is a `CheckpointError`
    naming the folders searched; without it, None means there is no checkpoint at all.
    """
    found = find_checkpoints(ckpt_dirs, running_id)
    return found[0] if found else None


def find_checkpoints(ckpt_dirs, running_id: str | None = None) -> list[Path]:
    """Every checkpoint under `<ckpt_dir>/<run>/` for all `ckpt_dirs`: each run's files most progressed first
    (`by_progress`); several runs (no `running_id`) by their newest file, the newest run first.

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
    runs_found: dict[str, list[Path]] = {}
    for path in found:  # one run's files, even when several ckpt_dirs hold a folder of its name
        runs_found.setdefault(path.parent.name, []).append(path)
    ordered = sorted(runs_found.values(), key=lambda files: max((modified_ns(p), str(p)) for p in files), reverse=True)
    return [path for files in ordered for path in by_progress(files)]


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
    """Where the loaded file continues: after a completed epoch, or inside an epoch (a mid-epoch snapshot);
    in updates of the run when the run counts them (`counts_updates`)."""
    pos = ckpt.position
    inside = isinstance(pos, Mapping) and {"epoch", "batches_done", "task_index"} <= set(pos)
    if counts_updates(trainer.config, trainer.loop):
        where = (f" (inside epoch {int(pos['epoch'])}, after {int(pos['batches_done'])} of its batch(es))" if inside
                 else f" ({ckpt.epoch} epoch(s) completed)")
        return f"{ckpt.updates} update(s) committed, continuing with update {ckpt.updates + 1}{where}"
    if not inside:
        target = trainer.loop.target_epochs
        if _fit_train_tasks(trainer) is not None and 0 < target <= ckpt.epoch:  # a fit with nothing left
            return f"{ckpt.epoch} epoch(s) completed, the fit's target of {target} epoch(s) is reached"
        return f"{ckpt.epoch} epoch(s) completed, continuing with epoch {ckpt.epoch + 1}"
    k = trainer.config.gradient_accumulation_steps
    done = int(pos["batches_done"])
    task = f" of training task {int(pos['task_index']) + 1}" if int(pos["task_index"]) > 0 else ""
    return (f"{ckpt.epoch} epoch(s) completed, continuing epoch {int(pos['epoch'])}{task} at its update"
            f" {-(-done // k) + 1} (after {done} batch(es); update {ckpt.updates + 1} of the run)")


def resume_once(trainer, lock_run=None) -> tuple[Path, int] | None:
    """Honour `Trainer(resume=...)` at the first fit, test or predict; a no-op afterwards. Returns the
    loaded file's path and epoch, or None when nothing was loaded.

    The run searched is `resume_scope`'s. Among its checkpoints (under the monitors' `ckpt_dir`s) the
    most progressed this trainer can load is loaded (`find_checkpoints`); with `resume=True` a file it
    cannot use (unreadable, not a checkpoint, one of another model or optimizer, a sharded folder with a
    missing or damaged shard, a mid-epoch snapshot whose position lies outside this fit's data) is skipped
    with a `DeepEpochsWarning` naming it and why, so an old or foreign file in the folder never stops
    `fit()`, and no usable file means a fresh start. `resume='<running id>'` loads that run's most
    progressed checkpoint or raises. The run folder's name becomes `trainer.running_id`, so new checkpoints
    go on into the same (possibly renamed) folder. A
    failed resume stays pending, so fixing the files and calling fit again retries it.

    `lock_run(run)`, when given, is called before a run's files are read and before a run starts fresh, so
    that the fit holds the lock of the run it loads or trains (`run_lock.lock_resumed_run`): `resume=True`
    without a `running_id` tries the runs newest first, each under its lock, re-listing its files then.
    """
    if not trainer.loop.resume_pending:
        return None
    loaded = None
    run, required, why = resume_scope(trainer)
    dirs = [m.ckpt_dir for m in monitors_of(trainer)]
    lock_run = lock_run or (lambda _run: None)
    if run is None:  # each run in turn, newest first, read under its lock
        path = ckpt = None
        candidates = []
        for other in dict.fromkeys(p.parent.name for p in find_checkpoints(dirs, None)):
            lock_run(other)
            files = _checkpoints_of_run(dirs, other)
            candidates += files
            path, ckpt = _load_newest_usable(trainer, files, strict=False)
            if path is not None:
                break
    else:
        candidates = find_checkpoints(dirs, run) if required else _checkpoints_of_run(dirs, run)
        if required:
            candidates = candidates[:1]  # the run was named: its most progressed file loads, or the error says why
        path, ckpt = _load_newest_usable(trainer, candidates, strict=required)
    if path is None:
        lock_run(str(trainer.running_id))
        folders = dict.fromkeys(Path(d) if run is None else Path(d) / run for d in dirs)
        searched = ", ".join(map(str, folders)) or "nowhere: no CheckCallback"
        found = f"no checkpoint this trainer can load among {len(candidates)}" if candidates else "no checkpoint"
        trainer.console.decision(f"{why}: {found} found (searched {searched}); starting run {trainer.running_id} fresh"
                                  + _hint_06_folder(dirs, candidates))
    else:
        trainer.running_id = path.parent.name
        trainer.console.decision(f"Resumed run {trainer.running_id} ({why}) from {path}:"
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
    """Load the first of `candidates` (most progressed first) that this trainer can use, into it; returns its path and
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
    """The run's checkpoints, most progressed first; none is no error (`resume=True` then starts the run fresh)."""
    try:
        return find_checkpoints(dirs, run)
    except CheckpointError:
        return []
