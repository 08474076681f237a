"""`MLflowCallback`: a run's records in an MLflow tracking server, one tracker run per deepepochs run.

What is logged, and at which step, is what `LogCallback` writes to TensorBoard (`reporting.scalars`):
`<metric>/train`, `<metric>/val` and the learning rates (`lr`, or `lr/lr_<opt>_<group>`) at the epoch's
1-based number; with `fit(val_every_n_updates=M)`, `<metric>/val` at each validation point's update count
instead; with a step-wise scheduler, `lr/update` (or `lr/lr_<opt>_<group>_update`) at each update's count;
`<metric>/test` at the number of completed epochs. Besides: the Trainer's `hyper_params`
as parameters, tags (`deepepochs.running_id`, `deepepochs.version`, `deepepochs.torch_version`,
`deepepochs.world_size`), the loop's state graph (`deepepochs/state-graph.mmd`) and, with
`log_checkpoints`, the best checkpoint under `checkpoints/` at the end of each fit.

What every tracker callback does is `TrackerCallback`'s (`callbacks.tracker`): only committed work reaches
the tracker, through a bounded queue on a thread of its own, failures said once, a bounded close, the main
process only. The tracker run is found by the running id (`reporting.mlflow_run`), so a resumed, refit or
requeued fit continues it, and a (tag, step) is logged once; a resumed job sends again the metrics its
history holds, of which the tracker run keeps those it lacks, so a record the job before committed but
never sent (killed with SIGKILL) arrives once. Credentials in the tracking URI are written `***@` in
everything printed (`reporting.redact`), MLflow's own run link included.
"""

from __future__ import annotations

import importlib.util
import os
import urllib.parse

from deepepochs.callbacks.tracker import TrackerCallback
from deepepochs.errors import ConfigError
from deepepochs.fsm.render import render
from deepepochs.reporting.mlflow_run import MlflowRun
from deepepochs.reporting.redact import redact, redacted_uri

__all__ = ["MLflowCallback", "check_tracking_uri"]

#: URI schemes MLflow's client takes for a tracking store (a database URI may name its driver: `mysql+pymysql`).
_SERVER_SCHEMES = ("http", "https")
_DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")
_OTHER_SCHEMES = ("databricks", "databricks-uc", "uc")
_ACCEPTED = ("None (MLflow's default: MLFLOW_TRACKING_URI, else its local store), 'http(s)://host[:port]',"
             " a database URI such as 'sqlite:///mlflow.db' or 'databricks' ('file:///folder' or a folder with"
             " MLFLOW_ALLOW_FILE_STORE=true)")


def _require_mlflow() -> None:
    """Fail now, naming the extra, when mlflow is not installed (it is imported later, on the worker)."""
    if importlib.util.find_spec("mlflow") is None:
        raise ImportError("MLflowCallback needs the mlflow package, which is not installed: pip install"
                          " 'mlflow>=3,<3.18' (in a clone of deepepochs: pip install -e '.[mlflow]')")


def _file_store_allowed() -> bool:
    """Whether the user opted into MLflow's file store (`MLFLOW_ALLOW_FILE_STORE=true`, MLflow's own switch)."""
    return os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").strip().lower() in ("true", "1")


def _file_store_problem(uri: str) -> str | None:
    """Why a file store (`file:///folder` or a folder) records nothing with the pinned MLflow, or None when
    the user opted into it."""
    if _file_store_allowed():
        return None
    return ("MLflow's file store is in maintenance mode and refuses to record (MLflow 3 raises on it);"
            f" use a database in that folder, 'sqlite:///{_folder(uri)}/mlflow.db', or set"
            " MLFLOW_ALLOW_FILE_STORE=true, MLflow's switch that keeps the file store")


def _folder(uri: str) -> str:
    """The folder a file store URI or path names, for the message that proposes a database there."""
    if uri.startswith("file:"):
        path = urllib.parse.urlsplit(uri).path
        return path.rstrip("/") or "."
    return uri.rstrip("/\\") or "."


