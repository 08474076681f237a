"""Under DDP, validation, test and prediction evaluate the model a run saves: rank 0's buffers (BatchNorm's
running statistics, which training leaves different on each rank), as a plain DDP loop that evaluates
through the `DistributedDataParallel` wrapper does. Two gloo processes on the CPU, one launch for every
check (`eval_buffers_targets.py`): a BatchNorm model with dropout, shuffled batches different on each rank,
2 epochs with validation, then test and predict."""

import sys
from pathlib import Path

import pytest
import torch
from state_compare import states_equal  # tests/, on sys.path under pytest
from torch.nn import functional as F

TARGETS_DIR = Path(__file__).resolve().parent
if str(TARGETS_DIR) not in sys.path:
    sys.path.insert(0, str(TARGETS_DIR))

import eval_buffers_targets as E  # noqa: E402  (needs the sys.path entry above)
from deadline import launched_ranks  # noqa: E402

pytestmark = pytest.mark.distributed
SUMMATION = 1e-6  # one whole-set evaluation against sums over batches and ranks: fp32 summation order


def _same_records(got: dict, want: dict) -> None:
    """Validation or test metrics equal: the loss bit for bit (both sum float64 products over batches and
    ranks), the accuracy within fp32 rounding (the Trainer merges it in fp32, the plain loop in float64)."""
    assert got.keys() == want.keys()
    assert got["loss"] == want["loss"]
    assert got["accuracy"] == pytest.approx(want["accuracy"], abs=SUMMATION)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What rank 0 and rank 1 recorded in `eval_buffers_targets.run_scenarios`."""
    return launched_ranks(E.run_scenarios, E.OUT_ENV, tmp_path_factory.mktemp("eval-buffers"))


def _whole_set(state: dict):
    """Rank 0's saved model evaluated on the whole validation set at once in this process: the logits, loss
    and accuracy."""
    model = E.make_model()
    model.load_state_dict(state)
    model.eval()
    x, y = E.val_data().tensors
    with torch.no_grad():
        logits = model(x)
    return logits, float(F.cross_entropy(logits, y)), float(E.accuracy(logits, y))


def test_ddp_training_and_validation_equal_a_plain_ddp_loop_that_evaluates_through_the_wrapper(ranks):
    """Every weight and buffer on each rank, and every validation loss and accuracy, bit for bit."""
    for rank in ranks:
        assert states_equal(rank["trainer"]["state"], rank["plain"]["state"])
        _same_records(rank["trainer"]["val"], rank["plain"]["val"])


def test_the_last_validation_and_test_evaluate_the_model_rank_0_saves(ranks):
    """Rank 0's final state evaluated on the whole validation set in one process gives the last validation
    metrics and the test metrics (within fp32 summation order), and the test equals the plain loop's."""
    _, loss, accuracy = _whole_set(ranks[0]["trainer"]["state"])
    for rank in ranks:
        run = rank["trainer"]
        assert run["val"]["loss"][-1] == pytest.approx(loss, rel=SUMMATION)
        assert run["val"]["accuracy"][-1] == pytest.approx(accuracy, abs=SUMMATION)
        assert run["test"]["loss"] == pytest.approx(loss, rel=SUMMATION)
        _same_records(run["test"], rank["plain"]["test"])


@pytest.mark.parametrize("scenario", ["trainer", "unvalidated"], ids=["after-validation", "without-validation"])
def test_test_and_predict_after_fit_evaluate_rank_0_saved_model(ranks, scenario):
    """test() and predict() after a fit with validation, and after one without (the ranks' statistics still
    their own when the test starts): the test metrics of rank 0's model on the whole set on every rank,
    and its outputs on every sample gathered on rank 0."""
    logits, loss, accuracy = _whole_set(ranks[0][scenario]["state"])
    for rank in ranks:
        assert rank[scenario]["test"]["loss"] == pytest.approx(loss, rel=SUMMATION)
        assert rank[scenario]["test"]["accuracy"] == pytest.approx(accuracy, abs=SUMMATION)
    assert ranks[1][scenario]["predict"] is None
    torch.testing.assert_close(ranks[0][scenario]["predict"], logits, rtol=SUMMATION, atol=SUMMATION)


def test_with_broadcast_buffers_false_each_rank_evaluates_its_own_buffers_as_ddp_does(ranks):
    """ddp_kwargs={'broadcast_buffers': False}: the plain loop's records and states, bit for bit; the ranks'
    BatchNorm statistics stay their own."""
    for rank in ranks:
        assert states_equal(rank["trainer_own"]["state"], rank["plain_own"]["state"])
        _same_records(rank["trainer_own"]["val"], rank["plain_own"]["val"])
    mean = "1.running_mean"
    assert not torch.equal(ranks[0]["trainer_own"]["state"][mean], ranks[1]["trainer_own"]["state"][mean])


def test_a_rollback_in_validation_and_after_it_ends_as_the_run_never_interrupted(ranks):
    """A fault at the first validation batch of epoch 1 and one before epoch 2's first training batch, each
    followed by a refit: every weight and buffer on each rank and every validation record, bit for bit."""
    for rank in ranks:
        assert states_equal(rank["rollback"]["state"], rank["trainer"]["state"])
        assert rank["rollback"]["val"] == rank["trainer"]["val"]


def test_a_test_of_several_batches_costs_one_broadcast_and_none_without_broadcast_buffers(ranks):
    """trainer.test() over 4 batches per rank: one broadcast (the buffers' bytes) on each rank; none with
    ddp_kwargs={'broadcast_buffers': False}."""
    for rank in ranks:
        assert rank["trainer"]["test_broadcasts"] == [torch.uint8]
        assert rank["trainer_own"]["test_broadcasts"] == []

