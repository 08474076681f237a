"""Resuming from a best file of a validation point inside an epoch under DDP (two gloo processes): the file
holds both ranks' positions, and the resumed 2-rank run ends as the uninterrupted 2-rank run."""

import sys
from pathlib import Path

import pytest
import torch

TARGETS_DIR = Path(__file__).resolve().parent
if str(TARGETS_DIR) not in sys.path:
    sys.path.insert(0, str(TARGETS_DIR))

import check_resume_targets as C  # noqa: E402  (needs the sys.path entry above)
from deadline import launch_scenarios  # noqa: E402
from state_compare import states_equal  # noqa: E402

from deepepochs.checkpoint import read_checkpoint  # noqa: E402


@pytest.mark.distributed
def test_a_resume_from_a_mid_epoch_best_file_under_ddp_ends_as_the_run_never_stopped(tmp_path, monkeypatch):
    """The best file of the point at update 10 (inside epoch 1) records both ranks' position; resumed with
    resume=True, every rank ends with the uninterrupted run's tensors and records."""
    launch_scenarios(C.main, C.OUT_ENV, tmp_path, seconds=240)
    ckpt = read_checkpoint(tmp_path / "kept" / "run" / "val-loss.ckpt")
    assert ckpt.updates == 10 and ckpt.position["batches_done"] == 10 and len(ckpt.position["ranks"]) == 2
    monkeypatch.setenv(C.RESUME_ENV, "1")
    launch_scenarios(C.main, C.OUT_ENV, tmp_path, seconds=240)
    for rank in range(2):
        want = torch.load(tmp_path / f"uninterrupted-rank{rank}.pt", weights_only=False)
        got = torch.load(tmp_path / f"resumed-rank{rank}.pt", weights_only=False)
        assert got["records"] == want["records"]
        assert states_equal(got["state"], want["state"]), rank
