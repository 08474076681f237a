"""DDP liveness: a hung rank ends the group after `dist_timeout` with a
`DistributedError` naming what timed out (launch and torchrun), and training data without a length
whose shards differ ends every rank's epoch at the shortest shard instead of hanging."""

import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from deepepochs import ConfigError, Trainer
from deepepochs.errors import DistributedError

TARGETS_DIR = Path(__file__).resolve().parent
if str(TARGETS_DIR) not in sys.path:
    sys.path.insert(0, str(TARGETS_DIR))

import liveness_targets as T  # noqa: E402  (needs the sys.path entry above)
from deadline import launch_with_deadline  # noqa: E402  (same sys.path entry)

REPO = TARGETS_DIR.parents[1]
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def clean_env(monkeypatch):
    for name in TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.mark.parametrize("value", [0, -5, "600", True, float("inf")])
def test_dist_timeout_must_be_a_positive_number_of_seconds(value):
    model = nn.Linear(2, 1)
    with pytest.raises(ConfigError, match=r"dist_timeout must be a positive number of seconds"):
        Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), dist_timeout=value)


@pytest.mark.distributed
def test_a_hung_rank_ends_a_launched_run_with_a_distributed_error_naming_the_timeout(clean_env, capsys):
    """Rank 1 sleeps in a callback; rank 0's gradient all-reduce times out after dist_timeout=3 s and the
    caller gets DistributedError naming rank 0, the timeout, where it waited and who waits for whom (launch
    prints that sentence once); nothing is left running."""
    start = time.monotonic()
    with pytest.raises(DistributedError) as info:
        launch_with_deadline(T.hang_on_rank_1, seconds=90)
    message = str(info.value)
    assert "rank 0 of 2: a collective timed out after 3 s (Trainer(dist_timeout=...))" in message
    assert "in state" in message and "batch 2" in message
    assert "rank 1 is in training (stage 'train', epoch 1, batch 2, in callback _SleepOnRank1" in message
    assert "rank 0 waits in the DDP forward sync of update 2" in message  # DDP rebuilds its buckets there
    assert capsys.readouterr().err.count("launch: rank 0 of 2: a collective timed out after 3 s") == 1
    assert time.monotonic() - start < 60
    assert not multiprocessing.active_children()


_TORCHRUN_HANG = textwrap.dedent(
    """
    import sys
    sys.path.insert(0, "tests/distributed")
    import liveness_targets
    liveness_targets.hang_on_rank_1()
    """
)


@pytest.mark.distributed
def test_a_hung_rank_ends_a_torchrun_run_with_a_distributed_error(tmp_path, clean_env):
    """The same under torchrun: rank 0 fails with the DistributedError, torchrun stops rank 1 and exits
    non-zero well before the 120 s rank 1 would sleep."""
    script = tmp_path / "hang.py"
    script.write_text(_TORCHRUN_HANG)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
         "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", str(script)],
        cwd=REPO, capture_output=True, text=True, timeout=100, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert "DistributedError" in output and "a collective timed out after 3 s" in output, output[-3000:]
    assert time.monotonic() - start < 80


@pytest.mark.distributed
def test_length_less_shards_of_different_lengths_end_every_epoch_at_the_shortest(tmp_path, monkeypatch, clean_env):
    """Shards of 10 and 7 batches without a length: both ranks train 7 batches per epoch (no hang), the
    longer rank warns, and the weights equal a plain loop over the 7 pairs of batches taken together
    (DDP's mean of the two ranks' mean gradients = the gradient of the pair's mean loss)."""
    monkeypatch.setenv(T.OUT_ENV, str(tmp_path))
    launch_with_deadline(T.uneven_iterable_shards, seconds=120)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    torch.manual_seed(0)
    model = nn.Linear(T.FEATURES, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    shards = [T.make_batches(0), T.make_batches(1)]
    n = min(T.SHARD_BATCHES)
    for _ in range(2):
        for i in range(n):
            x = torch.cat([shards[0][i][0], shards[1][i][0]])
            y = torch.cat([shards[0][i][1], shards[1][i][1]])
            F.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    for rank in ranks:
        assert rank["batches_per_epoch"] == [n, n]
        for name, value in model.state_dict().items():
            assert torch.allclose(rank["weights"][name], value, atol=1e-6), name
    assert len(ranks[0]["warnings"]) == 1 and "after 7 batches" in ranks[0]["warnings"][0]
    assert ranks[1]["warnings"] == []
