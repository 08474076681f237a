"""`MlflowRun`: the MLflow side of `MLflowCallback`, one tracker run per deepepochs run.

Every method talks to the tracking server and runs on the callback's worker thread
(`reporting.background.BackgroundCalls`), never on the training thread: `mlflow` itself is imported there
too (importing it takes seconds). The tracker run of a deepepochs run is the newest run of the experiment
tagged `deepepochs.running_id = <running id>`; a resumed, refit or requeued fit continues it. A run that
starts from nothing (no committed epoch, no snapshot position) gets a new tracker run even when an older
one has its name, since it is another run that reuses the name.

Each tag has at most one value per step in a tracker run: what the run already holds is read when it is
continued, and a record at a (tag, step) already there is not sent again (a requeued job trains again the
epochs after its last snapshot; the tracker keeps the values it got first).
"""

from __future__ import annotations

import os
import sys

from deepepochs.reporting.redact import redacted_uri

__all__ = ["RUNNING_ID_TAG", "MlflowRun"]

#: The tag naming the deepepochs run a tracker run records (searched to continue it).
RUNNING_ID_TAG = "deepepochs.running_id"
#: MLflow's limits per `log_batch` request.
_METRICS_PER_REQUEST = 1000
_PARAMS_PER_REQUEST = 100


def _quoted(value: str) -> str:
    """`value` as a string literal of MLflow's search syntax (which has no escape for the quote used)."""
    return f'"{value}"' if '"' not in value else f"'{value}'"


