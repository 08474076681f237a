"""State a step carries across epochs (`trainer.carried`: a running queue of outputs, as MoCo keeps its
negatives, and a count its validation step keeps) is in every file the library writes: a run stopped after
its second epoch and continued by a new trainer, in a fresh random state, from CheckCallback's latest or
best file, SnapshotCallback's epoch-end snapshot, `checkpoint.save` after the fit, a sharded folder or the
file consolidated from it, ends bit-identical to the uninterrupted run (weights, optimizer and scheduler
states, records, the carried dict), which equals the same program written as a plain PyTorch loop. A file
of an older version (no `carried`) still loads, leaving the dict as it is."""

from __future__ import annotations

import copy
import random
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from checkpoint_helpers import save_sharded
from state_compare import states_equal as same
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import CheckCallback, Optimizer, SnapshotCallback, TrainerBase, checkpoint
from deepepochs.errors import DeepEpochsWarning

EPOCHS, STOP, QUEUE = 3, 2, 6


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def loaders():
    """40 samples: a shuffled training DataLoader of 5 batches with its own generator, a validation one."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 4, generator=g)
    data = TensorDataset(x, x.sum(1, keepdim=True) + 0.1 * torch.randn(40, 1, generator=g))
    return DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(3)), \
        DataLoader(data, batch_size=16)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 1))


class QueueStep(TrainerBase):
    """The targets are shifted by the mean of a queue of the last outputs, which runs on from epoch to epoch,
    and by the samples the validation steps have seen; the inputs are jittered by NumPy and `random` draws."""

    def train_step(self, batch_x, batch_y, **step_args):
        queue = self.carried.get("queue", torch.zeros(QUEUE, 1))
        jitter = 1.0 + 0.01 * float(np.random.rand()) + 0.01 * random.random()
        out = self.model(batch_x * jitter)
        shift = 0.1 * queue.mean() + 1e-3 * self.carried.get("val_seen", 0)
        self.carried["queue"] = torch.cat([out.detach(), queue])[:QUEUE]
        self.loss(out, batch_y + shift)

    def evaluate_step(self, batch_x, batch_y, **step_args):
        self.carried["val_seen"] = self.carried.get("val_seen", 0) + len(batch_x)
        return super().evaluate_step(batch_x, batch_y, **step_args)


def make(callbacks=(), resume=False):
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    return QueueStep(net, F.mse_loss, Optimizer(opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)),
                     epochs=EPOCHS, callbacks=list(callbacks), resume=resume, running_id="run", device="cpu",
                     log_batch=False, show_info=False)


def outcome(trainer, records) -> dict:
    """Everything the run ends with: weights, optimizer and scheduler states, records, the carried dict."""
    return copy.deepcopy({"model": trainer.raw_model.state_dict(), "opt": trainer.opt.state_dict(),
                          "records": records, "carried": dict(trainer.carried)})


@pytest.fixture(scope="module")
def uninterrupted():
    with make() as trainer:
        seed_all(7)
        return outcome(trainer, trainer.fit(*loaders()))


def test_the_uninterrupted_run_equals_a_plain_pytorch_loop_carrying_the_queue_across_epochs(uninterrupted):
    """The queue and the validation count run on across the epochs: the weights and the carried values
    equal a plain loop's bit for bit."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)
    train, val = loaders()
    seed_all(7)
    queue, val_seen = torch.zeros(QUEUE, 1), 0
    for _ in range(EPOCHS):
        net.train()
        for x, y in train:
            jitter = 1.0 + 0.01 * float(np.random.rand()) + 0.01 * random.random()
            out = net(x * jitter)
            shift = 0.1 * queue.mean() + 1e-3 * val_seen
            queue = torch.cat([out.detach(), queue])[:QUEUE]
            F.mse_loss(out, y + shift).backward()
            opt.step()
            opt.zero_grad()
        net.eval()
        with torch.no_grad():
            for x, _y in val:
                net(x)
                val_seen += len(x)
        sched.step()
    assert same(uninterrupted["model"], net.state_dict())
    assert same(uninterrupted["carried"], {"queue": queue, "val_seen": val_seen})


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """The files a run stopped after epoch STOP wrote: CheckCallback's latest and best, SnapshotCallback's
    epoch-end snapshot, `checkpoint.save` after the fit, a sharded folder and its consolidated file."""
    root = tmp_path_factory.mktemp("carried")
    callbacks = [CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=root),
                 CheckCallback("loss", on_stage="val", ckpt_dir=root), SnapshotCallback(root, on_signals=())]
    with make(callbacks) as first:
        seed_all(7)
        first.fit(*loaders(), epochs=STOP)
        run = root / "run"
        checkpoint.save(first, run / "saved.ckpt")
        save_sharded(first, run / "sharded.ckpt")
    checkpoint.consolidate(run / "sharded.ckpt", run / "consolidated.ckpt")
    snapshot = next(run.glob(f"snapshot-*-epoch{STOP}.ckpt"))
    return {"latest": run / "train-loss.latest.ckpt", "best": run / "val-loss.best.ckpt", "snapshot": snapshot,
            "saved": run / "saved.ckpt", "sharded": run / "sharded.ckpt", "consolidated": run / "consolidated.ckpt"}


