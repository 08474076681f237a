"""Preemption under DDP (issue 17, part 2): a SIGTERM that reaches one rank only stops every rank at the same
commit point; rank 0 writes one snapshot holding every rank's random states; `launch` raises `Preempted`;
the resumed 2-rank run ends as the uninterrupted 2-rank run."""

import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import preempt_targets  # noqa: E402
from deadline import launch_with_deadline  # noqa: E402

from deepepochs import Preempted  # noqa: E402
from deepepochs.checkpoint import read_checkpoint  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGTERM") or sys.platform == "win32", reason="POSIX signals")


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_signal_on_one_rank_stops_both_at_one_commit_point_and_the_resume_is_exact(tmp_path, monkeypatch, rank):
    reference = launch_with_deadline(preempt_targets.train, 120)
    monkeypatch.setenv(preempt_targets.FOLDER_ENV, str(tmp_path))
    monkeypatch.setenv(preempt_targets.SIGNAL_RANK_ENV, rank)
    with pytest.raises(Preempted) as info:
        launch_with_deadline(preempt_targets.train, 120)
    stop = info.value
    assert stop.code == 143 and stop.signal_name == "SIGTERM"
    # 96 samples, 2 ranks, batch 4: 12 batches per rank and epoch, windows of 2; the signal came after
    # batch 5 of epoch 2, so both ranks stopped after the window ending at batch 6.
    snap = read_checkpoint(stop.path)
    assert snap.epoch == 1 and snap.position["batches_done"] == 6 and snap.position["world_size"] == 2
    assert len(snap.position["random"]) == 2
    monkeypatch.delenv(preempt_targets.SIGNAL_RANK_ENV)
    resumed = launch_with_deadline(preempt_targets.train, 120)
    assert resumed["completed"] == 3
    assert resumed["weights"] == reference["weights"]
    last = {stage: {k: v[-1] for k, v in m.items()} for stage, m in resumed["records"].items()}
    assert last == {stage: {k: v[-1] for k, v in m.items()} for stage, m in reference["records"].items()}