def check_tracking_uri(uri):
    """`uri` as MLflow's client takes it, or a `ConfigError` naming `tracking_uri`, what it accepts and
    what came (its credentials, `user:password@`, written `***@`)."""
    if uri is None:
        return None
    if isinstance(uri, os.PathLike):
        uri = os.fspath(uri)
    if not isinstance(uri, str) or not uri.strip() or uri != uri.strip():
        raise ConfigError(f"MLflowCallback tracking_uri must be {_ACCEPTED} (got {redacted_uri(uri)!r})")
    shown = redacted_uri(uri)
    try:
        parts = urllib.parse.urlsplit(uri)
    except ValueError as e:  # an unclosed IPv6 bracket, ...
        raise ConfigError(f"MLflowCallback tracking_uri must be {_ACCEPTED} (got {shown!r}: it is not a URI:"
                          f" {redact(str(e), uri)})") from None
    scheme = parts.scheme.split("+")[0]
    problem = None
    if uri in _OTHER_SCHEMES:  # 'databricks' alone: the workspace of the default profile
        return uri
    if not parts.scheme or (len(parts.scheme) == 1 and os.name == "nt"):  # a path (C:\... on Windows)
        problem = _file_store_problem(uri)
    elif scheme in _SERVER_SCHEMES:
        try:
            _ = parts.port  # urllib checks the port when it is read
        except ValueError:
            problem = "its port is not a number from 0 to 65535"
        if not parts.hostname:
            problem = "it names no host"
    elif scheme in _DATABASE_SCHEMES:
        if "://" not in uri:
            problem = f"a database URI reads '{parts.scheme}://...'"
    elif scheme == "file":
        problem = _file_store_problem(uri)
    elif scheme not in _OTHER_SCHEMES:
        problem = f"{parts.scheme!r} is not a scheme MLflow tracks to"
        if parts.path.isdigit():
            problem += f"; a server is 'http://{shown}'"
    if problem:
        raise ConfigError(f"MLflowCallback tracking_uri must be {_ACCEPTED} (got {shown!r}: {problem})")
    return uri


class MLflowCallback(TrackerCallback):
    """Log the run to MLflow: metrics per epoch, learning rates, hyper-parameters, test results, tags, the
    state graph and, on request, the best checkpoint (see the module docstring for names and steps).

    One deepepochs run is one tracker run, found by the tag `deepepochs.running_id`: `Trainer(resume=True)`
    after a preemption, a refit after an error and a second `fit` continue it, with each step logged
    once; epochs that a rollback discarded are never sent. A resumed job hands the tracker its history's
    metrics again (each (tag, step) the tracker run lacks is sent, the others skipped), so a record the job
    before it committed but never sent (a SIGKILL) arrives once. Writes run on a background thread through a
    queue of `queue_size` records: a tracker that is down or slow never stops training (records that do
    not fit in the queue are dropped, and said so); `trainer.close()` flushes, waiting at most
    `close_timeout` seconds. How long one request to a server that does not answer may take is MLflow's
    `MLFLOW_HTTP_REQUEST_TIMEOUT` and `MLFLOW_HTTP_REQUEST_MAX_RETRIES` (environment variables).

    Needs the `mlflow` extra: `pip install -e '.[mlflow]'` in a clone of this version.

    Args:
        tracking_uri: the tracking server or store: 'http://host:port' (credentials in it,
            'http://user:password@host', are written `***@` wherever deepepochs or MLflow's run link prints
            it), a database URI ('sqlite:///mlflow.db'), or None for MLflow's default
            (`MLFLOW_TRACKING_URI`). A file store ('file:///folder' or a folder) is refused, since MLflow 3's
            is in maintenance mode and records nothing, unless MLflow's switch `MLFLOW_ALLOW_FILE_STORE=true`
            is set.
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

    thread_name = "deepepochs-mlflow"
    resend_history = True  # the run object skips each (tag, step) the tracker run holds

    def __init__(self, tracking_uri=None, experiment: str = "deepepochs", log_checkpoints: bool | str = False,
                 queue_size: int = 1000, close_timeout: float = 30.0):
        self.tracking_uri = check_tracking_uri(tracking_uri)
        if not isinstance(experiment, str) or not experiment.strip():
            raise ConfigError(f"MLflowCallback experiment must be a non-empty experiment name string (got"
                              f" {experiment!r})")
        super().__init__(log_checkpoints, queue_size, close_timeout)
        _require_mlflow()
        self.experiment = experiment

    def __repr__(self) -> str:
        return (f"MLflowCallback(tracking_uri={redacted_uri(self.tracking_uri)!r}, experiment={self.experiment!r},"
                f" log_checkpoints={self.log_checkpoints!r})")

    def make_run(self) -> MlflowRun:
        """The MLflow side: finds or creates the tracker run, logs, uploads (`reporting.mlflow_run`)."""
        return MlflowRun(self.tracking_uri, self.experiment, lambda: render("mermaid"))

    def where(self) -> str:
        return f"MLflowCallback ({redacted_uri(self.tracking_uri) or 'default tracking URI'})"

    def secret(self):
        return self.tracking_uri
