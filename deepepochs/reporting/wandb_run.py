"""`WandbRun`: the Weights & Biases side of `WandbCallback`, one W&B run per deepepochs run.

Every method runs on the callback's worker thread (`reporting.background.BackgroundCalls`); `wandb` itself
is imported there too (importing it takes seconds). The W&B run of a deepepochs run has the running id as
its id (`wandb_run_id`) and is opened with `resume='allow'`, so a resumed, refit or requeued fit continues
it. W&B keeps a run's steps in increasing order: records come in step order, and one at a step below the
run's last is not sent (said as a failure, with the count, instead of W&B's own warning per record).
"""

from __future__ import annotations

import hashlib
import os
import re

__all__ = ["WandbRun", "wandb_run_id"]

#: W&B run ids: at most 64 characters, none of `/ \ # ? % :` (these are kept to letters, digits, `-`, `_`).
_ID_LENGTH = 64
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
#: The exit code W&B is given for each status (W&B marks a run with a non-zero code failed).
_EXIT_CODES = {"FINISHED": 0, "FAILED": 1, "KILLED": 143}


def wandb_run_id(running_id: str) -> str:
    """The W&B run id of the deepepochs run `running_id`: the running id itself when W&B takes it, else its
    safe characters followed by a hash of the whole name (two running ids never share a W&B run)."""
    safe = _UNSAFE.sub("-", running_id)
    if safe == running_id and 0 < len(running_id) <= _ID_LENGTH:
        return running_id
    digest = hashlib.sha256(running_id.encode()).hexdigest()[:12]
    return f"{safe[:_ID_LENGTH - 13]}-{digest}"


class WandbRun:
    """The W&B run of one deepepochs run, held by the worker thread.

    Args:
        project: the W&B project.
        mode: W&B's mode ('online', 'offline', 'disabled'), or None for W&B's default (`WANDB_MODE`).
        dir: the folder W&B writes its files under, or None for W&B's default.
        init_kwargs: more arguments of `wandb.init` (entity, group, tags, notes, settings, ...).
    """

    def __init__(self, project: str, mode, dir, init_kwargs: dict):
        self.project, self.mode, self.dir = project, mode, dir
        self.init_kwargs = dict(init_kwargs)
        self.run = None
        self._last_step = -1

    def open(self, running_id: str, fresh: bool, tags: dict, params: dict) -> None:
        """Start (or continue: `resume='allow'`) the W&B run whose id is `wandb_run_id(running_id)`; the
        Trainer's `hyper_params` and deepepochs' tags go into its config."""
        import wandb

        if self.run is not None:  # a resume renamed the run: the previous one ends first
            self.run.finish()
        config = {**{str(k): v for k, v in params.items()}, **{k: str(v) for k, v in tags.items()}}
        self.run = wandb.init(project=self.project, id=wandb_run_id(running_id), name=running_id, resume="allow",
                              mode=self.mode, dir=None if self.dir is None else os.fspath(self.dir),
                              reinit="create_new", **self.init_kwargs)
        self.run.config.update(config, allow_val_change=True)
        self._last_step = int(getattr(self.run, "step", 0) or 0) - 1  # a continued online run's next step

    def log(self, records) -> None:
        """Each `(step, {tag: value}, time in ms)` of `records` at W&B step `step`; records at a step below
        the run's last are not sent, and said so."""
        behind = []
        for step, scalars, _ in records:
            if step < self._last_step:
                behind.append(step)
                continue
            self.run.log({tag: float(value) for tag, value in scalars.items()}, step=int(step))
            self._last_step = int(step)
        if behind:
            raise RuntimeError(f"W&B keeps a run's steps in increasing order: {len(behind)} record(s) at steps"
                               f" {sorted(set(behind))[:5]} below the run's step {self._last_step} were not sent")

    def log_file(self, path, folder: str) -> None:
        """Store a checkpoint file (or a folder's files) as a version of the run's `<id>-<folder>` artifact."""
        import wandb

        artifact = wandb.Artifact(f"{self.run.id}-{folder}", type="model")
        if os.path.isdir(path):
            artifact.add_dir(os.fspath(path), name=os.path.basename(path))
        else:
            artifact.add_file(os.fspath(path))
        self.run.log_artifact(artifact)

    def finish(self, status: str) -> None:
        """End the run with `status` ('FINISHED', 'FAILED' or 'KILLED': W&B marks the last two failed)."""
        if self.run is not None:
            self.run.finish(exit_code=_EXIT_CODES.get(status, 1))
            self.run = None
