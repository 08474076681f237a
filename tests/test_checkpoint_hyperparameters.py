"""A checkpoint's scheduler and optimizer hyper-parameters read back against the live objects' own: an int
where the live object holds a float loads only when it is exactly a float (at most 2**53 in size), anything
larger is refused before it reaches the run, with the trainer unchanged; the small int trains as the float
it equals."""

from __future__ import annotations

import re

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, CheckpointError, Optimizer, Trainer
from deepepochs.checkpoint import load_into, save

QUIET = dict(log_batch=False, show_info=False, device="cpu")


def data():
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(16, 2, generator=g), torch.randn(16, 1, generator=g)), batch_size=4)


def trainer(gamma=0.5, epochs=1, loss=F.mse_loss):
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    return Trainer(model, loss, Optimizer(opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=gamma)),
                   epochs=epochs, **QUIET)


def saved_with(tmp_path, change):
    """A checkpoint of a fit of one epoch whose state `change` edited (as a damaged or crafted file would be)."""
    first = trainer()
    first.fit(data())
    path = save(first, tmp_path / "a.ckpt")
    state = torch.load(path, weights_only=True)
    change(state)
    torch.save(state, path)
    return path


@pytest.mark.parametrize("field, change", [
    ("schedulers[0]['gamma']", lambda s: s["schedulers"][0].__setitem__("gamma", 2**62)),
    ("param_groups[0]['eps']", lambda s: s["optimizers"][0]["param_groups"][0].__setitem__("eps", 2**60)),
])
def test_an_int_beyond_2_53_where_the_live_object_holds_a_float_is_refused(tmp_path, field, change):
    """Before: gamma 2**62 loaded and the next fit raised FloatingPointError. Now the load names the field."""
    path = saved_with(tmp_path, change)
    target = trainer(epochs=4)
    before = {k: v.clone() for k, v in target.raw_model.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"{field.replace('[', '.*').replace(']', '')}.* must be a float like"
                                              r" the trainer's \(got int \d+: an int beyond 2\*\*53"):
        load_into(target, path)
    assert all(torch.equal(v, before[k]) for k, v in target.raw_model.state_dict().items())
    assert target.opt[0].scheduler.gamma == 0.5


def test_a_small_int_where_the_live_object_holds_a_float_trains_as_that_float(tmp_path):
    """gamma the int 1 in the file: it loads, and the fit equals one whose file holds the float 1.0."""
    runs = []
    for value in (1, 1.0):
        path = saved_with(tmp_path, lambda s, v=value: s["schedulers"][0].__setitem__("gamma", v))
        target = trainer(epochs=3)
        load_into(target, path)
        target.fit(data())
        runs.append({k: v.clone() for k, v in target.raw_model.state_dict().items()})
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


# ---- checkpoint.save inside an epoch ----
class SaveAt(Callback):
    """Calls `checkpoint.save` in a hook: after training batch `batch` (0-based) of epoch `epoch`, or at the
    epoch's end; keeps what it raised."""

    def __init__(self, path, epoch, batch=None):
        self.path, self.epoch, self.batch, self.raised = path, epoch, batch, None

    def _save(self, trainer):
        try:
            save(trainer, self.path)
        except CheckpointError as e:
            self.raised = e

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if trainer.loop.epoch == self.epoch and batch_idx == self.batch:
            self._save(trainer)

    def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx):
        if trainer.loop.epoch == self.epoch and self.batch is None:
            self._save(trainer)


def test_a_save_inside_a_training_task_is_refused_and_writes_nothing(tmp_path):
    """Before: the file held no position and a resume from it trained epoch 2 again on weights that had
    trained part of it."""
    saver = SaveAt(tmp_path / "mid.ckpt", epoch=2, batch=1)
    t = trainer(epochs=2)
    t.add_callbacks([saver])
    t.fit(data())
    assert isinstance(saver.raised, CheckpointError) and not (tmp_path / "mid.ckpt").exists()
    assert re.search(r"checkpoint.save\(.*mid.ckpt'\) was called inside training task 0 of epoch 2, 2 batches"
                     r" committed: a file without a position there would say epoch 1 ended", str(saver.raised))


def test_a_save_after_a_fault_inside_an_epoch_is_refused_and_one_at_an_epochs_end_is_written(tmp_path):
    """After an exception in epoch 2 the run stands inside it: refused. At an epoch's end: written."""
    end = SaveAt(tmp_path / "end.ckpt", epoch=1)
    calls = []

    def fail(out, y):
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("boom")
        return F.mse_loss(out, y)

    t = trainer(epochs=2, loss=fail)
    t.add_callbacks([end])
    with pytest.raises(RuntimeError, match="boom"):
        t.fit(data())
    assert end.raised is None and (tmp_path / "end.ckpt").exists()
    with pytest.raises(CheckpointError, match=r"inside training task 0 of epoch 2, 1 batches committed"):
        save(t, tmp_path / "after.ckpt")
    assert not (tmp_path / "after.ckpt").exists()
