"""`MLflowCallback` under the update clock (`Trainer(max_updates=N)`, `fit(val_every_n_updates=M)`) and under
DDP, against the real MLflow tracking server (`tests/mlflow_server.py`), read back through MLflow's client:
each validation point's metrics at its update count and the learning rate of every update, equal to the
trainer's history and to a plain scheduler's rates, at the steps TensorBoard gets; a validation point that a
rollback discarded never reaches the tracker; a SIGTERM and resume continue one tracker run with each step
once; under DDP only rank 0 talks to the tracker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from mlflow_server import (  # tests/, on sys.path under pytest
    assert_tensorboard_has,
    client,
    data,
    preempted_then_resumed,
    series,
    the_run,
    untracked_run,
    weights,
)
from state_compare import states_equal  # tests/, on sys.path under pytest
from torch import nn
from torch.nn import functional as F

from deepepochs import Callback, LogCallback, MLflowCallback, Optimizer, SnapshotCallback, Trainer
from deepepochs.callbacks import tracker as tracker_core
from deepepochs.metrics import accuracy

# Spawned children import their targets by module name; they inherit this sys.path entry.
DISTRIBUTED = Path(__file__).resolve().parents[1] / "distributed"
if str(DISTRIBUTED) not in sys.path:
    sys.path.insert(0, str(DISTRIBUTED))

import mlflow_targets as D  # noqa: E402  (needs the sys.path entry above)
from deadline import launched_ranks  # noqa: E402  (same sys.path entry)

SESSION = uuid.uuid4().hex[:8]
EXPERIMENT = {name: f"{name}-{SESSION}" for name in ("updates", "discarded", "preempted", "ddp", "killed")}
BUDGET, EVERY = 15, 4  # 6 updates an epoch: epochs end at 6, 12 and 15; validation points at 4, 8, 12, 15


def _schedule(opt):
    """The learning rate decayed linearly to a tenth over 20 updates, stepped per update."""
    return torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=20)


def _rates(schedule, updates: int) -> list[float]:
    """What a plain scheduler gives: the rate each update uses, then the rate after the last one."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    sched, rates = schedule(opt), []
    for _ in range(updates + 1):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return rates


def _trainer(callbacks=(), resume=False, running_id="run"):
    """BatchNorm and dropout on shuffled data; SGD with momentum and a per-update schedule; a budget of 15."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = Trainer(model, F.cross_entropy, Optimizer(opt, _schedule(opt), sched_on="step"), max_updates=BUDGET,
                      callbacks=list(callbacks), resume=resume, running_id=running_id, show_info=False,
                      log_batch=False)
    return trainer, model


def _fit(trainer):
    train, val = data()
    return trainer.fit(train, val, metrics=[accuracy], val_every_n_updates=EVERY)


def _expected(history, updates: int, epoch_ends, schedule=_schedule) -> dict[str, list[tuple[int, float]]]:
    """What the tracker must hold after `updates` committed updates, every scalar at an update count (one
    axis under the update clock): each epoch's training metrics and the rate after its last update at the
    count its end reached (`epoch_ends`), each validation point's metrics at its count, the rate each update
    used (a plain scheduler's) at its count."""
    out = {f"{name}/train": list(zip(epoch_ends, values)) for name, values in history["train"].items()}
    points = history["val"]["updates"]
    out.update({f"{name}/val": list(zip(points, values)) for name, values in history["val"].items()
                if name != "updates"})
    rates = _rates(schedule, updates)
    out["lr/update"] = list(enumerate(rates[:updates], 1))
    epochs = len(history["train"].get("loss", ()))
    out["lr"] = [(end, rates[end]) for end in epoch_ends[:epochs]]
    return {tag: points for tag, points in out.items() if points}


@pytest.fixture(scope="module")
def reference():
    """The run without any tracker: its weights and history."""
    return untracked_run(_trainer, _fit)


@pytest.fixture(scope="module")
def by_updates(tracking_server, tmp_path_factory):
    """One fit by updates logged to MLflow and TensorBoard; the tracker's records are handed on every 3 staged
    records too (inside the optimizer's step, as in a long stretch of updates)."""
    folder = tmp_path_factory.mktemp("by-updates")
    trainer, model = _trainer([LogCallback(folder, csv=False), MLflowCallback(tracking_server,
                                                                            experiment=EXPERIMENT["updates"])])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tracker_core, "_SEND_EVERY", 3)
        history = _fit(trainer)
    trainer.close()
    run = the_run(tracking_server, EXPERIMENT["updates"], "run")
    return dict(history=history, weights=weights(model), series=series(tracking_server, run), folder=folder)


