"""Under DDP a DataLoader over a sampler with replacement (each rank its own, seeded by the rank) keeps its
own order on every rank, and a SIGTERM at a random update on one rank, then a resume of the 2-rank job, ends
with every model, optimizer and scheduler value and every record of the 2-rank job never stopped."""

import random
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import stream_resume_targets as targets  # noqa: E402
from deadline import launch_with_deadline  # noqa: E402

from deepepochs import Preempted  # noqa: E402
from deepepochs.checkpoint import read_checkpoint  # noqa: E402

pytestmark = [pytest.mark.distributed,
              pytest.mark.skipif(not hasattr(signal, "SIGTERM") or sys.platform == "win32", reason="POSIX signals")]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_sigterm_on_one_rank_at_a_random_update_then_a_resume_ends_as_the_job_never_stopped(tmp_path, monkeypatch,
                                                                                             rank):
    """8 batches a rank and epoch, windows of 2; the signal after a random batch inside epoch 2: both ranks stop
    at one commit point, and the resumed job continues epoch 2 on each rank's own sampler."""
    reference = launch_with_deadline(targets.train, 180)
    at = 8 + random.Random(rank).randrange(2, 7)
    monkeypatch.setenv(targets.FOLDER_ENV, str(tmp_path))
    monkeypatch.setenv(targets.SIGNAL_RANK_ENV, rank)
    monkeypatch.setenv(targets.AT_ENV, str(at))
    with pytest.raises(Preempted) as info:
        launch_with_deadline(targets.train, 180)
    snapshot = read_checkpoint(info.value.path)
    assert snapshot.epoch == 1 and 0 < snapshot.position["batches_done"] < 8
    assert len(snapshot.rng["ranks"]) == 2 and all(len(r["loaders"]) == 1 for r in snapshot.rng["ranks"])
    monkeypatch.delenv(targets.SIGNAL_RANK_ENV)
    resumed = launch_with_deadline(targets.train, 180)
    assert resumed["completed"] == 3
    assert resumed["states"] == reference["states"]
    assert resumed["records"] == reference["records"]
