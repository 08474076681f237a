"""When a distributed job stalls, every rank's error names every rank's place: start-up bounded by
`dist_timeout` naming the ranks that did not arrive, and a collective that fails naming who waits for whom,
a dead rank as dead. Two torchrun-style processes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) on gloo."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from deepepochs.errors import DistributedError
from deepepochs.parallel.rendezvous import environment_source
from deepepochs.parallel.stall_report import rank_entry, stall_error

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import stall_targets as T  # noqa: E402  (needs the sys.path entry above)
from deadline import TORCHRUN_VARIABLES, launch_with_deadline  # noqa: E402  (same sys.path entry)

RUN = "import sys; sys.path.insert(0, {here!r}); import stall_targets; stall_targets.run_rank()"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(scenario: str, out: Path, ranks=(0, 1), seconds: float = 150) -> dict:
    """Start `ranks` of a 2-process job as torchrun would (its variables, no launcher), wait for them (killing
    any left after `seconds`, which fails the test) and return what each wrote: its error, and the seconds
    from its fit's start to its end."""
    port = _free_port()
    procs = []
    start = time.monotonic()
    for rank in ranks:
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), T.OUT_ENV: str(out),
               T.SCENARIO_ENV: scenario, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        procs.append(subprocess.Popen([sys.executable, "-c", RUN.format(here=str(HERE))], cwd=REPO, env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    left = []
    for proc in procs:
        try:
            proc.wait(max(seconds - (time.monotonic() - start), 1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            left.append(proc.pid)
    assert not left, f"processes {left} still ran after {seconds} s"
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in ranks
            if (out / f"rank{r}.json").exists()}


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_asleep_in_a_training_callback_is_named_by_the_rank_waiting_in_the_gradient_all_reduce(tmp_path):
    """Rank 1 sleeps in on_before_train_batch at batch 3: rank 0 raises after dist_timeout, naming rank 1's
    callback and place and itself waiting in the gradient all-reduce; rank 1, waking later, names rank 0 dead."""
    seen = run_ranks("train_callback", tmp_path)
    first, second = seen[0], seen[1]
    assert first["error"] == "DistributedError"
    assert ("rank 1 is in training (stage 'train', epoch 1, batch 3, in callback _Stall.on_before_train_batch"
            in first["message"])
    assert "rank 0 waits in the gradient all-reduce of update 3" in first["message"]
    assert first["seconds"] < 8 * T.TIMEOUT_S
    ranks = first["ranks"]
    assert set(ranks["1"]) >= {"state", "stage", "epoch", "update", "batch", "collective", "seconds_since_heartbeat"}
    assert ranks["1"]["stage"] == "train" and ranks["1"]["batch"] == 3 and ranks["1"]["collective"] is None
    assert ranks["1"]["alive"] is True and ranks["1"]["seconds_since_heartbeat"] < 5
    assert ranks["0"]["collective"] == "gradient all-reduce" and ranks["0"]["update"] == 3
    assert second["error"] == "DistributedError" and "rank 0 is dead" in second["message"]
    assert second["ranks"]["0"]["alive"] is False


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_asleep_in_a_validation_callback_is_named_in_validation(tmp_path):
    """Rank 1 sleeps in a validation batch's callback; rank 0 waits at the end of validation in a
    collective and its error says rank 1 is in validation (stage 'val', batch 2)."""
    seen = run_ranks("val_callback", tmp_path)
    first = seen[0]
    assert first["error"] == "DistributedError", first
    assert "rank 1 is in validation (stage 'val', epoch 1, batch 2, in callback _Stall.on_before_val_batch" in (
        first["message"])
    assert "rank 0 waits in the " in first["message"]
    assert first["ranks"]["0"]["stage"] == "val" and first["ranks"]["0"]["collective"]
    assert first["ranks"]["1"]["stage"] == "val" and first["ranks"]["1"]["alive"] is True
    assert first["seconds"] < 8 * T.TIMEOUT_S


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_killed_mid_epoch_is_named_dead_not_slow(tmp_path):
    """Rank 1 is killed (SIGKILL) at training batch 3: rank 0's gradient all-reduce fails at once, and its
    error names rank 1 dead with the place it was last seen in, well within dist_timeout."""
    seen = run_ranks("sigkill", tmp_path)
    assert 1 not in seen  # it died without a word
    first = seen[0]
    assert first["error"] == "DistributedError", first
    assert "rank 1 is dead" in first["message"] and "is in training" not in first["message"]
    assert first["ranks"]["1"]["alive"] is False
    assert "rank 0 waits in the gradient all-reduce of update 3" in first["message"]
    assert first["seconds"] < 8 * T.TIMEOUT_S


@pytest.mark.distributed
def test_a_rank_that_never_starts_ends_the_start_up_after_dist_timeout_naming_it(tmp_path):
    """WORLD_SIZE=2 with only rank 0 started: its Trainer raises after dist_timeout (not torch's 30
    minutes), naming rank 1 missing, the world size, the master address and where they came from."""
    seen = run_ranks("train_callback", tmp_path, ranks=(0,))
    message = seen[0]["message"]
    assert "missing rank(s): 1; world size 2, master 127.0.0.1:" in message
    assert "from the environment variables RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT" in message
    assert seen[0]["seconds"] < T.TIMEOUT_S + 20  # a loaded machine; torch alone waited 1,800 s


@pytest.mark.distributed
@pytest.mark.slow
def test_a_rank_that_joins_too_late_under_launch_is_named_with_launch_as_the_source(monkeypatch):
    """Under launch, rank 1 sleeps before building its Trainer: rank 0's start-up ends after dist_timeout
    naming rank 1 and deepepochs.launch; launch stops rank 1 and raises (how soon: the torchrun-style test
    measures it inside the rank, where spawning and imports do not count)."""
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(T.SCENARIO_ENV, "late")
    with pytest.raises(DistributedError) as info:
        launch_with_deadline(T.stalled_fit, seconds=150)  # spawning and importing: slow on a loaded machine
    message = str(info.value)
    assert "missing rank(s): 1; world size 2, master 127.0.0.1:" in message
    assert "from deepepochs.launch" in message


@pytest.mark.distributed
def test_a_clean_run_beats_during_the_fit_stops_at_close_and_equals_a_plain_loop(tmp_path):
    """Nobody stalls: each rank's heartbeat thread runs during the fit and is gone after close, and the
    weights equal a plain PyTorch loop bit for bit (both ranks train on the same batches: DDP's mean of two
    equal gradients is that gradient exactly)."""
    seen = run_ranks("clean", tmp_path)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(6)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        for x, y in data:
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    for rank in (0, 1):
        assert seen[rank]["error"] is None, seen[rank]
        assert seen[rank]["beating_in_fit"] == [f"deepepochs-heartbeat-{rank}"]
        assert seen[rank]["beating_after_close"] == []
        for name, value in model.state_dict().items():
            assert torch.equal(torch.tensor(seen[rank]["weights"][name]), value), name


@pytest.mark.parametrize(("environ", "source"), [
    ({"DEEPEPOCHS_LAUNCHED": "1", "RANK": "1"}, "deepepochs.launch"),
    ({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "RANK": "1"}, "SLURM's task variables"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "1"}, "torchrun"),
    ({"RANK": "1"}, "the environment variables RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"),
])
def test_a_start_up_error_says_where_the_job_variables_came_from(environ, source):
    """launch's mark, SLURM's task variables (RANK equal to SLURM_PROCID), torchrun's run id, or none."""
    assert environment_source(environ).startswith(source)


def test_the_stall_sentence_names_the_dead_the_slow_and_the_waiting():
    """Three ranks' records: the sentence names rank 2 dead, rank 1 in validation since 21 s and ranks 0 and 3
    waiting in one collective; `.ranks` carries the entries."""
    now = 1000.0
    waiting = {"state": "step_backward", "stage": "train", "epoch": 2, "update": 18, "batch": 5,
               "collective": "gradient all-reduce", "time": now - 0.5, "since": now - 20}
    records = {0: waiting, 3: waiting,
               1: {"state": "val_batch", "stage": "val", "epoch": 2, "update": 17, "batch": 3, "collective": None,
                   "callback": "Slow.on_val_batch", "time": now - 0.2, "since": now - 21},
               2: {"state": "step_forward", "stage": "train", "epoch": 2, "update": 18, "batch": 5,
                   "collective": None, "time": now - 9, "since": now - 12}}
    ranks = {r: rank_entry(records[r], r != 2, now) for r in range(4)}
    error = stall_error(0, 4, "a collective timed out after 20 s", ranks, "gloo timed out")
    assert ("rank 1 is in validation (stage 'val', epoch 2, batch 3, in callback Slow.on_val_batch, state"
            " 'val_batch') since 21 s") in str(error)
    assert "rank 2 is dead (its process ended; last seen in training (stage 'train'" in str(error)
    assert "ranks 0, 3 wait in the gradient all-reduce of update 18" in str(error)
    assert error.ranks[2]["seconds_since_heartbeat"] == 9.0 and error.ranks[1]["alive"] is True
