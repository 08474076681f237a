"""Ranks whose paths through the loop part raise `DesyncError` naming the first transition where they part,
within `dist_timeout`, instead of hanging or meeting in collectives that do not match (gloo then aborts the
process): a stop requested on one rank only, and one rank with a validation batch more while a metric issues a
collective per batch. Two processes on gloo under `launch`; the comparison itself is checked on paths built
by hand."""

import json
import multiprocessing
import sys
from pathlib import Path

import pytest

from deepepochs import DesyncError, DistributedError
from deepepochs.parallel.path_compare import cold_paths, parting

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import desync_targets as T  # noqa: E402  (needs the sys.path entry above)
from deadline import launch_scenarios  # noqa: E402  (same sys.path entry)


def _launched(scenario: str, out: Path, monkeypatch, processes: int = 2) -> dict:
    """Run `scenario` in `processes` processes; what each rank wrote, by rank. Nothing may be left running."""
    monkeypatch.setenv(T.SCENARIO_ENV, scenario)
    launch_scenarios(T.desynced_fit, T.OUT_ENV, out, seconds=120, num_processes=processes)
    assert not multiprocessing.active_children()
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in range(processes)}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("processes", [2, 3])
def test_a_stop_requested_on_one_rank_only_raises_desync_errors_naming_the_next_epoch_edge(tmp_path, monkeypatch,
                                                                                           processes):
    """Rank 1 alone requests a stop at the first epoch's end: it waits at the fit's end while the others wait in
    the next epoch's gradient all-reduce; every rank raises DesyncError within dist_timeout naming the next_epoch
    edge each rank took, and where each waits."""
    seen = _launched("stop", tmp_path, monkeypatch, processes)
    going = "rank 0" if processes == 2 else "ranks 0, 2"
    parted = (f"the ranks' paths parted: at transition 4 since the ranks last agreed, {going} took fit_running"
              " --next_epoch--> epoch_running (epoch 2); rank 1 took fit_running --next_epoch--> fit_done (epoch 1)")
    waiting = "rank 0 waits" if processes == 2 else "ranks 0, 2 wait"
    for rank in range(processes):
        assert seen[rank]["error"] == "DesyncError", seen[rank]
        assert "DistributedError" in seen[rank]["classes"]
        assert parted in seen[rank]["message"]
        assert seen[rank]["seconds"] < 6 * T.TIMEOUT_S  # the fit itself takes a few seconds on a loaded machine
        ranks = seen[rank]["ranks"]
        for going_rank in {0, processes - 1} - {1}:
            assert ranks[str(going_rank)]["state"] == "step_backward" and ranks[str(going_rank)]["stage"] == "train"
            assert ranks[str(going_rank)]["epoch"] == 2 and ranks[str(going_rank)]["stop"] is None
        assert ranks["1"]["state"] == "fit_done" and ranks["1"]["stage"] is None and ranks["1"]["epoch"] == 1
        assert ranks["1"]["stop"] == "rank 1's own patience ran out"
    # The others raise as their collective times out, or fails as a peer that raised first closes its connection.
    assert "a collective timed out after 5 s" in seen[0]["message"] or "connection ended" in seen[0]["message"]
    assert "the ranks did not all reach the end of the fit within 5 s" in seen[1]["message"]
    assert (f"{waiting} in the gradient all-reduce of update 7; rank 1 waits in the path agreement at the end of the"
            " fit") in seen[1]["message"]


