"""Weight averages under `Trainer(strategy='fsdp')`, two gloo processes on the CPU: the average is sharded like
the parameters (each rank holds its shard of every averaged tensor), equals torch's `AveragedModel` in a plain
one-process loop with the whole batch within 1e-6, is written with the sharded checkpoint (consolidated into
full tensors, loaded back from the folder and from the consolidated file), resumes exactly from a mid-epoch
snapshot, and is what `test()` and `predict()` evaluate on request, the model's own weights coming back."""

import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.fsdp
from torch.nn import functional as F
from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn

TARGETS_DIR = Path(__file__).resolve().parent
if str(TARGETS_DIR) not in sys.path:
    sys.path.insert(0, str(TARGETS_DIR))

if not hasattr(torch.distributed.fsdp, "fully_shard"):
    pytest.skip("FSDP2 (fully_shard) needs torch >= 2.6", allow_module_level=True)

import averaging_fsdp_targets as A  # noqa: E402  (needs the sys.path entry above)
import ddp_targets as T  # noqa: E402
from deadline import launched_ranks  # noqa: E402

from deepepochs import consolidate  # noqa: E402

CLOSE = 1e-6  # the averages of 2 processes with half batches against one process with the whole batch


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("averaging-fsdp")


@pytest.fixture(scope="module")
def ranks(out):
    """What rank 0 and rank 1 recorded in `averaging_fsdp_targets.run_scenarios`."""
    return launched_ranks(A.run_scenarios, T.OUT_ENV, out)


def plain_loop(averaged_of, updates: int = 5 * T.EPOCHS, start: int = 1, swa_lr=None):
    """One process, batch 2 * BATCH: SGD steps; from the `start`-th update on `averaged.update_parameters`
    after each (and, with `swa_lr`, SWALR's step). Returns (model, averaged)."""
    x, y = T.make_data(T.TRAIN_N, 1).tensors
    model = T.make_model()
    opt = T.make_optimizer(model)
    averaged = averaged_of(model)
    schedule = None
    count = 0
    while count < updates:
        for first in range(0, T.TRAIN_N, 2 * T.BATCH):
            F.cross_entropy(model(x[first:first + 2 * T.BATCH]), y[first:first + 2 * T.BATCH]).backward()
            opt.step()
            opt.zero_grad()
            count += 1
            if count >= start:
                averaged.update_parameters(model)
                if swa_lr is not None:
                    with warnings.catch_warnings():  # made after the optimizer's first steps: not a misuse
                        warnings.simplefilter("ignore", UserWarning)
                        schedule = schedule or SWALR(opt, swa_lr, anneal_epochs=2)
                        schedule.step()
    return model, averaged


def ema_of(model):
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(A.DECAY), use_buffers=True)


def close(a: dict, b: dict, tolerance: float = CLOSE) -> bool:
    return a.keys() == b.keys() and all(float((a[k].double() - b[k].double()).abs().max()) < tolerance for k in a)


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.distributed
def test_the_ema_under_fsdp_is_sharded_like_the_parameters_and_equals_a_plain_loop(ranks):
    """Each rank holds DTensors with its half of every averaged tensor; gathered, the average equals torch's
    AveragedModel in one process with the whole batch within 1e-6, on both ranks alike."""
    _, reference = plain_loop(ema_of)
    for rank, shard_rows in zip(ranks, ((4, 4, 2, 2), (4, 4, 1, 1))):
        run = rank["ema"]
        assert run["updates"] == 5 * T.EPOCHS
        kinds = {k: kind for k, (kind, _) in run["sharded"].items()}
        assert kinds == {"n_averaged": "Tensor", "module.0.weight": "DTensor", "module.0.bias": "DTensor",
                         "module.2.weight": "DTensor", "module.2.bias": "DTensor"}
        assert [shape[0] for k, (_, shape) in run["sharded"].items() if shape] == list(shard_rows)
        assert close(run["average"], reference.state_dict())
    assert equal(ranks[0]["ema"]["average"], ranks[1]["ema"]["average"])


