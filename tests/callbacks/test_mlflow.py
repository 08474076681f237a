"""`MLflowCallback` against a real MLflow tracking server (`tests/mlflow_server.py`: started once per session
on 127.0.0.1 with a SQLite store and a local artifact folder), read back through MLflow's own client: every
metric at every step equals the trainer's history and TensorBoard's values; parameters, tags and artifacts
are there; a preempted and resumed run is one tracker run with each step once; an epoch end a rollback undid
never reaches the tracker; a tracker that refuses connections or stops answering mid-fit costs no training
progress. Where mlflow is not installed or the server cannot start, these tests skip and say why (the
argument checks need mlflow only). Training by updates and DDP: `test_mlflow_updates.py`."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
import warnings
from pathlib import Path

import pytest
import torch
from mlflow_server import assert_tensorboard_has, data, preempted_then_resumed, untracked_run  # tests/
from mlflow_server import client as _client
from mlflow_server import runs as _runs
from mlflow_server import series as _series
from mlflow_server import the_run as _the_run
from mlflow_server import weights as _weights
from state_compare import states_equal  # tests/, on sys.path under pytest
from torch import nn
from torch.nn import functional as F

from deepepochs import (
    Callback,
    CheckCallback,
    ConfigError,
    LogCallback,
    MLflowCallback,
    Optimizer,
    SnapshotCallback,
    Trainer,
    WandbCallback,
)
from deepepochs.callbacks import mlflow_tracker, wandb_tracker
from deepepochs.errors import DeepEpochsWarning
from deepepochs.fsm.render import render
from deepepochs.metrics import accuracy

needs_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                                  reason="mlflow is not installed: pip install -e '.[mlflow]'")
DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "logging.md"
# Experiment names of this session (a server named by DEEPEPOCHS_TEST_MLFLOW_URI keeps earlier sessions' runs)
SESSION = uuid.uuid4().hex[:8]
EXPERIMENT = {name: f"{name}-{SESSION}"
              for name in ("logged", "preempted", "rolled-back", "down", "linear", "credentials")}


# ---- the training run ----
def _trainer(callbacks=(), resume=False, hyper_params=None, running_id="run"):
    """A model with BatchNorm and dropout on shuffled data, Adam with an epoch-wise StepLR halving the rate."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    trainer = Trainer(model, F.cross_entropy, Optimizer(opt, sched), epochs=3, callbacks=list(callbacks),
                      resume=resume, running_id=running_id, hyper_params=hyper_params, show_info=False,
                      log_batch=False)
    return trainer, model


def _fit(trainer):
    train, val = data()
    return trainer.fit(train, val, metrics=[accuracy])


def _expected(history) -> dict[str, list[tuple[int, float]]]:
    """What the tracker must hold: each stage's metric at its 1-based epoch, the rate each epoch used."""
    out = {f"{name}/{stage}": list(enumerate(values, 1)) for stage, metrics in history.items()
           for name, values in metrics.items()}
    out["lr"] = [(epoch, 0.01 * 0.5 ** (epoch - 1)) for epoch in (1, 2, 3)]
    return out


@pytest.fixture(scope="module")
def reference():
    """The run without any tracker: its weights and history."""
    return untracked_run(_trainer, _fit)


@pytest.fixture(scope="module")
def logged(tracking_server, tmp_path_factory):
    """One fit and test logged to MLflow and TensorBoard, with the best checkpoint uploaded."""
    folder = tmp_path_factory.mktemp("logged")
    callbacks = [CheckCallback("loss", ckpt_dir=folder / "ckpt"), LogCallback(folder / "logs", csv=False),
                 MLflowCallback(tracking_server, experiment=EXPERIMENT["logged"], log_checkpoints="loss")]
    hyper_params = {"lr": 0.01, "batch_size": 16, "arch": "bn-mlp"}
    trainer, model = _trainer(callbacks, hyper_params=hyper_params)
    _fit(trainer)
    test_metrics = trainer.test(data()[1], metrics=[accuracy])
    trainer.close()
    run = _the_run(tracking_server, EXPERIMENT["logged"], "run")
    return dict(trainer=trainer, weights=_weights(model), test=test_metrics, run=run, folder=folder,
                series=_series(tracking_server, run), hyper_params=hyper_params, uri=tracking_server)