@pytest.mark.slow
def test_each_validation_point_and_update_reaches_the_tracker_once_at_its_update_count(by_updates, reference):
    """`<metric>/val` at 4, 8, 12 and 15 with the history's values, `lr/update` at 1..15 with a plain
    scheduler's rates, the epochs' records at the update counts their ends reached (6, 12, 15), on the same
    axis; training is unchanged by the tracker."""
    assert by_updates["history"]["val"]["updates"] == [4, 8, 12, 15]
    assert by_updates["series"] == _expected(by_updates["history"], BUDGET, [6, 12, 15])
    assert by_updates["history"] == reference[1]
    assert states_equal(by_updates["weights"], reference[0])


@pytest.mark.slow
def test_under_the_update_clock_the_tracker_gets_the_steps_and_values_tensorboard_gets(by_updates):
    """The same scalar tags at the same steps as LogCallback's event file, equal in its float32."""
    assert_tensorboard_has(by_updates["series"], by_updates["folder"] / "run")


class FailAtPoint(Callback):
    """Raises in the end hooks of the validation point at `updates` (after the callbacks registered later
    ran theirs), before the point commits."""

    def __init__(self, updates):
        self.updates = updates

    def on_after_val_epochs(self, trainer, tasks, metrics, epoch_idx):
        if trainer.loop.val_point_open and trainer.loop.run.updates == self.updates:
            raise RuntimeError("the validation point failed")


class FailAtUpdate(Callback):
    """Makes the optimizer's step raise before it applies update `update` (a pre-hook registered after the
    tracker's, which has read the update's rate by then)."""

    def __init__(self, update):
        self.update = update

    def on_before_fit(self, trainer, epochs):
        def fail(_optimizer, _args, _kwargs):
            if trainer.loop.run.updates + 1 == self.update:
                raise RuntimeError("the update failed")

        trainer.opt[0].opt.register_step_pre_hook(fail)


@pytest.mark.slow
@pytest.mark.parametrize("fault, updates, epoch_ends", [
    (lambda tracker: [FailAtPoint(8), tracker], 8, [6]),  # after-hooks run in reverse: the tracker's first
    (lambda tracker: [tracker, FailAtUpdate(5)], 4, []),
], ids=["a-validation-point", "an-update"])
def test_what_a_rollback_discarded_never_reaches_the_tracker(tracking_server, fault, updates, epoch_ends):
    """The validation point at 8 fails in its end hooks, or update 5 inside the optimizer's step, after the
    tracker callback read its records: the rollback returns to the last committed update, the history holds
    the point at 4 only, and so does the tracker, with the rates of the committed updates only."""
    running_id = f"discarded-{updates}"
    trainer, _ = _trainer(fault(MLflowCallback(tracking_server, experiment=EXPERIMENT["discarded"])),
                          running_id=running_id)
    with pytest.raises(RuntimeError, match="failed"):
        _fit(trainer)
    trainer.close()
    assert trainer.loop.run.updates == updates and trainer.history["val"]["updates"] == [4]
    run = the_run(tracking_server, EXPERIMENT["discarded"], running_id)
    assert series(tracking_server, run) == _expected(trainer.history, updates, epoch_ends)
    assert client(tracking_server).get_run(run.info.run_id).info.status == "FAILED"


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name == "nt", reason="POSIX signals")
@pytest.mark.parametrize("batch", [3, None], ids=["inside-a-window", "during-a-validation-point"])
def test_a_sigterm_then_resume_under_the_update_clock_logs_each_step_once(tracking_server, tmp_path, reference,
                                                                         batch):
    """Preempted in epoch 2 (after its 4th batch, or in the validation point at 8), the first process sends
    what it committed, as its history says; the resumed fit continues the same tracker run, which then holds
    every step once, equal to the uninterrupted run."""
    running_id = f"preempted-{batch}"

    def tracker():
        return MLflowCallback(tracking_server, experiment=EXPERIMENT["preempted"], close_timeout=60)

    def check_first(first):
        stopped = first.loop.run.updates
        assert 6 < stopped < 12
        run = the_run(tracking_server, EXPERIMENT["preempted"], running_id)
        assert series(tracking_server, run) == _expected(first.history, stopped, [6])

    resumed = preempted_then_resumed(_trainer, _fit, tracker, tmp_path, running_id, 2, batch, check_first)
    assert states_equal(resumed, reference[0])
    run = the_run(tracking_server, EXPERIMENT["preempted"], running_id)
    assert series(tracking_server, run) == _expected(reference[1], BUDGET, [6, 12, 15])


