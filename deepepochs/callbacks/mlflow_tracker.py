"""`MLflowCallback`: a run's records in an MLflow tracking server, one tracker run per deepepochs run.

What is logged, and at which step, is what `LogCallback` writes to TensorBoard (`reporting.scalars`):
`<metric>/train`, `<metric>/val` and the learning rates (`lr`, or `lr/lr_<opt>_<group>`) at the epoch's
1-based number; with `fit(val_every_n_updates=M)`, `<metric>/val` at each validation point's update count
instead; with a step-wise scheduler, `lr/update` (or `lr/lr_<opt>_<group>_update`) at each update's count;
`<metric>/test` at the number of completed epochs. Besides: the Trainer's `hyper_params`
as parameters, tags (`deepepochs.running_id`, `deepepochs.version`, `deepepochs.torch_version`,
`deepepochs.world_size`), the loop's state graph (`deepepochs/state-graph.mmd`) and, with
`log_checkpoints`, the best checkpoint under `checkpoints/` at the end of each fit.

Only committed work reaches the tracker: an epoch's records wait until its end committed, a validation
point's until its row joined the run's records, an update's learning rate until the update committed (they
are sent from the next hook that follows a commit: the next epoch's or validation point's start, the fit's
end, or the rollback's `on_interrupted`, which drops what it undid; during a long stretch of updates, every
few hundred updates too). The tracker run is found by the running id
(`reporting.mlflow_run`), so a resumed, refit or requeued fit continues it, and a (tag, step) is logged
once. Everything the tracker is told goes through a bounded queue on a thread of its own
(`reporting.background`): a slow or unreachable server never makes training wait; failures are reported
once, as a `DeepEpochsWarning` with the reason, at the next hook; `trainer.close()` waits at most
`close_timeout` seconds. Only the main process talks to the tracker.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import os
import sys
import time
import urllib.parse
import warnings
from collections.abc import Callable

import torch

from deepepochs import checkpoint
from deepepochs.callbacks.base import Callback
from deepepochs.callbacks.check import CheckCallback
from deepepochs.errors import ConfigError, DeepEpochsWarning, Preempted
from deepepochs.fsm.render import render
from deepepochs.reporting.background import BackgroundCalls
from deepepochs.reporting.mlflow_run import MlflowRun
from deepepochs.reporting.scalars import epoch_scalars, stage_scalars, step_source, test_scalars, watch_update_rates

__all__ = ["MLflowCallback", "check_tracking_uri"]

#: URI schemes MLflow's client takes for a tracking store (a database URI may name its driver: `mysql+pymysql`).
_SERVER_SCHEMES = ("http", "https")
_DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
_OTHER_SCHEMES = ("file", "databricks", "databricks-uc", "uc")
#: Staged records that make the training thread hand them to the worker (during a long stretch of updates
#: with a step-wise scheduler, whose every update stages its learning rates).
_SEND_EVERY = 256
_ACCEPTED = ("None (MLflow's default: MLFLOW_TRACKING_URI, else its local store), 'http(s)://host[:port]',"
             " a database URI such as 'sqlite:///mlflow.db', 'file:///folder', 'databricks' or a local folder")


def _require_mlflow() -> None:
    """Fail now, naming the extra, when mlflow is not installed (it is imported later, on the worker)."""
    if importlib.util.find_spec("mlflow") is None:
        raise ImportError("MLflowCallback needs the mlflow package, which is not installed: pip install"
                          " 'mlflow>=3,<3.18' (in a clone of deepepochs: pip install -e '.[mlflow]')")


def check_tracking_uri(uri):
    """`uri` as MLflow's client takes it, or a `ConfigError` naming `tracking_uri`, what it accepts and
    what came."""
    if uri is None:
        return None
    if isinstance(uri, os.PathLike):
        return os.fspath(uri)
    if not isinstance(uri, str) or not uri.strip() or uri != uri.strip():
        raise ConfigError(f"MLflowCallback tracking_uri must be {_ACCEPTED} (got {uri!r})")
    parts = urllib.parse.urlsplit(uri)
    scheme = parts.scheme.split("+")[0]
    if not parts.scheme or (len(parts.scheme) == 1 and os.name == "nt"):  # a path (C:\... on Windows)
        return uri
    problem = None
    if scheme in _SERVER_SCHEMES:
        try:
            _ = parts.port  # urllib checks the port when it is read
        except ValueError:
            problem = "its port is not a number from 0 to 65535"
        if not parts.hostname:
            problem = "it names no host"
    elif scheme in _DATABASE_SCHEMES:
        if "://" not in uri:
            problem = f"a database URI reads '{parts.scheme}://...'"
    elif scheme not in _OTHER_SCHEMES:
        problem = f"{parts.scheme!r} is not a scheme MLflow tracks to"
        if parts.path.isdigit():
            problem += f"; a server is 'http://{uri}'"
    if problem:
        raise ConfigError(f"MLflowCallback tracking_uri must be {_ACCEPTED} (got {uri!r}: {problem})")
    return uri


def _check_seconds(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"MLflowCallback {name} must be a number of seconds >= 0 (got {value!r})")


class MLflowCallback(Callback):
    """Log the run to MLflow: metrics per epoch, learning rates, hyper-parameters, test results, tags, the
    state graph and, on request, the best checkpoint (see the module docstring for names and steps).

    One deepepochs run is one tracker run, found by the tag `deepepochs.running_id`: `Trainer(resume=True)`
    after a preemption, a refit after an error and a second `fit` continue it, with each step logged
    once; epochs that a rollback discarded are never sent. Writes run on a background thread through a
    queue of `queue_size` records: a tracker that is down or slow never stops training (records that do
    not fit in the queue are dropped, and said so); `trainer.close()` flushes, waiting at most
    `close_timeout` seconds. How long one request to a server that does not answer may take is MLflow's
    `MLFLOW_HTTP_REQUEST_TIMEOUT` and `MLFLOW_HTTP_REQUEST_MAX_RETRIES` (environment variables).

    Needs the `mlflow` extra: `pip install -e '.[mlflow]'` in a clone of this version.

    Args:
        tracking_uri: the tracking server or store: 'http://host:port', a database URI
            ('sqlite:///mlflow.db'), a local folder, or None for MLflow's default (`MLFLOW_TRACKING_URI`).
        experiment: the experiment's name (created when missing).
        log_checkpoints: False; True uploads the file of every `CheckCallback(save_best=True)` at each
            fit's end; a monitor name ('loss', or a `CheckCallback`'s `monitor_id` such as
            'val-loss.best') uploads that callback's file only.
        queue_size: how many records may wait for the tracker.
        close_timeout: how long `trainer.close()` (and the interpreter's exit) waits for waiting records.

    Example:
        >>> trainer = Trainer(model, F.cross_entropy, opt, epochs=5, running_id='resnet-a',
        ...                   callbacks=[MLflowCallback('http://127.0.0.1:5000', experiment='cifar')],
        ...                   hyper_params={'lr': 1e-3})
        >>> trainer.fit(train_dl, val_dl, metrics=[accuracy])
        >>> trainer.test(test_dl)
        >>> trainer.close()   # flushes the queue
    """

    def __init__(self, tracking_uri=None, experiment: str = "deepepochs", log_checkpoints: bool | str = False,
                 queue_size: int = 1000, close_timeout: float = 30.0):
        self.tracking_uri = check_tracking_uri(tracking_uri)
        if not isinstance(experiment, str) or not experiment.strip():
            raise ConfigError(f"MLflowCallback experiment must be a non-empty experiment name string (got"
                              f" {experiment!r})")
        if not isinstance(log_checkpoints, (bool, str)) or log_checkpoints == "":
            raise ConfigError(f"MLflowCallback log_checkpoints must be True, False or the monitor name of a"
                              f" CheckCallback such as 'loss' or 'val-loss.best' (got {log_checkpoints!r})")
        if isinstance(queue_size, bool) or not isinstance(queue_size, int) or queue_size < 1:
            raise ConfigError(f"MLflowCallback queue_size must be an int >= 1 (got {queue_size!r})")
        _check_seconds("close_timeout", close_timeout)
        _require_mlflow()
        self.experiment = experiment
        self.log_checkpoints = log_checkpoints
        self.queue_size = queue_size
        self.close_timeout = float(close_timeout)
        self._calls: BackgroundCalls | None = None
        self._rate_hooks: list = []
        self._reset()

    def __repr__(self) -> str:
        return (f"MLflowCallback(tracking_uri={self.tracking_uri!r}, experiment={self.experiment!r},"
                f" log_checkpoints={self.log_checkpoints!r})")

    def _reset(self) -> None:
        if self._calls is not None:  # attached to another trainer: what the last one queued goes first
            self._calls.close(self.close_timeout)
        self._unwatch_rates()
        self._calls = None
        self._tracker: MlflowRun | None = None
        self._running_id: str | None = None
        # (is it committed? (trainer, step) -> bool, step, scalars, time in ms), not sent yet
        self._staged: list[tuple[Callable, int, dict, int]] = []
        self._status = "FINISHED"

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
        """A validation point of the update clock: keep its records until its row commits."""
        clock = step_source(trainer)
        step = clock.val_point_step(trainer)
        if trainer.is_main_process and step is not None:
            self._stage(clock.val_point_committed, step, stage_scalars("val", metrics))

    def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx) -> None:
        """Keep the epoch's records until its end commits (a rollback may still undo it)."""
        if trainer.is_main_process:
            clock = step_source(trainer)
            self._stage(clock.committed, clock.epoch_step(trainer, epoch_idx),
                        epoch_scalars(train_metrics, val_metrics, trainer.opt.lrs()))

    def on_after_fit(self, trainer) -> None:
        """Send the last epoch's records and, with `log_checkpoints`, the best checkpoint files."""
        self._unwatch_rates()
        self._send_committed(trainer)
        if trainer.is_main_process and self._tracker is not None:
            for monitor in self._checkpoints(trainer):
                path = monitor.path(trainer)
                if checkpoint.exists(path):
                    self._put(self._tracker.log_artifact, path, "checkpoints")
        self._report()

    def on_before_test_epochs(self, trainer, tasks) -> None:
        """A test without a fit before it opens the tracker run too."""
        self._status = "FINISHED"
        self._begin(trainer)

    def on_after_test_epochs(self, trainer, tasks, metrics) -> None:
        """The test's metrics, at the count of completed epochs."""
        if trainer.is_main_process and self._tracker is not None:
            self._put(self._tracker.log, step_source(trainer).test_step(trainer), test_scalars(metrics),
                      int(time.time() * 1000))
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
        self._put(self._tracker.finish, self._status)
        calls, self._calls = self._calls, None
        left = calls.pending()
        done = calls.close(self.close_timeout)
        self._report(calls)
        if not done:
            warnings.warn(f"MLflowCallback: the tracker did not take the last {left} record(s) within"
                          f" close_timeout={self.close_timeout:g}s; they are not sent", DeepEpochsWarning,
                          stacklevel=2)

    # ---- helpers ----
    def _begin(self, trainer) -> None:
        """Open the tracker run of `trainer.running_id` (once per name; a resume may rename the run)."""
        if not trainer.is_main_process:
            return
        self._send_committed(trainer)
        if self._running_id == trainer.running_id:
            return
        if self._calls is None:
            self._calls = BackgroundCalls("deepepochs-mlflow", self.queue_size, exit_timeout=self.close_timeout)
            self._tracker = MlflowRun(self.tracking_uri, self.experiment)
        self._running_id = trainer.running_id
        loop = trainer.loop
        fresh = loop.completed_epochs == 0 and loop.resume is None  # nothing committed: a new run of this name
        # The package root is loaded before any of its modules, so its version is there (importing the root
        # from here would import upwards through the layers).
        version = getattr(sys.modules.get("deepepochs"), "__version__", "unknown")
        tags = {"deepepochs.version": version, "deepepochs.torch_version": torch.__version__,
                "deepepochs.world_size": trainer.world_size}
        self._put(self._tracker.open, self._running_id, fresh, tags, dict(trainer.hyper_params),
                  lambda: render("mermaid"))

    def _stage(self, committed, step: int, scalars: dict) -> None:
        """Keep records at `step` until `committed(trainer, step)` says a rollback can no longer undo them."""
        self._staged.append((committed, step, scalars, int(time.time() * 1000)))

    def _send_committed(self, trainer, drop: bool = False) -> None:
        """Queue the staged records that committed, in one call; keep the others for a later commit, or
        with `drop` (after a rollback: what it undid never commits) forget them."""
        if self._tracker is None:
            self._staged = []
            return
        ready, waiting = [], []
        for entry in self._staged:
            (ready if entry[0](trainer, entry[1]) else waiting).append(entry)
        self._staged = [] if drop else waiting
        if ready:
            self._put(self._tracker.log_records, [(step, scalars, stamp) for _, step, scalars, stamp in ready])

    def _watch_rates(self, trainer) -> None:
        """Stage the learning rates of each update of an optimizer with a step-wise scheduler
        (`reporting.scalars.watch_update_rates`), committed once the scheduler's count reaches the update."""
        self._unwatch_rates()
        if self._tracker is None:
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
            warnings.warn(f"MLflowCallback ({self.tracking_uri or 'default tracking URI'}): {text}; training goes"
                          " on, the tracker misses those records", DeepEpochsWarning, stacklevel=3)

    def _checkpoints(self, trainer) -> list[CheckCallback]:
        """The CheckCallbacks whose files `log_checkpoints` uploads; a name that matches none is an error."""
        if self.log_checkpoints is False:
            return []
        checks = [cb for cb in trainer.callbacks if isinstance(cb, CheckCallback)]
        if self.log_checkpoints is True:
            chosen = [cb for cb in checks if cb.save_best]
        else:
            chosen = [cb for cb in checks if self.log_checkpoints in (cb.monitor, cb.monitor_id)]
        if not chosen:
            have = [cb.monitor_id for cb in checks] or "no CheckCallback"
            raise ConfigError(f"MLflowCallback log_checkpoints={self.log_checkpoints!r} names no checkpoint of"
                              f" this trainer: it takes True (every CheckCallback(save_best=True)) or the monitor"
                              f" of one of its CheckCallbacks (the trainer has {have})")
        return chosen