@pytest.mark.slow
def test_every_metric_reaches_the_tracker_once_per_epoch_with_the_histories_values(logged, reference):
    """Each `<metric>/<stage>` holds the history's value at each 1-based epoch, once; `lr` the rate each
    epoch used; `<metric>/test` the test's result at the completed-epoch count; training is unchanged."""
    series = dict(logged["series"])
    assert series.pop("loss/test") == [(3, logged["test"]["loss"])]
    assert series.pop("accuracy/test") == [(3, logged["test"]["accuracy"])]
    assert series == _expected(logged["trainer"].history)
    assert logged["trainer"].history == reference[1]
    assert states_equal(logged["weights"], reference[0])


@pytest.mark.slow
def test_the_tracker_gets_the_tags_steps_and_values_tensorboard_gets(logged):
    """The same scalar tags at the same steps as LogCallback's event file, equal in its float32."""
    assert_tensorboard_has(logged["series"], logged["folder"] / "logs" / "run")


@pytest.mark.slow
def test_hyper_parameters_tags_and_status_are_recorded(logged):
    """hyper_params become parameters (as strings); the run is named and tagged by its running id and
    carries the versions and world size; a closed run is FINISHED."""
    run = logged["run"]
    assert run.data.params == {k: str(v) for k, v in logged["hyper_params"].items()}
    tags = run.data.tags
    assert tags["deepepochs.running_id"] == "run" and tags["mlflow.runName"] == "run"
    assert tags["deepepochs.torch_version"] == torch.__version__ and tags["deepepochs.world_size"] == "1"
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", tags["deepepochs.version"])
    assert _client(logged["uri"]).get_run(run.info.run_id).info.status == "FINISHED"


@pytest.mark.slow
def test_the_state_graph_and_the_best_checkpoint_are_artifacts(logged, tmp_path):
    """`deepepochs/state-graph.mmd` holds the loop's Mermaid graph; `checkpoints/` the best file, byte for byte."""
    client = _client(logged["uri"])
    run_id = logged["run"].info.run_id
    graph = client.download_artifacts(run_id, "deepepochs/state-graph.mmd", str(tmp_path))
    assert Path(graph).read_text() == render("mermaid")
    uploaded = client.download_artifacts(run_id, "checkpoints/val-loss.best.ckpt", str(tmp_path))
    assert Path(uploaded).read_bytes() == (logged["folder"] / "ckpt" / "run" / "val-loss.best.ckpt").read_bytes()


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name == "nt", reason="POSIX signals")
@pytest.mark.parametrize("batch, steps_before", [(2, [1]), (None, [1, 2])],
                         ids=["inside-epoch-2", "at-the-end-of-epoch-2"])
def test_a_sigterm_then_resume_continues_one_tracker_run_with_each_step_once(tracking_server, tmp_path, reference,
                                                                            batch, steps_before):
    """Preempted inside epoch 2 (or during its validation: the epoch's end commits first), the first process
    sends the committed epochs only; the resumed fit continues the same tracker run: steps 1-3 once each,
    equal to the uninterrupted run."""
    running_id = f"preempted-{batch}"

    def tracker():
        return MLflowCallback(tracking_server, experiment=EXPERIMENT["preempted"], close_timeout=60)

    def check_first(_trainer):
        assert {tag: [s for s, _ in points] for tag, points in
                _series(tracking_server, _the_run(tracking_server, EXPERIMENT["preempted"], running_id)).items()} == {
            tag: steps_before for tag in _expected(reference[1])}

    resumed = preempted_then_resumed(_trainer, _fit, tracker, tmp_path, running_id, 2, batch, check_first)
    assert states_equal(resumed, reference[0])
    run = _the_run(tracking_server, EXPERIMENT["preempted"], running_id)
    assert _series(tracking_server, run) == _expected(reference[1])