def continued(path) -> dict:
    """A new trainer, in another random state, loads `path` and fits to the epoch target."""
    with make() as trainer:
        seed_all(1234)
        trainer.load_checkpoint(path)
        assert trainer.carried.keys() == {"queue", "val_seen"}
        return outcome(trainer, trainer.fit(*loaders()))


@pytest.mark.parametrize("kind", ["latest", "best", "snapshot", "saved", "sharded", "consolidated"])
def test_a_run_continued_from_each_file_written_at_an_epoch_end_ends_bit_identical(written, kind, uninterrupted):
    """Each file holds every rank's carried dict (read back here as a plain file); continued from it, the run
    ends as the uninterrupted one: weights, optimizer and scheduler states, records, carried values."""
    path = written[kind]
    stored = checkpoint.read_checkpoint(path)
    assert stored.epoch == STOP and len(stored.carried) == 1
    assert set(stored.carried[0]["__dict__"]) == {"queue", "val_seen"}
    assert same(continued(path), uninterrupted)


def test_resume_true_from_the_best_file_alone_carries_the_state_on(written, uninterrupted, tmp_path):
    """`resume=True` in a run folder holding only CheckCallback's best file continues bit-identical."""
    (tmp_path / "run").mkdir()
    shutil.copy(written["best"], tmp_path / "run" / written["best"].name)
    with make([CheckCallback("loss", on_stage="val", ckpt_dir=tmp_path)], resume=True) as trainer:
        seed_all(1234)
        assert same(outcome(trainer, trainer.fit(*loaders())), uninterrupted)


def test_a_file_without_carried_loads_and_leaves_the_dict_as_it_is(written, tmp_path):
    """A file of an older version has no `carried` key: it loads, the dict keeps what it held (a fresh
    trainer's: empty), and a damaged `carried` is refused naming the field with nothing changed."""
    data = torch.load(written["latest"], weights_only=True)
    del data["carried"]
    torch.save(data, tmp_path / "old.ckpt")
    with make() as trainer:
        trainer.load_checkpoint(tmp_path / "old.ckpt")
        assert trainer.carried == {} and trainer.loop.completed_epochs == STOP
        trainer.carried["queue"] = kept = torch.ones(QUEUE, 1)
        data["carried"] = [{"queue": 1}]
        torch.save(data, tmp_path / "damaged.ckpt")
        with pytest.raises(checkpoint.CheckpointError, match=r"carried\[0\] must be an encoded dict"):
            trainer.load_checkpoint(tmp_path / "damaged.ckpt")
        assert trainer.carried.keys() == {"queue"} and trainer.carried["queue"] is kept


def test_a_value_no_file_can_hold_is_left_out_with_a_warning_and_the_load_leaves_the_dict_as_it_is(tmp_path):
    """`trainer.carried` holding a set (not a value `weights_only` reads): the save warns naming what to store
    and writes None for the process; loading that file leaves the loading trainer's dict as it is."""
    with make() as trainer:
        trainer.carried["seen"] = {1, 2}
        with pytest.warns(DeepEpochsWarning, match=r"cannot store trainer.carried .*a set value"):
            checkpoint.save(trainer, tmp_path / "file.ckpt")
    assert torch.load(tmp_path / "file.ckpt", weights_only=True)["carried"] == [None]
    with make() as other:
        other.carried["queue"] = kept = torch.ones(QUEUE, 1)
        other.load_checkpoint(tmp_path / "file.ckpt")
        assert other.carried == {"queue": kept}


def test_a_load_that_fails_after_applying_the_carried_state_puts_the_dict_back(written, monkeypatch):
    """All or nothing: a failure later in the load (the data streams' states, once) leaves `trainer.carried`
    as it was, a value no file can hold included."""
    with make() as trainer:
        trainer.carried.update(queue=(kept := torch.ones(QUEUE, 1)), seen={1, 2})
        calls = []

        def fails_once(states):
            calls.append(states)
            if len(calls) == 1:
                raise RuntimeError("a stream refused its state")

        monkeypatch.setattr(trainer.dist, "continue_streams", fails_once)
        with pytest.raises(checkpoint.CheckpointError, match="random generator states do not fit"):
            trainer.load_checkpoint(written["latest"])
        assert trainer.carried.keys() == {"queue", "seen"} and trainer.carried["seen"] == {1, 2}
        assert torch.equal(trainer.carried["queue"], kept) and trainer.loop.completed_epochs == 0