KILLED_SCRIPT = """
import signal, sys
sys.path[:0] = [{tests!r}, {here!r}]
from test_mlflow_updates import _fit, _trainer
from test_snapshots import SendAt
from deepepochs import MLflowCallback, SnapshotCallback
trainer, _ = _trainer([SnapshotCallback({folder!r}, every_n_updates=1), SendAt(signal.SIGKILL, 2, 3),
                       MLflowCallback({uri!r}, experiment={experiment!r})], running_id="killed")
_fit(trainer)  # SIGKILL after update 10: the point at 8 committed and is in the snapshot at 9, never sent
"""


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGKILL") or os.name == "nt", reason="POSIX signals")
def test_a_validation_point_committed_before_a_sigkill_reaches_the_tracker_once_after_the_resume(
        tracking_server, tmp_path, reference):
    """A job killed (SIGKILL: no handler, no flush) after update 10 had committed the validation point at 8,
    which its last snapshot holds but its tracker thread never sent; the resumed job sends it, and the
    tracker run holds every validation point once, equal to the uninterrupted run. The history holds no
    learning rates and (under the update clock) no epoch end's update count: those records the killed job
    had not sent stay missing; every step logged is logged once, with the uninterrupted run's value."""
    here = Path(__file__).resolve().parent
    script = KILLED_SCRIPT.format(tests=str(here.parent), here=str(here), folder=str(tmp_path), uri=tracking_server,
                                  experiment=EXPERIMENT["killed"])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    resumed, model = _trainer([SnapshotCallback(tmp_path), MLflowCallback(tracking_server,
                               experiment=EXPERIMENT["killed"], close_timeout=60)], resume=True, running_id="killed")
    _fit(resumed)
    resumed.close()
    assert states_equal(weights(model), reference[0])
    logged = series(tracking_server, the_run(tracking_server, EXPERIMENT["killed"], "killed"))
    expected = _expected(reference[1], BUDGET, [6, 12, 15])
    val = {tag for tag in expected if tag.endswith("/val")}
    assert {tag: logged[tag] for tag in val} == {tag: expected[tag] for tag in val}
    assert logged["loss/val"] == list(zip([4, 8, 12, 15], reference[1]["val"]["loss"]))
    for tag in expected.keys() - val:  # each step once, with the uninterrupted run's value
        points = logged.get(tag, [])
        assert set(points) <= set(expected[tag]) and len({s for s, _ in points}) == len(points)
        assert set(expected[tag]) - set(points) <= {(s, v) for s, v in expected[tag] if s <= 9}, tag


@pytest.mark.slow
@pytest.mark.distributed
def test_under_ddp_only_rank_0_talks_to_the_tracker_and_one_run_holds_the_history(tracking_server, tmp_path,
                                                                                 monkeypatch):
    """Two gloo processes fit by updates with the same callback: rank 0 alone starts a tracker thread, the
    experiment holds one tracker run, and it holds the history's values at each step."""
    monkeypatch.setenv(D.URI_ENV, tracking_server)
    monkeypatch.setenv(D.EXPERIMENT_ENV, EXPERIMENT["ddp"])
    ranks = launched_ranks(D.main, D.OUT_ENV, tmp_path, seconds=300)
    assert [rank["worker"] for rank in ranks] == [True, False]
    assert ranks[0]["records"] == ranks[1]["records"] and ranks[0]["updates"] == 8
    found = client(tracking_server).get_experiment_by_name(EXPERIMENT["ddp"])
    assert len(client(tracking_server).search_runs([found.experiment_id])) == 1
    run = the_run(tracking_server, EXPERIMENT["ddp"], D.RUNNING_ID)
    assert ranks[0]["records"]["val"]["updates"] == [4, 8]
    # 48 samples a rank in batches of 16: 3 updates an epoch
    assert series(tracking_server, run) == _expected(ranks[0]["records"], 8, [3, 6, 8], D.schedule)