PREEMPTED_SCRIPT = """
import signal, sys
sys.path[:0] = [{tests!r}, {here!r}]
from test_mlflow import _fit, _trainer
from test_snapshots import SendAt
from deepepochs import MLflowCallback, SnapshotCallback
trainer, _ = _trainer([SnapshotCallback({folder!r}), SendAt(signal.SIGTERM, 2, None),
                       MLflowCallback({uri!r}, experiment={experiment!r})], running_id="exits")
_fit(trainer)  # Preempted ends the process (exit status 143), without trainer.close()
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name == "nt", reason="POSIX signals")
def test_a_preempted_process_that_exits_without_close_still_sends_its_committed_epochs(tracking_server, tmp_path):
    """A job preempted at epoch 2's end exits with Preempted and never closes its trainer: at the
    interpreter's exit the queue is still sent (a bounded wait), so the tracker holds epochs 1 and 2."""
    here = Path(__file__).resolve().parent
    script = PREEMPTED_SCRIPT.format(tests=str(here.parent), here=str(here), folder=str(tmp_path), uri=tracking_server,
                                     experiment=EXPERIMENT["preempted"])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    run = _the_run(tracking_server, EXPERIMENT["preempted"], "exits")
    assert {tag: [step for step, _ in points] for tag, points in _series(tracking_server, run).items()} == {
        tag: [1, 2] for tag in ("loss/train", "accuracy/train", "loss/val", "accuracy/val", "lr")}


class FailAtEpochEnd(Callback):
    """Raises in the end hooks of epoch `epoch` (after the callbacks registered later ran theirs)."""

    def __init__(self, epoch):
        self.epoch = epoch

    def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx):
        if epoch_idx + 1 == self.epoch:
            raise RuntimeError("the epoch's end failed")


@pytest.mark.slow
def test_an_epoch_end_that_a_rollback_undid_never_reaches_the_tracker(tracking_server):
    """Epoch 2's end fails after the tracker callback saw its records: the rollback undoes it, and the
    tracker holds epoch 1 only, as the history does."""
    trainer, _ = _trainer([FailAtEpochEnd(2), MLflowCallback(tracking_server, experiment=EXPERIMENT["rolled-back"])],
                          running_id="rolled-back")
    with pytest.raises(RuntimeError, match="the epoch's end failed"):
        _fit(trainer)
    assert trainer.loop.completed_epochs == 1
    trainer.close()
    run = _the_run(tracking_server, EXPERIMENT["rolled-back"], "rolled-back")
    expected = {tag: points[:1] for tag, points in _expected(trainer.history).items()}
    assert _series(tracking_server, run) == expected
    assert _client(tracking_server).get_run(run.info.run_id).info.status == "FAILED"


class Gate:
    """A TCP forwarder on 127.0.0.1 in front of the tracking server: `refuse()` closes it (connections are
    refused, as by a stopped server), `hang()` keeps connections open but never answers again."""

    def __init__(self, target: str):
        self.target = ("127.0.0.1", int(target.rsplit(":", 1)[1]))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.uri = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.mode = "forward"
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.sockets.append(client)
            if self.mode == "refuse":
                client.close()
                return
            if self.mode == "hang":
                continue  # held open, never answered
            server = socket.create_connection(self.target)
            self.sockets.append(server)
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client), daemon=True).start()

    def _pump(self, source, sink):
        try:
            while self.mode == "forward":
                data = source.recv(65536)
                if not data or self.mode != "forward":
                    break
                sink.sendall(data)
        except OSError:
            pass

    def refuse(self):
        self.mode = "refuse"
        try:  # wakes the thread blocked in accept() (closing alone does not, on Linux)
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        self._close_all()

    def hang(self):
        self.mode = "hang"  # the pumps stop forwarding; new connections are held

    def _close_all(self):
        for sock in self.sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


class Act(Callback):
    """Calls `action()` when epoch `epoch` starts."""

    def __init__(self, epoch, action):
        self.epoch, self.action = epoch, action

    def on_before_epoch(self, trainer, train_tasks, val_tasks, epoch_idx):
        if epoch_idx + 1 == self.epoch:
            self.action()


