"""`EMACallback` under DDP, two gloo processes on the CPU: each rank computes the average from its own
weights with no collective of its own, so the averages are equal on both ranks bit for bit, equal torch's
`AveragedModel` fed that rank's weights bit for bit, and equal a plain one-process loop with the whole
batch within float tolerance (the gradients' all-reduce sums in another order). `SWACallback`'s average,
BatchNorm statistics recomputed at the fit's end included, is equal on both ranks too."""

import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

TARGETS_DIR = Path(__file__).resolve().parent
if str(TARGETS_DIR) not in sys.path:
    sys.path.insert(0, str(TARGETS_DIR))

import averaging_targets as A  # noqa: E402  (needs the sys.path entry above)
import ddp_targets as T  # noqa: E402
from deadline import launch_scenarios  # noqa: E402

EXACT = 1e-5


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("averaging")
    launch_scenarios(A.run_scenarios, T.OUT_ENV, out, seconds=240)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _ema(model):
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(A.DECAY), use_buffers=True)


@pytest.mark.distributed
def test_the_ema_under_ddp_is_equal_on_both_ranks_and_equals_averaged_model_fed_the_ranks_weights(ranks):
    """Bit for bit: rank 0's average is rank 1's, and torch's AveragedModel moved by the weights the rank had
    after each update."""
    assert ranks[0]["world_size"] == 2
    for key, value in ranks[0]["average"].items():
        assert torch.equal(value, ranks[1]["average"][key]), key
    for rank in ranks:
        model = T.make_model()
        reference = _ema(model)
        for weights in rank["weights"]:
            with torch.no_grad():
                for p, w in zip(model.parameters(), weights):
                    p.copy_(w)
            reference.update_parameters(model)
        assert rank["updates"] == len(rank["weights"]) == 5 * T.EPOCHS
        for key, value in reference.state_dict().items():
            assert torch.equal(value, rank["average"][key]), key


@pytest.mark.distributed
def test_the_ema_under_ddp_equals_a_plain_loop_with_the_whole_batch(ranks):
    """One process, batch 2 * BATCH, AveragedModel after each step: the same average within float tolerance."""
    x, y = T.make_data(T.TRAIN_N, 1).tensors
    model = T.make_model()
    opt = T.make_optimizer(model)
    reference = _ema(model)
    for _ in range(T.EPOCHS):
        for start in range(0, T.TRAIN_N, 2 * T.BATCH):
            F.cross_entropy(model(x[start:start + 2 * T.BATCH]), y[start:start + 2 * T.BATCH]).backward()
            opt.step()
            opt.zero_grad()
            reference.update_parameters(model)
    for key, value in reference.state_dict().items():
        assert (value.double() - ranks[0]["average"][key].double()).abs().max() < EXACT, key


@pytest.mark.distributed
def test_the_swa_average_under_ddp_with_batchnorm_is_equal_on_both_ranks(ranks):
    """Epochs 2 and 3 averaged; after update_bn on each rank's shard every rank holds rank 0's statistics."""
    first, second = ranks[0]["swa"], ranks[1]["swa"]
    assert first["updates"] == second["updates"] == 2
    for key, value in first["average"].items():
        assert torch.equal(value, second["average"][key]), key