class MlflowRun:
    """The tracker run of one deepepochs run, held by the worker thread.

    Args:
        tracking_uri: passed to `MlflowClient` (None: MLflow's default, `MLFLOW_TRACKING_URI` or its own).
        experiment: the experiment's name; created when missing.
        state_graph: gives the loop's Mermaid text, stored as an artifact of a new run.
    """

    def __init__(self, tracking_uri, experiment: str, state_graph):
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.state_graph = state_graph
        self.client = None
        self.run_id: str | None = None
        self.running_id: str | None = None
        self._opening: tuple | None = None  # what `open` was asked, until the run is found or created
        self._logged: set[tuple[str, int]] = set()
        self._params: dict[str, str] = {}
        self._experiment: str | None = None  # the experiment's id, once known

    # ---- the run ----
    def open(self, running_id: str, fresh: bool, tags: dict, params: dict) -> None:
        """Find (or create) the tracker run of `running_id` and record its tags and parameters. When the
        server cannot be reached, the next call tries again."""
        self.run_id, self.running_id = None, running_id
        self._opening = (running_id, fresh, dict(tags), dict(params))
        self._ensure()

    def _ensure(self) -> str:
        """The run's id, finding or creating the run first if `open` could not."""
        if self.run_id is not None:
            return self.run_id
        if self._opening is None:
            raise RuntimeError("no tracker run was opened (neither fit nor test started)")
        running_id, fresh, tags, params = self._opening
        client = self._client()
        experiment_id = self._experiment = self._experiment_id(client)
        found = None if fresh else self._find(client, experiment_id, running_id)
        if found is None:
            tags = {**{k: str(v) for k, v in tags.items()}, RUNNING_ID_TAG: running_id}  # MLflow stores strings
            run = client.create_run(experiment_id, tags=tags, run_name=running_id)
            run_id, self._logged, self._params = run.info.run_id, set(), {}
            client.log_text(run_id, self.state_graph(), "deepepochs/state-graph.mmd")
        else:
            run_id = found.info.run_id
            self._logged = {(key, int(m.step)) for key in found.data.metrics
                            for m in client.get_metric_history(run_id, key)}
            self._params = dict(found.data.params)
            client.update_run(run_id, status="RUNNING")
            self._batch(client, run_id, tags=tags)  # versions and world size may differ after a resume
        self.run_id, self._opening = run_id, None
        new = {str(k): str(v) for k, v in params.items() if self._params.get(str(k)) != str(v)}
        self._batch(client, run_id, params=new)
        self._params.update(new)
        return run_id

    def _client(self):
        if self.client is None:
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(self.tracking_uri)
            if redacted_uri(self.tracking_uri) != self.tracking_uri:
                self._hide_credentials(self.client)
        return self.client

    def _hide_credentials(self, client) -> None:
        """MLflow prints a link to the run when it ends, from the tracking URI as given, password included:
        print that link with the credentials written `***@` instead (MLflow 3's client prints it from
        `_log_url`; a client without it prints no link, so nothing is replaced)."""
        tracking = getattr(client, "_tracking_client", None)
        if tracking is None or not callable(getattr(tracking, "_log_url", None)):
            return
        host = redacted_uri(self.tracking_uri).rstrip("/")

        def log_url(run_id):
            experiment_url = f"{host}/#/experiments/{self._experiment}"
            sys.stdout.write(f"\N{RUNNER} View run {self.running_id} at: {experiment_url}/runs/{run_id}\n"
                             f"\N{TEST TUBE} View experiment at: {experiment_url}\n")

        tracking._log_url = log_url

    def _experiment_id(self, client) -> str:
        experiment = client.get_experiment_by_name(self.experiment)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return client.create_experiment(self.experiment)
        except Exception:  # another process created it meanwhile
            experiment = client.get_experiment_by_name(self.experiment)
            if experiment is None:
                raise
            return experiment.experiment_id

    @staticmethod
    def _find(client, experiment_id: str, running_id: str):
        """The newest tracker run tagged with `running_id`, or None."""
        if '"' in running_id and "'" in running_id:  # no literal holds both: match loosely, then exactly
            pattern = running_id.replace('"', "%").replace("'", "%")
            query = f"tags.`{RUNNING_ID_TAG}` LIKE {_quoted(pattern)}"
        else:
            query = f"tags.`{RUNNING_ID_TAG}` = {_quoted(running_id)}"
        runs = client.search_runs([experiment_id], query, order_by=["attributes.start_time DESC"])
        return next((run for run in runs if run.data.tags.get(RUNNING_ID_TAG) == running_id), None)

    # ---- records ----
    def log(self, records) -> None:
        """Each `(step, {tag: value}, time in ms)` of `records` (in as few requests as MLflow allows), but for
        the (tag, step) the run already holds."""
        from mlflow.entities import Metric

        run_id = self._ensure()
        metrics = []
        for step, scalars, timestamp_ms in records:
            for tag, value in scalars.items():
                if (tag, int(step)) not in self._logged:
                    self._logged.add((tag, int(step)))
                    metrics.append(Metric(tag, float(value), timestamp_ms, int(step)))
        try:
            self._batch(self._client(), run_id, metrics=metrics)
        except BaseException:  # not sent: a later record at the same (tag, step) may be
            self._logged.difference_update((m.key, m.step) for m in metrics)
            raise

    def log_file(self, path, folder: str) -> None:
        """Upload a file, or a folder's files, under `folder` of the run's artifacts."""
        run_id = self._ensure()
        if os.path.isdir(path):
            self._client().log_artifacts(run_id, os.fspath(path), f"{folder}/{os.path.basename(path)}")
        else:
            self._client().log_artifact(run_id, os.fspath(path), folder)

    def finish(self, status: str) -> None:
        """Mark the run ended with `status` ('FINISHED', 'FAILED' or 'KILLED'); a continued run is marked
        running again."""
        if self._opening is None and self.run_id is None:
            return
        self._client().set_terminated(self._ensure(), status)

    def _batch(self, client, run_id: str, metrics=(), params=None, tags=None) -> None:
        """`log_batch` within MLflow's per-request limits."""
        from mlflow.entities import Param, RunTag

        params = [Param(k, v) for k, v in (params or {}).items()]
        tags = [RunTag(k, str(v)) for k, v in (tags or {}).items()]
        metrics = list(metrics)
        while metrics or params or tags:
            client.log_batch(run_id, metrics=metrics[:_METRICS_PER_REQUEST], params=params[:_PARAMS_PER_REQUEST],
                             tags=tags[:_PARAMS_PER_REQUEST])
            metrics, params = metrics[_METRICS_PER_REQUEST:], params[_PARAMS_PER_REQUEST:]
            tags = tags[_PARAMS_PER_REQUEST:]
