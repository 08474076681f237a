"""The update clock under DDP (two gloo processes): every rank stops at the same update and validates at
the same points, and an IterableDataset that runs dry on one rank first ends the epoch on every rank (no
rank waits in a collective); the epochs then go on to the update budget."""

import sys
from pathlib import Path

import pytest
import torch

TARGETS_DIR = Path(__file__).resolve().parent
if str(TARGETS_DIR) not in sys.path:
    sys.path.insert(0, str(TARGETS_DIR))

import clock_targets as C  # noqa: E402  (needs the sys.path entry above)
from deadline import launch_scenarios  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_clock")
    launch_scenarios(C.main, C.OUT_ENV, out, seconds=240)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.distributed
def test_every_rank_stops_at_the_budget_and_validates_at_the_same_points(ranks):
    """Streams of 7 and 5 batches: each epoch ends after 5 updates on both ranks (the shorter stream), the
    budget of 12 ends epoch 3 after 2; validation points at 4, 8 and 12 on both ranks, with the same
    records and weights."""
    for rank in ranks:
        assert rank["updates"] == 12 and rank["epochs"] == 3
        assert rank["points"] == [4, 8, 12] and rank["epoch_ends"] == [5, 10, 12]
        assert rank["records"]["val"]["updates"] == [4, 8, 12]
    assert ranks[0]["records"] == ranks[1]["records"]
    for name, value in ranks[0]["state"].items():
        assert torch.equal(value, ranks[1]["state"][name]), name
