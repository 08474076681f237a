"""Under DDP (two gloo processes on the CPU) every checkpoint file holds each rank's carried state: a run
stopped at an epoch's end and continued with ``resume=True`` gives each rank back its own queue, and ends
bit-identical to the uninterrupted run on both ranks; one process loading that file takes rank 0's."""

import carried_targets as C  # the distributed tests' folder is on sys.path (pytest's rootdir-less import)
import ddp_targets as T
import pytest
import torch
from deadline import launched_ranks
from torch.nn import functional as F


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """(the folder the two processes wrote their runs into, what each rank recorded)."""
    out = tmp_path_factory.mktemp("carried_ddp")
    return out, launched_ranks(C.run, C.OUT_ENV, out)


@pytest.mark.distributed
def test_each_rank_continues_from_an_epoch_end_file_with_its_own_carried_queue(launched):
    """The file holds both ranks' queues (different: each rank's own shard), and the resumed run's weights,
    records and queues equal the uninterrupted run's on every rank."""
    ranks = launched[1]
    stored = ranks[0]["file"]
    assert len(stored) == 2 and not torch.equal(stored[0]["__dict__"]["queue"], stored[1]["__dict__"]["queue"])
    for rank in ranks:
        done, resumed = rank["uninterrupted"], rank["resumed"]
        assert resumed["records"] == done["records"]
        assert torch.equal(resumed["queue"], done["queue"])
        assert all(torch.equal(resumed["state"][k], v) for k, v in done["state"].items())


@pytest.mark.distributed
def test_one_process_loading_a_two_process_file_takes_rank_0s_carried_state(launched):
    """On another world size each process takes rank 0's dict, as a mid-epoch snapshot's run state."""
    out, ranks = launched
    model = T.make_model()
    with C.Queue(model, F.cross_entropy, T.make_optimizer(model), **T.trainer_kwargs()) as trainer:
        path = out / "b" / "run" / "train-loss.latest.ckpt"  # the resumed run's last epoch
        trainer.load_checkpoint(path)
        assert torch.equal(trainer.carried["queue"], ranks[0]["resumed"]["queue"])
        assert not torch.equal(trainer.carried["queue"], ranks[1]["resumed"]["queue"])
