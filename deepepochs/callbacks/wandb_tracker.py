"""`WandbCallback`: a run's records in Weights & Biases, one W&B run per deepepochs run.

The records and their steps are those `LogCallback` writes to TensorBoard (`reporting.scalars`), each step
a W&B step: a fit by epochs logs `<metric>/train`, `<metric>/val` and the learning rates at the epoch's
1-based number; a fit by updates (`Trainer(max_updates=N)`, `fit(val_every_n_updates=M)`) logs every
scalar at an update count (epochs at the count their end reached, validation points at theirs, the rate of
every update with a step-wise scheduler as `lr/update`). W&B keeps a run's steps in increasing order, so a
fit by epochs logs no per-update rate (they would sit on another axis). The Trainer's `hyper_params` and
deepepochs' versions go into the run's config; `log_checkpoints` stores the best checkpoint as an artifact.

What every tracker does is `TrackerCallback`'s (`callbacks.tracker`): committed records only, a bounded
queue on a thread of its own, failures said once, a bounded close, the main process only. The W&B run's id
is the running id (`reporting.wandb_run.wandb_run_id`) and it is opened with `resume='allow'`, so a
resumed, refit or requeued fit continues it.
"""

from __future__ import annotations

import importlib.util
import os

from deepepochs.callbacks.tracker import TrackerCallback
from deepepochs.errors import ConfigError
from deepepochs.reporting.scalars import step_source
from deepepochs.reporting.wandb_run import WandbRun

__all__ = ["WandbCallback"]

_MODES = ("online", "offline", "disabled", "shared")
#: `wandb.init` arguments the callback sets itself.
_OWN = {"id": "the running id names the W&B run (Trainer(running_id=...))",
        "resume": "the callback continues the run of the running id (resume='allow')",
        "project": "pass project=", "mode": "pass mode=", "dir": "pass dir=",
        "name": "the run is named by the running id (Trainer(running_id=...))",
        "reinit": "each WandbCallback holds its own run"}


def _require_wandb() -> None:
    """Fail now, naming the extra, when wandb is not installed (it is imported later, on the worker)."""
    if importlib.util.find_spec("wandb") is None:
        raise ImportError("WandbCallback needs the wandb package, which is not installed: pip install"
                          " 'wandb>=0.19' (in a clone of deepepochs: pip install -e '.[wandb]')")


class WandbCallback(TrackerCallback):
    """Log the run to Weights & Biases: metrics and learning rates at each step of the run's clock, the
    test results, `hyper_params` as config and, on request, the best checkpoint (see the module docstring).

    One deepepochs run is one W&B run, whose id is the running id: `Trainer(resume=True)` after a
    preemption, a refit after an error and a second `fit` continue it (`resume='allow'`), with each step
    logged once; records a rollback discarded are never sent. W&B's steps only increase, so records that a
    killed job (SIGKILL) committed but had not sent are not sent again by the resumed job. A W&B server that
    is slow or down never makes training wait (a background queue); `trainer.close()` waits at most
    `close_timeout` seconds.
    Only the main process talks to W&B. Needs the `wandb` extra: `pip install -e '.[wandb]'` in a clone.

    Args:
        project: the W&B project.
        mode: 'online', 'offline' (files only, `wandb sync` uploads them later), 'disabled', or None for
            W&B's default (`WANDB_MODE`, else online).
        dir: the folder W&B writes its run files under (None: W&B's default, `WANDB_DIR` or `./wandb`).
        log_checkpoints: False; True stores the file of every `CheckCallback(save_best=True)` at each fit's
            end as a version of the artifact `<run id>-checkpoints`; a monitor name ('loss', or a
            `monitor_id` such as 'val-loss.best') that callback's file only.
        queue_size: how many calls may wait for W&B.
        close_timeout: how long `trainer.close()` waits for waiting calls.
        **init_kwargs: more arguments of `wandb.init` (`entity`, `group`, `tags`, `notes`, `settings`, ...);
            not `id`, `resume`, `name` or `reinit`, which the callback sets.

    Example:
        >>> trainer = Trainer(model, F.cross_entropy, opt, epochs=5, running_id='resnet-a',
        ...                   callbacks=[WandbCallback('cifar', mode='offline', dir='./runs')])
        >>> trainer.fit(train_dl, val_dl, metrics=[accuracy])
        >>> trainer.close()   # flushes the queue and finishes the W&B run
    """

    thread_name = "deepepochs-wandb"

    def __init__(self, project: str = "deepepochs", mode: str | None = None, dir=None,
                 log_checkpoints: bool | str = False, queue_size: int = 1000, close_timeout: float = 30.0,
                 **init_kwargs):
        if not isinstance(project, str) or not project.strip():
            raise ConfigError(f"WandbCallback project must be a non-empty project name string (got {project!r})")
        if mode is not None and mode not in _MODES:
            raise ConfigError(f"WandbCallback mode must be None (W&B's default, WANDB_MODE) or one of"
                              f" {', '.join(map(repr, _MODES))} (got {mode!r})")
        if dir is not None and not isinstance(dir, (str, os.PathLike)):
            raise ConfigError(f"WandbCallback dir must be None or a folder path (got {type(dir).__name__})")
        for name in init_kwargs.keys() & _OWN.keys():
            raise ConfigError(f"WandbCallback does not take wandb.init's {name}=: {_OWN[name]}")
        super().__init__(log_checkpoints, queue_size, close_timeout)
        _require_wandb()
        self.project, self.mode, self.dir = project, mode, dir
        self.init_kwargs = init_kwargs

    def __repr__(self) -> str:
        # init_kwargs are named, not shown: `settings` may hold an API key
        more = "".join(f", {name}=..." for name in self.init_kwargs)
        return (f"WandbCallback(project={self.project!r}, mode={self.mode!r}, dir={self.dir!r},"
                f" log_checkpoints={self.log_checkpoints!r}{more})")

    def make_run(self) -> WandbRun:
        """The W&B side: starts or continues the run, logs, stores artifacts (`reporting.wandb_run`)."""
        return WandbRun(self.project, self.mode, self.dir, self.init_kwargs)

    def where(self) -> str:
        return f"WandbCallback (project {self.project!r})"

    def _watch_rates(self, trainer) -> None:
        """Per-update rates only under the update clock: under the epoch clock they would sit on a second
        axis, which W&B's increasing steps cannot hold."""
        if step_source(trainer).by_updates:
            super()._watch_rates(trainer)
        else:
            self._unwatch_rates()
