"""`TrackerCallback`: what every experiment tracker callback does (`MLflowCallback`, `WandbCallback`, or one
of your own), so that each only says how to talk to its tracker.

A tracker callback hands a *run object* (made by its `make_run()`) the run's records; every call on that
object runs on a thread of its own, through a bounded queue (`reporting.background.BackgroundCalls`), so a
slow or unreachable tracker never makes training wait. The run object has four methods:

- `open(running_id, fresh, tags, params)`: find or start the tracker's run of the deepepochs run
  `running_id` (`fresh`: nothing was committed under that name yet, so it is a new run even when an older
  one has the name); `tags` are `deepepochs.version`, `deepepochs.torch_version` and
  `deepepochs.world_size`; `params` the Trainer's `hyper_params`.
- `log(records)`: each `(step, {tag: value}, time in ms)` of `records`, in step order.
- `finish(status)`: the run ended, `'FINISHED'`, `'FAILED'` or `'KILLED'` (preempted).
- `log_file(path, folder)` (only with `log_checkpoints`): store a checkpoint file (or folder).

What the base does, for every tracker:

- Only committed records are handed on: an epoch's records once its end committed, a validation point's
  once its row joined the run's records, an update's learning rate once the update committed (from the
  next hook after the commit, or every few hundred updates in a long epoch); a rollback drops what it
  undid. Tags and steps are `reporting.scalars`' (those `LogCallback` writes to TensorBoard).
- One tracker run per running id: `open` is called once per running id, with `fresh=False` for a resumed,
  refit or requeued run, which the tracker continues. With `resend_history` (a tracker that keeps each
  (tag, step) once), a resumed job hands the run's history again, so a record the job before it committed
  but never sent (a SIGKILL) arrives.
- Failures are said once, as a `DeepEpochsWarning` with the reason (credentials in it written `***@`);
  `trainer.close()` waits at most `close_timeout` seconds for the queue; only the main process (rank 0
  under DDP) makes a run object at all.
"""

from __future__ import annotations

import math
import numbers
import sys
import time
import warnings
from collections.abc import Callable

import torch

from deepepochs import checkpoint
from deepepochs.callbacks.base import Callback
from deepepochs.callbacks.check import CheckCallback
from deepepochs.errors import ConfigError, DeepEpochsWarning, Preempted
from deepepochs.reporting.background import BackgroundCalls
from deepepochs.reporting.redact import redact
from deepepochs.reporting.scalars import (
    epoch_scalars,
    history_scalars,
    profile_scalars,
    stage_scalars,
    step_source,
    test_scalars,
    watch_update_rates,
)

__all__ = ["TrackerCallback"]

#: Staged records that make the training thread hand them to the worker (during a long stretch of updates
#: with a step-wise scheduler, whose every update stages its learning rates).
_SEND_EVERY = 256