@pytest.mark.distributed
@pytest.mark.slow
def test_a_longer_validation_shard_with_a_synchronising_metric_raises_desync_errors(tmp_path, monkeypatch):
    """Rank 0 has 3 validation batches, rank 1 has 2, and the metric all-reduces per batch: rank 1 waits at the
    validation task's end (issuing no collective its peer's metric could meet) and rank 0 in its third batch's
    all-reduce; both raise DesyncError naming rank 0's third validation batch against rank 1's task end."""
    seen = _launched("val_longer", tmp_path, monkeypatch)
    parted = ("at transition 9 since the ranks last agreed, rank 0 took task_val --begin_batch--> val_batch (epoch 1,"
              " batch 3); rank 1 waits at the end of validation task 1 of epoch 1, after epoch 1, batch 2")
    for rank in (0, 1):
        assert seen[rank]["error"] == "DesyncError", seen[rank]
        assert parted in seen[rank]["message"]
        assert seen[rank]["seconds"] < 6 * T.TIMEOUT_S
        ranks = seen[rank]["ranks"]
        assert ranks["0"]["state"] == "val_batch" and ranks["0"]["stage"] == "val" and ranks["0"]["batch"] == 3
        assert ranks["0"]["collective"].startswith("all_reduce")
        assert ranks["1"]["state"] == "task_val" and ranks["1"]["batch"] == 2
        assert ranks["1"]["collective"] == "path agreement at the end of validation task 1 of epoch 1"


def _path(entries, waiting_at=None, count=None, cold=()):
    return {"entries": [list(e) for e in entries], "cold": [list(e) for e in cold], "waiting_at": waiting_at,
            "count": len(entries) if count is None else count}


def test_paths_that_agree_as_far_as_known_do_not_part_and_a_rank_behind_is_not_apart():
    """Rank 1 is two transitions behind rank 0 on the same path: no parting (it is slow, not apart)."""
    walk = [(i, 1, i + 1, "task_train", "window_step", "task_train") for i in range(5)]
    assert parting({0: _path(walk), 1: _path(walk[:3]), 2: None}) is None


def test_the_first_transition_taken_differently_is_named_with_every_group_of_ranks():
    """Three ranks: two take the next epoch, one stops; the sentence groups ranks 0 and 2."""
    common = [(0, 1, 2, "task_val", "end_task", "stage_val")]
    go = _path([*common, (1, 2, 2, "fit_running", "next_epoch", "epoch_running")])
    stop = _path([*common, (1, 1, 2, "fit_running", "next_epoch", "fit_done")])
    assert parting({0: go, 1: stop, 2: go}) == (
        "at transition 2 since the ranks last agreed, ranks 0, 2 took fit_running --next_epoch--> epoch_running"
        " (epoch 2); rank 1 took fit_running --next_epoch--> fit_done (epoch 1)")


def test_a_rank_waiting_at_a_point_where_a_peer_took_a_transition_has_parted():
    """Rank 1 waits at the task's end where rank 0 took another batch; records scrolled out of a flight record
    (indices below its first) are unknown, not different."""
    batches = [(i, 1, i + 1, "task_val", "begin_batch", "val_batch") for i in range(4, 7)]
    waits = _path(batches[:2], waiting_at="the end of validation task 1 of epoch 1", count=6)
    assert parting({0: _path(batches, count=7), 1: waits}) == (
        "at transition 7 since the ranks last agreed, rank 0 took task_val --begin_batch--> val_batch (epoch 1, batch"
        " 7); rank 1 waits at the end of validation task 1 of epoch 1, after epoch 1, batch 6")


def test_at_an_agreement_point_only_cold_transitions_and_the_points_are_compared():
    """A longer evaluation shard adds hot transitions only: the cold paths agree; ranks at different points
    (the end of a validation task and the end of the fit) part at the point itself."""
    cold = [(0, 1, 2, "task_val", "end_task", "stage_val")]
    rank0 = _path([(n, 1, n, "task_val", "begin_batch", "val_batch") for n in range(9)], "the end of A", cold=cold)
    rank1 = _path([(n, 1, n, "task_val", "begin_batch", "val_batch") for n in range(5)], "the end of A", cold=cold)
    assert parting(cold_paths({0: rank0, 1: rank1})) is None
    rank1["waiting_at"] = "the end of the fit"
    assert parting(cold_paths({0: rank0, 1: rank1})) == (
        "at transition 2 since the ranks last agreed, rank 0 waits at the end of A, after epoch 1, batch 2; rank 1"
        " waits at the end of the fit, after epoch 1, batch 2")


def test_desync_error_is_a_distributed_error_exported_at_the_top_level():
    """`except DistributedError` catches it; `deepepochs.DesyncError` names it."""
    assert issubclass(DesyncError, DistributedError)
