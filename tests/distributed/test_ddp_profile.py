"""ProfileCallback under DDP: each rank's table is its own, rank 0 writes one trace with a process track
per rank, and the straggler line names the rank the others waited for (two gloo processes on the CPU,
`profile_targets.py`)."""

import json
import sys
from pathlib import Path

import pytest
from trace_events import nested  # tests/, on sys.path under pytest

TARGETS_DIR = Path(__file__).resolve().parent
if str(TARGETS_DIR) not in sys.path:
    sys.path.insert(0, str(TARGETS_DIR))

import profile_targets as P  # noqa: E402  (needs the sys.path entry above)
from deadline import launched_ranks  # noqa: E402

pytestmark = pytest.mark.distributed


def test_each_rank_profiles_itself_and_rank_0_writes_one_trace_with_a_track_per_rank(tmp_path):
    """Rank 1's sleeping dataset shows in its own table (data) and not in rank 0's; the one trace file holds
    both ranks' events, each loop track nested run > epoch > update > visit > part > torch's operator, and
    each rank's operators of its profiled updates (read back when the run stopped) under its forward states."""
    out = tmp_path / "run"
    out.mkdir()
    ranks = launched_ranks(P.run_profiled, P.OUT_ENV, out)
    fetch = [sum(r["seconds"] for r in rank["table"] if r["state"] == "task_train/fetch") for rank in ranks]
    assert fetch[1] >= 2 * 16 * P.SLEEP / 2  # rank 1 waited for its 8 items per epoch, twice
    assert fetch[0] < fetch[1] / 4
    assert ranks[0]["trace_path"] == out / "profile.json" and ranks[1]["trace_path"] is None
    assert not list(out.glob("profile.rank*.json"))
    document = json.loads((out / "profile.json").read_text())
    events = [e for e in document["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1}
    for pid in (0, 1):
        track = [e for e in events if e["pid"] == pid and e["tid"] == 0]  # the loop's thread, operators included
        assert nested(track)
        assert sum(e["cat"] == "run" for e in track) == 1
        forwards = [e for e in track if e["name"] == "forward"]
        ops = [e for e in track if e["name"] == "aten::addmm"]
        assert len(ops) == 2  # one per profiled update: 3 and 4, the run's last (2 epochs of 2 batches per rank)
        assert all(any(f["ts"] <= op["ts"] and op["ts"] + op["dur"] <= f["ts"] + f["dur"] for f in forwards)
                   for op in ops)
    assert [r["rank"] for r in document["otherData"]["ranks"]] == [0, 1]
    # both ranks name rank 1, which read slowly, as the one the gradient synchronisations waited for
    for rank in ranks:
        assert rank["straggler"].startswith("straggler: rank 1 arrived last at ")
        assert "of the last 4 gradient synchronisations" in rank["straggler"]
        assert rank["straggler"] in rank["summary"]
