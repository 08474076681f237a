"""At the DDP level: a failure on one rank at key states of the machine ends the whole
group promptly, and the caller of `launch` gets that rank's error with its flight record; nothing hangs."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

SCRIPT = """
import json, multiprocessing, sys
sys.path.insert(0, {here!r})
import fault_targets
from deepepochs.launch import launch
try:
    launch(fault_targets.fail_on_rank_1, num_processes=2)
    out = {{"error": None}}
except Exception as exc:
    out = {{"error": type(exc).__name__, "message": str(exc)}}
out["children_left"] = len(multiprocessing.active_children())
print(json.dumps(out))
"""


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("state", ["step_backward", "optimize_unscaled", "val_batch", "epoch_end"])
def test_a_failure_on_one_rank_ends_the_group_promptly(state):
    """Rank 1 fails inside a no-sync micro-batch, an update, validation or the epoch end; launch raises."""
    env = {**os.environ, "DEEPEPOCHS_TEST_FAULT_STATE": state, "CUDA_VISIBLE_DEVICES": ""}
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", SCRIPT.format(here=str(HERE))], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=180)
    elapsed = time.monotonic() - start
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["error"] == "DistributedError", out
    assert f"injected on rank 1 entering {state}" in out["message"]
    assert f"raised in state '{state}'" in out["message"]  # the failing rank's flight record
    assert out["children_left"] == 0
    assert elapsed < 150, f"took {elapsed:.0f} s"
