"""A real MLflow tracking server for the tests of `MLflowCallback` (`tracking_server`, registered for
tests/callbacks by its conftest: one server per test session), and what the tests read back through MLflow's
own client."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import torch
from processes import free_port  # tests/, on sys.path under pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_snapshots import SendAt  # tests/, on sys.path under pytest
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Preempted, SnapshotCallback

__all__ = ["assert_tensorboard_has", "client", "data", "preempted_then_resumed", "runs", "series", "the_run",
           "tracking_server", "untracked_run", "weights"]

SERVER_START_S = 300  # 60-140 s on a loaded 2-core machine


@pytest.fixture(scope="session")
def tracking_server(tmp_path_factory):
    """The URI of an `mlflow server` on a free loopback port (its own process group, ended afterwards); or of
    the server `DEEPEPOCHS_TEST_MLFLOW_URI` names, already running (to rerun these tests without its start)."""
    if importlib.util.find_spec("mlflow") is None:
        pytest.skip("mlflow is not installed: pip install -e '.[mlflow]'")
    if os.environ.get("DEEPEPOCHS_TEST_MLFLOW_URI"):
        yield os.environ["DEEPEPOCHS_TEST_MLFLOW_URI"]
        return
    folder = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    log = open(folder / "server.log", "wb")
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{folder / 'db.sqlite'}",
               "--default-artifact-root", str(folder / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
               "--workers", "1"]
    try:
        # No job runner: the server's background job workers (several processes) are unused here and busy a
        # small machine's cores.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    except OSError as e:
        pytest.skip(f"the MLflow tracking server could not start: {e}")
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START_S
    try:
        while True:
            if server.poll() is not None:
                tail = (folder / "server.log").read_text(errors="replace")[-1500:]
                pytest.skip(f"the MLflow tracking server exited with status {server.returncode}: {tail}")
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.skip(f"the MLflow tracking server did not answer on {uri} within {SERVER_START_S} s")
            time.sleep(0.5)
        yield uri
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        log.close()


def client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def runs(uri, experiment, running_id):
    """The tracker runs of the experiment tagged with `running_id`."""
    tracker = client(uri)
    found = tracker.get_experiment_by_name(experiment)
    if found is None:
        return []
    return [run for run in tracker.search_runs([found.experiment_id])
            if run.data.tags.get("deepepochs.running_id") == running_id]


def the_run(uri, experiment, running_id):
    """The one tracker run of `running_id` (fails when there are none or several)."""
    found = runs(uri, experiment, running_id)
    assert len(found) == 1, f"{len(found)} tracker runs for {running_id!r}"
    return found[0]


def series(uri, run) -> dict[str, list[tuple[int, float]]]:
    """`{tag: [(step, value), ...]}` of every metric the run holds, in step order (repeats kept)."""
    tracker = client(uri)
    return {key: sorted((m.step, m.value) for m in tracker.get_metric_history(run.info.run_id, key))
            for key in run.data.metrics}


def assert_tensorboard_has(logged: dict, run_folder) -> None:
    """`logged` (`series`) holds the scalar tags of the TensorBoard run in `run_folder`, at the same steps,
    with values equal in TensorBoard's float32."""
    events = EventAccumulator(str(run_folder))
    events.Reload()
    board = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert board.keys() == logged.keys()
    for tag, points in logged.items():
        assert [step for step, _ in points] == [step for step, _ in board[tag]], tag
        assert [np.float32(v) for _, v in points] == [np.float32(v) for _, v in board[tag]], tag


def weights(model) -> dict:
    """A copy of the model's state."""
    return {k: v.clone() for k, v in model.state_dict().items()}


def untracked_run(make_trainer, fit) -> tuple[dict, dict]:
    """The weights and history of `fit(trainer)` for the trainer `make_trainer()` builds (without any tracker),
    closed: the reference a tracked run must not differ from."""
    trainer, model = make_trainer()
    history = fit(trainer)
    trainer.close()
    return weights(model), history


def preempted_then_resumed(make_trainer, fit, tracker, folder, running_id: str, epoch: int, batch, check_first,
                           between=None) -> dict:
    """A job preempted by SIGTERM in epoch `epoch` (after training batch `batch`, or in that epoch's validation
    with None: `test_snapshots.SendAt`), closed, `check_first(its trainer)`, then the requeued job
    (`resume=True`) fitted to the end and closed; returns the resumed model's weights. `make_trainer(callbacks,
    resume=..., running_id=...)` gives (trainer, model); `tracker()` a new tracker callback."""
    first, _ = make_trainer([SnapshotCallback(folder), SendAt(signal.SIGTERM, epoch, batch), tracker()],
                            running_id=running_id)
    with pytest.raises(Preempted):
        fit(first)
    first.close()  # the requeued job's predecessor has ended
    check_first(first)
    if between is not None:  # what a new process would start afresh (the requeued job is one)
        between()
    resumed, model = make_trainer([SnapshotCallback(folder), tracker()], resume=True, running_id=running_id)
    fit(resumed)
    resumed.close()
    return weights(model)


def data():
    """The tracker tests' training loader (96 samples in 6 shuffled batches) and validation loader (40 in 2)."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g)
    loader = torch.Generator().manual_seed(4)
    return (DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=loader),
            DataLoader(TensorDataset(x[:40], y[:40]), batch_size=20))