@pytest.mark.distributed
def test_the_sharded_checkpoint_holds_the_average_which_consolidates_and_loads_back(ranks, out, tmp_path):
    """Consolidate assembles the average's full tensors into a plain file torch.load reads; a fresh 2-process
    trainer loads the average back from the sharded folder and from the consolidated file."""
    file = consolidate(out / "ema.ckpt", tmp_path / "one.ckpt")
    saved = torch.load(file, weights_only=True)["averages"]["ema"]
    assert saved["updates"] == 5 * T.EPOCHS
    run = ranks[0]["ema"]
    assert equal(saved["model"], run["average"])
    for rank in ranks:
        for name in ("ema.ckpt", "ema-file.ckpt"):
            assert rank["ema"]["loaded"][name]["updates"] == 5 * T.EPOCHS
            assert equal(rank["ema"]["loaded"][name]["average"], run["average"]), name


@pytest.mark.distributed
def test_test_and_predict_under_fsdp_use_the_average_and_give_the_weights_back(ranks):
    """test() with evaluate=True reports the average's loss on the whole validation set, predict() inside
    applied() gives the average's outputs; afterwards the model holds its training weights again."""
    _, reference = plain_loop(ema_of)
    x, y = T.make_data(T.VAL_N, 2).tensors
    averaged = {k[len("module."):]: v for k, v in reference.state_dict().items() if k.startswith("module.")}
    expected = T.metrics_on(averaged, x, y)
    with torch.no_grad():
        logits = reference(x)  # the AveragedModel's forward is its module's
    for rank in ranks:
        run = rank["ema"]
        assert run["test"]["loss"] == pytest.approx(expected["loss"], abs=1e-5)
        assert equal(run["after_test"], run["weights"]) and equal(run["after_predict"], run["weights"])
    assert float((ranks[0]["ema"]["predictions"] - logits).abs().max()) < 1e-5  # rank 0 returns them all


@pytest.mark.distributed
def test_a_mid_epoch_fsdp_snapshot_resumes_the_average_exactly(ranks):
    """A fault after the snapshot of update 8, then resume=True: the average ends as the uninterrupted run's."""
    for rank in ranks:
        run = rank["snapshot"]
        assert run["error"] == "injected fault after a mid-epoch snapshot"
        assert run["updates"] == 5 * T.EPOCHS
        assert equal(run["average"], rank["ema"]["average"])


@pytest.mark.distributed
def test_a_fit_failing_under_fsdp_and_refit_ends_with_the_uninterrupted_average(ranks):
    """A fault inside epoch 2's third batch leaves the average at the 7 committed updates; the refit ends
    with the uninterrupted run's average."""
    for rank in ranks:
        run = rank["refit"]
        assert run["error"] == "injected fault inside a window"
        assert run["at_fault"] == 7 and run["updates"] == 5 * T.EPOCHS
        assert equal(run["average"], rank["ema"]["average"])


@pytest.mark.distributed
def test_swa_from_an_update_under_fsdp_equals_a_plain_loop(ranks):
    """SWACallback(start_update=7) with max_updates=15: updates 7 to 15 averaged, SWALR stepping after each,
    as AveragedModel and SWALR in a plain loop."""
    _, reference = plain_loop(AveragedModel, start=A.SWA_START, swa_lr=0.05)
    for rank in ranks:
        assert rank["swa"]["updates"] == 5 * T.EPOCHS - A.SWA_START + 1
        assert close(rank["swa"]["average"], reference.state_dict())


@pytest.mark.distributed
def test_swa_with_batchnorm_statistics_recomputed_is_refused_under_fsdp(ranks):
    """update_bn runs the averaged model's forward, which a sharded average has not: refused at construction,
    naming the way out."""
    for rank in ranks:
        assert rank["refused"].startswith("SWACallback bn_update=True recomputes BatchNorm statistics")
        assert "pass bn_update=False, or buffers='average'" in rank["refused"]
