"""Preemption under DDP: a SIGTERM that reaches one rank only stops every rank at the same
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
from deepepochs.errors import DeepEpochsWarning  # noqa: E402

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
    # batch 5 of epoch 2, inside the window of batches 5 and 6: the rest of that window is dropped (no batch
    # is fetched once a signal arrived), so both ranks stopped at the commit point after batch 4.
    snap = read_checkpoint(stop.path)
    assert snap.epoch == 1 and snap.position["batches_done"] == 4 and snap.position["world_size"] == 2
    assert len(snap.position["ranks"]) == 2 and snap.position["samples_done"] == 4 * 4 * 2
    monkeypatch.delenv(preempt_targets.SIGNAL_RANK_ENV)
    resumed = launch_with_deadline(preempt_targets.train, 120)
    assert resumed["completed"] == 3
    assert resumed["weights"] == reference["weights"]
    # the whole run (epoch 1 from the snapshot): the resumed epoch's metrics cover both ranks' batches before
    # the snapshot too
    assert resumed["records"] == reference["records"]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_signal_at_an_epochs_end_leaves_an_epoch_end_snapshot_whose_resume_is_exact(tmp_path, monkeypatch, rank):
    """The signal reaches one rank in its epoch-end hooks: both ranks stop at the epoch's commit point, whose
    file has no mid-epoch position but every rank's generator states (dropout on each rank), and the resumed
    2-rank run ends as the uninterrupted one: the same weights and records."""
    reference = launch_with_deadline(preempt_targets.train, 120)
    monkeypatch.setenv(preempt_targets.FOLDER_ENV, str(tmp_path))
    monkeypatch.setenv(preempt_targets.SIGNAL_RANK_ENV, rank)
    monkeypatch.setenv(preempt_targets.SIGNAL_AT_ENV, "epoch_end")
    with pytest.raises(Preempted) as info:
        launch_with_deadline(preempt_targets.train, 120)
    snap = read_checkpoint(info.value.path)
    assert snap.epoch == 1 and snap.position is None and snap.world_size == 2
    assert len(snap.rng["ranks"]) == 2  # each rank's generators
    monkeypatch.delenv(preempt_targets.SIGNAL_RANK_ENV)
    resumed = launch_with_deadline(preempt_targets.train, 120)
    assert resumed["completed"] == 3
    assert resumed["weights"] == reference["weights"]
    assert resumed["records"] == reference["records"]


def _close(a, b, tol=1e-5):
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    return abs(a - b) <= tol


@pytest.mark.parametrize("saved, resumed_on", [(2, 1), (1, 2)])
def test_a_snapshot_resumes_on_another_world_size_with_the_same_global_batch(tmp_path, monkeypatch, saved,
                                                                            resumed_on):
    """2 ranks x batch 4 and 1 process x batch 8 see the same global batches: a snapshot of one continues on
    the other and ends as the uninterrupted run there, within 1e-5 (no dropout: the generators are
    re-derived, with a warning, when the world size changes)."""

    def run(world):
        monkeypatch.setenv(preempt_targets.BATCH_ENV, str(8 // world))
        return launch_with_deadline(preempt_targets.train, 120) if world == 2 else preempt_targets.train()

    monkeypatch.setenv(preempt_targets.DROPOUT_ENV, "0")
    reference = run(resumed_on)
    monkeypatch.setenv(preempt_targets.FOLDER_ENV, str(tmp_path))
    monkeypatch.setenv(preempt_targets.SIGNAL_RANK_ENV, "0")
    with pytest.raises(Preempted) as info:
        run(saved)
    # 4 global batches of 8: the signal after the 5th dropped the rest of its window of 2
    assert read_checkpoint(info.value.path).position["samples_done"] == 4 * 8
    monkeypatch.delenv(preempt_targets.SIGNAL_RANK_ENV)
    if resumed_on == 1:
        with pytest.warns(DeepEpochsWarning, match="random generators are re-derived"):
            resumed = run(resumed_on)
    else:
        resumed = run(resumed_on)
    assert resumed["completed"] == 3
    for name, values in reference["weights"].items():
        assert _close(resumed["weights"][name], values), name
    for stage, metrics in reference["records"].items():
        for name, values in metrics.items():
            assert _close(resumed["records"][stage][name], values, 1e-5), (stage, name)
