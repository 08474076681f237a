"""The resume policy: what the engine's resume step (the spec's `resume_checkpoint` action) calls to
honour `Trainer(resume=...)`.

It sits above the checkpoint layer, which it uses, and is handed to the engine as `Parts.resumer`: the
engine calls it with the facade (checkpoints load into a trainer) and never imports the checkpoint layer.
"""

from __future__ import annotations

from deepepochs.checkpoint import resume_once
from deepepochs.checkpoint.finished import apply_finished, report_retrained
from deepepochs.checkpoint.run_lock import lock_resumed_run

__all__ = ["resume_run"]


def resume_run(trainer) -> None:
    """Load what `resume=...` asks for into `trainer` (`checkpoint.resume_once`: the newest usable
    checkpoint of the run, with the run's history, into its run state); for a finished run (see
    `deepepochs.checkpoint.finished`) also its end, so the next fit trains nothing, and say which epochs a resume
    trains again. The fit's run lock follows the run the resume reads (`run_lock.lock_resumed_run`)."""
    loaded = resume_once(trainer, lambda run: lock_resumed_run(trainer, run))
    if loaded is not None:
        if not apply_finished(trainer, loaded[0].parent, loaded[1]):
            report_retrained(trainer, loaded[0].parent, loaded[1])
