"""Under DDP (two gloo processes on the CPU), a custom step with its own backward trains as one process with
the whole batch: `loss.backward()` then `self.optimize()` (k=1), and `self.backward(loss)` under accumulation
(k=2, with a short last window), whose gradients are all-reduced on each window's last micro-batch only.
Reference: test_ddp's plain PyTorch loop with batch 2 * BATCH."""

import ddp_targets as T  # the distributed tests' folder is on sys.path (pytest's rootdir-less import)
import own_backward_targets as O
import pytest
from deadline import launched_ranks
from test_ddp import EXACT, plain_reference


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return launched_ranks(O.run, O.OUT_ENV, tmp_path_factory.mktemp("own_backward_ddp"))


@pytest.mark.distributed
@pytest.mark.parametrize(("scenario", "k", "syncs"), [("own", 1, 5 * T.EPOCHS), ("managed", 2, 3 * T.EPOCHS)])
def test_a_custom_backward_under_ddp_equals_one_process_with_the_whole_batch(ranks, scenario, k, syncs):
    """Both ranks end with the plain one-process loop's weights (batch 2 * BATCH); 5 batches per epoch, so
    k=1 all-reduces 5 times an epoch and k=2 (windows 2+2+1) 3 times."""
    reference = plain_reference(k)
    for rank in ranks:
        assert T.max_diff(rank[scenario]["state"], reference) < EXACT
        assert rank[scenario]["syncs"] == syncs
    assert T.max_diff(ranks[0][scenario]["state"], ranks[1][scenario]["state"]) == 0.0