class TrackerCallback(Callback):
    """Base of the experiment tracker callbacks: override `make_run()` (and `where()` for messages); see the
    module docstring for the run object it returns and what the base does.

    Args:
        log_checkpoints: False; True hands the run object the file of every `CheckCallback(save_best=True)`
            at each fit's end (`log_file`); a monitor name ('loss', or a `CheckCallback`'s `monitor_id` such
            as 'val-loss.best') that callback's file only.
        queue_size: how many calls may wait for the tracker (more are dropped, and said so).
        close_timeout: how long `trainer.close()` (and the interpreter's exit) waits for waiting calls.

    Example (a tracker writing lines to a file):
        >>> class FileRun:
        ...     def __init__(self, path):
        ...         self.path = path
        ...     def open(self, running_id, fresh, tags, params):
        ...         self.file = open(self.path, "w" if fresh else "a")
        ...     def log(self, records):
        ...         for step, scalars, _ in records:
        ...             self.file.writelines(f"{step} {k} {v}\\n" for k, v in scalars.items())
        ...     def finish(self, status):
        ...         self.file.close()
        >>> class FileTracker(TrackerCallback):
        ...     def make_run(self):
        ...         return FileRun("metrics.txt")
    """

    #: The worker thread's name.
    thread_name = "deepepochs-tracker"
    profile_cost = "logging"  # what a profile counts its hooks as (`ProfileCallback`)
    #: Whether a resumed job hands the tracker the run's history again (the tracker must keep one value per
    #: (tag, step): MLflow's run object skips what the run holds).
    resend_history = False

    def __init__(self, log_checkpoints: bool | str = False, queue_size: int = 1000, close_timeout: float = 30.0):
        name = type(self).__name__
        if not isinstance(log_checkpoints, (bool, str)) or log_checkpoints == "":
            raise ConfigError(f"{name} log_checkpoints must be True, False or the monitor name of a"
                              f" CheckCallback such as 'loss' or 'val-loss.best' (got {log_checkpoints!r})")
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1:
            raise ConfigError(f"{name} queue_size must be an int >= 1 (got {queue_size!r})")
        if (isinstance(close_timeout, bool) or not isinstance(close_timeout, numbers.Real)
                or not math.isfinite(close_timeout) or close_timeout < 0):
            raise ConfigError(f"{name} close_timeout must be a number of seconds >= 0 (got {close_timeout!r})")
        self.log_checkpoints = log_checkpoints
        self.queue_size = queue_size
        self.close_timeout = float(close_timeout)
        self._calls: BackgroundCalls | None = None
        self._rate_hooks: list = []
        self._reset()

    # ---- what a tracker provides ----
    def make_run(self):
        """The run object whose methods talk to the tracker (called on the main process only, once per
        trainer; its methods run on the worker thread)."""
        raise NotImplementedError(f"{type(self).__name__} must define make_run()")

    def where(self) -> str:
        """The tracker as messages name it (no credentials)."""
        return type(self).__name__

    def secret(self):
        """A string whose credentials messages must not show (a tracking URI), or None."""
        return None

    # ---- hooks ----
    def on_attach(self, trainer) -> None:
        """A callback instance starts afresh with each trainer it is attached to."""
        self._reset()

    def on_before_fit(self, trainer, epochs) -> None:
        """Check `log_checkpoints` against the trainer's monitors; open (or continue) the tracker run."""
        self._checkpoints(trainer)
        self._status = "FINISHED"
        self._begin(trainer)
        self._watch_rates(trainer)

    def on_before_epoch(self, trainer, train_tasks, val_tasks, epoch_idx) -> None:
        """The previous epoch's end committed: send its records."""
        self._send_committed(trainer)

    def on_before_val_epochs(self, trainer, tasks, epoch_idx) -> None:
        """The previous validation point committed (or a rollback came first): send its records."""
        self._send_committed(trainer)

    def on_after_val_epochs(self, trainer, tasks, metrics, epoch_idx) -> None:
        """A validation point of the update clock: keep its records (with a `ProfileCallback`, where the time
        since the previous point went, `profile/<category>`) until its row commits."""
        clock = step_source(trainer)
        step = clock.val_point_step(trainer)
        if trainer.is_main_process and step is not None:
            self._stage(clock.val_point_committed, step, {**stage_scalars("val", metrics),
                                                          **profile_scalars(trainer, step)})

    def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx) -> None:
        """Keep the epoch's records until its end commits (a rollback may still undo it)."""
        if trainer.is_main_process:
            clock = step_source(trainer)
            self._stage(clock.epoch_committed(epoch_idx), clock.epoch_step(trainer, epoch_idx),
                        epoch_scalars(train_metrics, val_metrics, trainer.opt.lrs()))

    def on_after_fit(self, trainer) -> None:
        """Send the last epoch's records and, with `log_checkpoints`, the best checkpoint files."""
        self._unwatch_rates()
        self._send_committed(trainer)
        if trainer.is_main_process and self._run is not None:
            for monitor in self._checkpoints(trainer):
                path = monitor.path(trainer)
                if checkpoint.exists(path):
                    self._put(self._run.log_file, path, "checkpoints")
        self._report()

    def on_before_test_epochs(self, trainer, tasks) -> None:
        """A test without a fit before it opens the tracker run too."""
        self._status = "FINISHED"
        self._begin(trainer)

    def on_after_test_epochs(self, trainer, tasks, metrics) -> None:
        """The test's metrics, at the test's step."""
        if trainer.is_main_process and self._run is not None:
            step = step_source(trainer).test_step(trainer)
            self._put(self._run.log, [(step, test_scalars(metrics), int(time.time() * 1000))])
        self._report()

    def on_interrupted(self, trainer, exception) -> None:
        """After a rollback: send what committed before it, drop what it undid."""
        self._status = "KILLED" if isinstance(exception, Preempted) else "FAILED"
        self._unwatch_rates()
        self._send_committed(trainer, drop=True)
        self._report()

    def on_close(self, trainer) -> None:
        """Send what is left, mark the tracker run ended, and wait at most `close_timeout` for the queue."""
        self._unwatch_rates()
        self._send_committed(trainer)
        if self._calls is None:
            return
        self._put(self._run.finish, self._status)
        calls, self._calls = self._calls, None
        left = calls.pending()
        done = calls.close(self.close_timeout)
        self._report(calls)
        if not done:
            warnings.warn(f"{type(self).__name__}: the tracker did not take the last {left} record(s) within"
                          f" close_timeout={self.close_timeout:g}s; they are not sent", DeepEpochsWarning,
                          stacklevel=2)

    # ---- helpers ----
    def _reset(self) -> None:
        if self._calls is not None:  # attached to another trainer: what the last one queued goes first
            self._calls.close(self.close_timeout)
        self._unwatch_rates()
        self._calls = None
        self._run = None
        self._running_id: str | None = None
        # (is it committed? (trainer, step) -> bool, step, scalars, time in ms), not sent yet
        self._staged: list[tuple[Callable, int, dict, int]] = []
        self._status = "FINISHED"

    def _begin(self, trainer) -> None:
        """Open the tracker run of `trainer.running_id` (once per name; a resume may rename the run)."""
        if not trainer.is_main_process:
            return
        self._send_committed(trainer)
        if self._running_id == trainer.running_id:
            return
        if self._calls is None:
            self._calls = BackgroundCalls(self.thread_name, self.queue_size, exit_timeout=self.close_timeout)
            self._run = self.make_run()
        self._running_id = trainer.running_id
        loop = trainer.loop
        fresh = loop.completed_epochs == 0 and loop.resume is None  # nothing committed: a new run of this name
        # The package root is loaded before any of its modules, so its version is there (importing the root
        # from here would import upwards through the layers).
        version = getattr(sys.modules.get("deepepochs"), "__version__", "unknown")
        tags = {"deepepochs.version": version, "deepepochs.torch_version": torch.__version__,
                "deepepochs.world_size": trainer.world_size}
        self._put(self._run.open, self._running_id, fresh, tags, dict(trainer.hyper_params))
        if not fresh and self.resend_history:  # the job before may have ended (SIGKILL) before sending it all
            stamp = int(time.time() * 1000)
            self._put(self._run.log, [(step, scalars, stamp) for step, scalars in history_scalars(trainer)])

    def _stage(self, committed, step: int, scalars: dict) -> None:
        """Keep records at `step` until `committed(trainer, step)` says a rollback can no longer undo them."""
        self._staged.append((committed, step, scalars, int(time.time() * 1000)))

    def _send_committed(self, trainer, drop: bool = False) -> None:
        """Queue the staged records that committed, in one call, in step order; keep the others for a later
        commit, or with `drop` (after a rollback: what it undid never commits) forget them."""
        if self._run is None:
            self._staged = []
            return
        ready, waiting = [], []
        for entry in self._staged:
            (ready if entry[0](trainer, entry[1]) else waiting).append(entry)
        self._staged = [] if drop else waiting
        if ready:
            ready.sort(key=lambda entry: entry[1])  # stable: records of one step keep their order
            self._put(self._run.log, [(step, scalars, stamp) for _, step, scalars, stamp in ready])

    def _watch_rates(self, trainer) -> None:
        """Stage the learning rates of each update of an optimizer with a step-wise scheduler
        (`reporting.scalars.watch_update_rates`), committed once the scheduler's count reaches the update."""
        self._unwatch_rates()
        if self._run is None:
            return

        def stage(step, rates, scheduler):
            self._stage(lambda _trainer, at: at <= scheduler.last_epoch, step, rates)
            if len(self._staged) >= _SEND_EVERY:  # the earlier updates committed: a long epoch keeps no backlog
                self._send_committed(trainer)

        self._rate_hooks = watch_update_rates(trainer, stage)

    def _unwatch_rates(self) -> None:
        for handle in self._rate_hooks:
            handle.remove()
        self._rate_hooks = []

    def _put(self, method, *args) -> None:
        self._calls.put(lambda: method(*args))

    def _report(self, calls=None) -> None:
        """Say, once each, what went wrong on the worker since the last report."""
        calls = calls or self._calls
        if calls is None:
            return
        for text in calls.report():
            warnings.warn(f"{self.where()}: {redact(text, self.secret())}; training goes on, the tracker misses"
                          " those records", DeepEpochsWarning, stacklevel=3)

    def _checkpoints(self, trainer) -> list[CheckCallback]:
        """The CheckCallbacks whose files `log_checkpoints` stores; a name that matches none is an error."""
        if self.log_checkpoints is False:
            return []
        checks = [cb for cb in trainer.callbacks if isinstance(cb, CheckCallback)]
        if self.log_checkpoints is True:
            chosen = [cb for cb in checks if cb.save_best]
        else:
            chosen = [cb for cb in checks if self.log_checkpoints in (cb.monitor, cb.monitor_id)]
        if not chosen:
            have = [cb.monitor_id for cb in checks] or "no CheckCallback"
            raise ConfigError(f"{type(self).__name__} log_checkpoints={self.log_checkpoints!r} names no checkpoint"
                              f" of this trainer: it takes True (every CheckCallback(save_best=True)) or the"
                              f" monitor of one of its CheckCallbacks (the trainer has {have})")
        return chosen