@pytest.mark.slow
@pytest.mark.parametrize("failure", ["refuse", "hang"])
def test_a_tracker_that_goes_down_mid_fit_costs_no_training_progress(tracking_server, reference, monkeypatch,
                                                                    failure):
    """The tracker refuses connections (or stops answering) from epoch 2 on: the fit ends with the weights
    and history of the run without a tracker, the failure is said with its reason (connection refused; or
    records left unsent when close's wait ran out), close() waits at most its timeout, and the tracker
    holds epoch 1, which it got before."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # a refused request fails at once
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")  # a loaded machine's server may take seconds
    gate = Gate(tracking_server)
    running_id = f"down-{failure}"

    def go_down():  # once the tracker holds epoch 1 (the worker imports mlflow first: seconds)
        deadline = time.monotonic() + 120
        while not _holds_epoch_1():
            assert time.monotonic() < deadline, "epoch 1 never reached the tracker"
            time.sleep(0.2)
        getattr(gate, failure)()

    def _holds_epoch_1():
        try:
            runs = _runs(tracking_server, EXPERIMENT["down"], running_id)
            return any("loss/train" in run.data.metrics for run in runs)
        except Exception:  # the test's own request timed out: ask again
            return False

    tracker = MLflowCallback(gate.uri, experiment=EXPERIMENT["down"], close_timeout=3)
    # the tracker first: its start-of-epoch hook sends epoch 1 before Act's waits for it
    trainer, model = _trainer([tracker, Act(2, go_down)], running_id=running_id)
    with pytest.warns(DeepEpochsWarning) as said:
        history = _fit(trainer)
        start = time.monotonic()
        trainer.close()
        closing = time.monotonic() - start
    gate.refuse()
    assert states_equal(_weights(model), reference[0]) and history == reference[1]
    assert closing < 3 + 2
    reasons = " | ".join(str(w.message) for w in said)
    if failure == "refuse":
        assert re.search(r"a call failed \(MlflowException: .*Connection refused", reasons), reasons
        assert reasons.count("a call failed") == 1, reasons  # said once, though every later call failed too
    else:  # no answer within close_timeout: what was left is said not sent
        assert re.search(r"the tracker did not take the last \d+ record\(s\) within close_timeout=3s", reasons), reasons
    series = _series(tracking_server, _the_run(tracking_server, EXPERIMENT["down"], running_id))
    assert series == {tag: points[:1] for tag, points in _expected(reference[1]).items()}


@pytest.mark.slow
def test_the_logging_guides_mlflow_example_runs_against_the_server(tracking_server, tmp_path, monkeypatch):
    """The MLflow block of docs/guide/logging.md runs (its server address replaced by this session's)."""
    blocks = re.findall(r"<!-- norun: [^\n]*MLflow[^\n]*-->\n```python\n(.*?)```", DOCS_PAGE.read_text(), re.S)
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    code = blocks[0].replace("http://127.0.0.1:5000", tracking_server).replace("'linear'", repr(EXPERIMENT["linear"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        exec(compile(code, f"{DOCS_PAGE}:mlflow", "exec"), {"__name__": "docs_page"})  # noqa: S102


PASSWORD = "s3cr3t-Pw"


def _with_credentials(uri: str) -> str:
    return uri.replace("http://", f"http://alice:{PASSWORD}@", 1)


@pytest.mark.slow
def test_credentials_in_the_tracking_uri_are_never_printed_or_written(tracking_server, tmp_path, capfd):
    """A fit, a test and a close against `http://alice:<password>@host` (the server ignores them): the
    tracker records the run; the console (MLflow's own run link included, shown with `***@`), the
    callback's repr, every warning and every file the run wrote (checkpoints, snapshots, TensorBoard and
    CSV logs) hold no password; a server that refuses connections is said so without it too."""
    tracker = MLflowCallback(_with_credentials(tracking_server), experiment=EXPERIMENT["credentials"])
    callbacks = [CheckCallback("loss", ckpt_dir=tmp_path / "ckpt"), SnapshotCallback(tmp_path / "snap"),
                 LogCallback(tmp_path / "logs"), tracker]
    trainer, _ = _trainer(callbacks, running_id="credentials")
    trainer.show_info = True
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        _fit(trainer)
        trainer.test(data()[1], metrics=[accuracy])
        trainer.close()
        refused = MLflowCallback(f"http://alice:{PASSWORD}@127.0.0.1:{_closed_port()}", close_timeout=5)
        monkey = pytest.MonkeyPatch()
        monkey.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        try:
            other, _ = _trainer([refused], running_id="refused")
            _fit(other)
            other.close()
        finally:
            monkey.undo()
    out = capfd.readouterr()
    printed = out.out + out.err + repr(tracker) + repr(refused) + " ".join(str(w.message) for w in said)
    assert PASSWORD not in printed and "alice" not in printed
    assert "View run credentials at: http://***@127.0.0.1" in out.out
    assert re.search(r"MLflowCallback \(http://\*\*\*@127\.0\.0\.1:\d+\): a call failed", printed), printed
    for path in tmp_path.rglob("*"):
        assert not path.is_file() or PASSWORD.encode() not in path.read_bytes(), path
    assert "loss/train" in _the_run(tracking_server, EXPERIMENT["credentials"], "credentials").data.metrics


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---- arguments (no server needed) ----
@pytest.mark.parametrize("kwargs, message", [
    ({"tracking_uri": "localhost:5000"}, r"tracking_uri must be .*got 'localhost:5000': 'localhost' is not a scheme"
                                         r" MLflow tracks to; a server is 'http://localhost:5000'"),
    ({"tracking_uri": "http://"}, r"tracking_uri .*got 'http://': it names no host"),
    ({"tracking_uri": "http://127.0.0.1:99999"}, r"tracking_uri .*its port is not a number from 0 to 65535"),
    ({"tracking_uri": "htp://host:5000"}, r"tracking_uri .*'htp' is not a scheme MLflow tracks to"),
    ({"tracking_uri": "sqlite:mlflow.db"}, r"tracking_uri .*a database URI reads 'sqlite://\.\.\.'"),
    ({"tracking_uri": "http://[::1"}, r"tracking_uri .*\(got 'http://\[::1': it is not a URI: Invalid IPv6 URL\)"),
    ({"tracking_uri": "http://bob:pw-123@[::1"}, r"tracking_uri .*\(got 'http://\*\*\*@\[::1': it is not a URI"),
    ({"tracking_uri": "http://bob:pw-123@host:99999"}, r"\(got 'http://\*\*\*@host:99999': its port is not"),
    ({"tracking_uri": "file:///tmp/mlruns"}, r"tracking_uri .*got 'file:///tmp/mlruns': MLflow's file store is in"
                                             r" maintenance mode and refuses to record .*use a database in that"
                                             r" folder, 'sqlite:////tmp/mlruns/mlflow.db', or set"
                                             r" MLFLOW_ALLOW_FILE_STORE=true"),
    ({"tracking_uri": "./mlruns"}, r"got './mlruns': MLflow's file store .*'sqlite:///\./mlruns/mlflow.db'"),
    ({"tracking_uri": ""}, r"tracking_uri must be None .*\(got ''\)"),
    ({"tracking_uri": 5000}, r"tracking_uri must be None .*\(got 5000\)"),
    ({"experiment": 3}, r"experiment must be a non-empty experiment name string \(got 3\)"),
    ({"experiment": ""}, r"experiment must be a non-empty experiment name string \(got ''\)"),
    ({"log_checkpoints": 1}, r"log_checkpoints must be True, False or the monitor name of a CheckCallback .*\(got 1\)"),
    ({"log_checkpoints": None}, r"log_checkpoints must be True, False or .*\(got None\)"),
    ({"queue_size": 0}, r"queue_size must be an int >= 1 \(got 0\)"),
    ({"close_timeout": -1}, r"close_timeout must be a number of seconds >= 0 \(got -1\)"),
])
def test_bad_arguments_are_refused_naming_the_argument(kwargs, message, monkeypatch):
    """Each argument's check names it, what it takes and what came (a password written `***`)."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(ConfigError, match=message) as refused:
        MLflowCallback(**kwargs)
    assert "pw-123" not in str(refused.value)


@needs_mlflow
@pytest.mark.parametrize("uri", ["http://127.0.0.1:5000", "https://mlflow.example.com/path", "sqlite:///mlflow.db",
                                 "postgresql+psycopg2://user@db/mlflow", "databricks", "http://[::1]:5000"])
def test_well_formed_tracking_uris_are_taken(uri):
    """Server addresses and database URIs pass the check."""
    assert MLflowCallback(uri).tracking_uri == uri


@needs_mlflow
@pytest.mark.parametrize("uri", ["file:///tmp/mlruns", "./mlruns", Path("mlruns")])
def test_file_stores_are_taken_when_mlflows_own_switch_allows_them(uri, monkeypatch):
    """With MLFLOW_ALLOW_FILE_STORE=true (MLflow's switch that keeps its file store) file stores pass."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    assert MLflowCallback(uri).tracking_uri == os.fspath(uri)


@needs_mlflow
def test_a_file_store_allowed_by_mlflows_switch_records_the_run(tmp_path, monkeypatch):
    """`file:///folder` with MLFLOW_ALLOW_FILE_STORE=true: the pinned MLflow records every epoch there."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    trainer, _ = _trainer([MLflowCallback(uri, experiment="files")], running_id="files")
    history = _fit(trainer)
    trainer.close()
    assert {tag: [s for s, _ in points] for tag, points in _series(uri, _the_run(uri, "files", "files")).items()} == {
        tag: [1, 2, 3] for tag in _expected(history)}


@needs_mlflow
def test_a_log_checkpoints_name_that_matches_no_checkpoint_fails_before_training(tmp_path):
    """log_checkpoints='accuracy' without such a CheckCallback fails when the fit starts, naming what exists."""
    trainer, model = _trainer([CheckCallback("loss", ckpt_dir=tmp_path),
                               MLflowCallback(f"sqlite:///{tmp_path}/mlflow.db", log_checkpoints="accuracy")])
    before = _weights(model)
    with pytest.raises(ConfigError, match=r"log_checkpoints='accuracy' names no checkpoint of this trainer: .*"
                                          r"\(the trainer has \['val-loss.best'\]\)"):
        _fit(trainer)
    assert states_equal(_weights(model), before) and trainer.loop.completed_epochs == 0
    trainer.close()


@pytest.mark.parametrize("module, package, pin, callback", [
    (mlflow_tracker, "mlflow", "mlflow>=3,<3.18", MLflowCallback),
    (wandb_tracker, "wandb", "wandb>=0.19", WandbCallback)], ids=["mlflow", "wandb"])
def test_without_its_package_a_tracker_callback_names_the_extra_to_install(monkeypatch, module, package, pin,
                                                                           callback):
    """When mlflow (wandb) cannot be imported, building the callback names the package to install, and the
    clone's extra (never the package index's deepepochs, an older release)."""
    find_spec = module.importlib.util.find_spec
    monkeypatch.setattr(module.importlib.util, "find_spec",
                        lambda name, *args: None if name == package else find_spec(name, *args))
    with pytest.raises(ImportError, match=rf"pip install '{re.escape(pin)}' \(in a clone of deepepochs:"
                                          rf" pip install -e '\.\[{package}\]'\)"):
        callback()


@needs_mlflow
def test_only_the_main_process_talks_to_the_tracker(tmp_path, monkeypatch):
    """On a rank other than 0 the callback starts no thread and writes no tracker store."""
    def workers():
        return {t for t in threading.enumerate() if t.name == "deepepochs-mlflow" and t.is_alive()}

    before = workers()
    trainer, _ = _trainer([MLflowCallback(f"sqlite:///{tmp_path}/mlflow.db")], running_id="rank1")
    monkeypatch.setattr(Trainer, "is_main_process", property(lambda self: False))
    _fit(trainer)
    assert workers() <= before
    trainer.close()
    assert not (tmp_path / "mlflow.db").exists()
