"""`WandbCallback` with W&B offline (no account, no network), read back from W&B's own run files
(`tests/wandb_files.py`): every metric at every step equals the trainer's history (and a plain
scheduler's rates), each step once, under the epoch clock and the update clock, after a SIGTERM and a
resume too; a rollback's discarded records never reach W&B; only the main process talks to W&B; the
arguments are checked. Where wandb is not installed these tests skip (the argument checks need it too)."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import test_mlflow as by_epochs  # tests/callbacks: the epoch clock's run and what a tracker must hold
import test_mlflow_updates as by_updates  # the update clock's
from mlflow_server import preempted_then_resumed, untracked_run  # tests/, on sys.path under pytest
from state_compare import states_equal  # tests/, on sys.path under pytest
from wandb_files import history_rows, run_files, scalar_series  # tests/, on sys.path under pytest

from deepepochs import ConfigError, Trainer, WandbCallback
from deepepochs.metrics import accuracy
from deepepochs.reporting.wandb_run import wandb_run_id

DOCS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "logging.md"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                                reason="wandb is not installed: pip install -e '.[wandb]'")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """W&B offline and quiet: no account, no network, no console capture."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    yield
    import wandb

    # Each test with a W&B core of its own: after a test whose job a SIGTERM preempted, the next run of the same
    # process otherwise found no core writing its files (a preempted job's process ends in real use).
    wandb.teardown()


def _tracker(folder):
    return WandbCallback("deepepochs-tests", mode="offline", dir=folder, close_timeout=120)


def _each_step_once(paths) -> None:
    """No W&B step appears in two history rows (a step logged twice would)."""
    steps = [step for step, _ in history_rows(paths)]
    assert len(steps) == len(set(steps)), steps


@pytest.mark.slow
def test_every_metric_reaches_wandb_once_at_its_epoch_with_the_histories_values(tmp_path):
    """A fit by epochs and a test: each `<metric>/<stage>` and `lr` at the 1-based epochs 1..3 (W&B steps),
    the test's metrics at 3, once each, with the history's values; training is unchanged by W&B."""
    weights, history = untracked_run(by_epochs._trainer, by_epochs._fit)
    trainer, model = by_epochs._trainer([_tracker(tmp_path)], running_id="epochs")
    records = by_epochs._fit(trainer)
    tested = trainer.test(by_epochs.data()[1], metrics=[accuracy])
    trainer.close()
    files = run_files(tmp_path, "epochs")
    logged = scalar_series(files)
    assert logged.pop("loss/test") == [(3, tested["loss"])] and logged.pop("accuracy/test") == [(3, tested["accuracy"])]
    assert logged == by_epochs._expected(records)
    _each_step_once(files)
    assert records == history and states_equal(by_epochs._weights(model), weights)


@pytest.mark.slow
def test_under_the_update_clock_every_scalar_is_at_its_update_count(tmp_path):
    """A fit by updates: validation points at 4, 8, 12, 15, the epochs' records at the counts their ends
    reached (6, 12, 15), `lr/update` at 1..15 with a plain scheduler's rates, as W&B steps, each once."""
    trainer, _ = by_updates._trainer([_tracker(tmp_path)], running_id="updates")
    records = by_updates._fit(trainer)
    trainer.close()
    files = run_files(tmp_path, "updates")
    assert scalar_series(files) == by_updates._expected(records, by_updates.BUDGET, [6, 12, 15])
    _each_step_once(files)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name == "nt", reason="POSIX signals")
@pytest.mark.parametrize("batch", [3, None], ids=["inside-a-window", "during-a-validation-point"])
def test_a_sigterm_then_resume_continues_one_wandb_run_with_each_step_once(tmp_path, batch):
    """Preempted in epoch 2 (after its 4th batch, or in the validation point at 8), the first job's file
    holds what it committed; the resumed job continues the W&B run (same id): the two files together hold
    every step once, equal to the uninterrupted run, and the weights are the uninterrupted run's."""
    weights, history = untracked_run(by_updates._trainer, by_updates._fit)
    running_id = f"preempted-{batch}"

    def check_first(first):
        stopped = first.loop.run.updates
        assert 6 < stopped < 12
        assert scalar_series(run_files(tmp_path, running_id)) == by_updates._expected(first.history, stopped, [6])

    def new_job():
        """The requeued job is a new process, with a W&B core of its own, started in a later second: W&B names an
        offline run's folder by the second it starts, and two in one second would share one folder."""
        import wandb

        wandb.teardown()
        time.sleep(1.0 - time.time() % 1.0 + 0.05)

    resumed = preempted_then_resumed(by_updates._trainer, by_updates._fit, lambda: _tracker(tmp_path), tmp_path,
                                     running_id, 2, batch, check_first, between=new_job)
    files = run_files(tmp_path, running_id, count=2)
    assert len(files) == 2
    assert scalar_series(files) == by_updates._expected(history, by_updates.BUDGET, [6, 12, 15])
    _each_step_once(files)
    assert states_equal(resumed, weights)


@pytest.mark.slow
def test_a_validation_point_a_rollback_discarded_never_reaches_wandb(tmp_path):
    """The validation point at 8 fails in its end hooks after the tracker read its records: W&B holds the
    point at 4 only, as the history does, and the rates of the 8 committed updates."""
    trainer, _ = by_updates._trainer([by_updates.FailAtPoint(8), _tracker(tmp_path)], running_id="discarded")
    with pytest.raises(RuntimeError, match="failed"):
        by_updates._fit(trainer)
    trainer.close()
    assert trainer.history["val"]["updates"] == [4]
    assert scalar_series(run_files(tmp_path, "discarded")) == by_updates._expected(trainer.history, 8, [6])


@pytest.mark.slow
def test_the_logging_guides_wandb_example_runs_offline(tmp_path, monkeypatch):
    """The W&B block of docs/guide/logging.md runs after the page's first block (its data), offline, and its
    run file holds each validation point's loss at its update count."""
    page = DOCS_PAGE.read_text()
    first = re.search(r"```python\n(.*?)```", page, re.S).group(1)
    blocks = re.findall(r"<!-- norun: [^\n]*wandb[^\n]*-->\n```python\n(.*?)```", page, re.S)
    assert len(blocks) == 1
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "docs_page"}
    for code in (first, blocks[0]):
        exec(compile(code, f"{DOCS_PAGE}:wandb", "exec"), namespace)  # noqa: S102
    val = namespace["trainer"].history["val"]
    logged = scalar_series(run_files(tmp_path / "wandb-runs", "linear-w"))
    assert logged["loss/val"] == list(zip(val["updates"], val["loss"])) and val["updates"] == [6, 12, 18]


def test_only_the_main_process_talks_to_wandb(tmp_path, monkeypatch):
    """On a rank other than 0 the callback starts no thread and W&B writes no file."""
    def workers():
        return {t for t in threading.enumerate() if t.name == "deepepochs-wandb" and t.is_alive()}

    before = workers()
    trainer, _ = by_epochs._trainer([_tracker(tmp_path)], running_id="rank1")
    monkeypatch.setattr(Trainer, "is_main_process", property(lambda self: False))
    by_epochs._fit(trainer)
    assert workers() <= before
    trainer.close()
    assert not (tmp_path / "wandb").exists()


@pytest.mark.parametrize("kwargs, message", [
    ({"project": ""}, r"project must be a non-empty project name string \(got ''\)"),
    ({"mode": "local"}, r"mode must be None \(W&B's default, WANDB_MODE\) or one of 'online', 'offline',"
                        r" 'disabled', 'shared' \(got 'local'\)"),
    ({"dir": 3}, r"dir must be None or a folder path \(got int\)"),
    ({"id": "x"}, r"does not take wandb.init's id=: the running id names the W&B run"),
    ({"resume": "must"}, r"does not take wandb.init's resume=: the callback continues the run"),
    ({"log_checkpoints": 1}, r"log_checkpoints must be True, False or the monitor name .*\(got 1\)"),
    ({"queue_size": 0}, r"WandbCallback queue_size must be an int >= 1 \(got 0\)"),
    ({"close_timeout": float("nan")}, r"close_timeout must be a number of seconds >= 0 \(got nan\)"),
])
def test_bad_arguments_are_refused_naming_the_argument(kwargs, message):
    """Each argument's check names it, what it takes and what came."""
    with pytest.raises(ConfigError, match=message):
        WandbCallback(**kwargs)


def test_the_repr_names_init_arguments_without_their_values():
    """`settings=` (which may hold an API key) and other wandb.init arguments are named, never shown."""
    text = repr(WandbCallback("p", mode="offline", entity="secret-entity", notes="api-key-123"))
    assert text == ("WandbCallback(project='p', mode='offline', dir=None, log_checkpoints=False, entity=...,"
                    " notes=...)")


@pytest.mark.parametrize("running_id", ["run-a_1", "a/b:c", "x" * 80])
def test_w_and_b_run_ids_are_the_running_id_or_a_safe_name_with_its_hash(running_id):
    """A running id W&B takes is the run id; another becomes its safe characters and a hash, at most 64."""
    run_id = wandb_run_id(running_id)
    assert len(run_id) <= 64 and all(c.isalnum() or c in "-_" for c in run_id)
    assert (run_id == running_id) == (running_id == "run-a_1")
    assert wandb_run_id(running_id + "!") != run_id
