"""An `IterableDataset` drawing its samples from its own `generator` (no state of its own): a refit after a fault
before the epoch's first update, a refit inside the epoch and a resume after SIGTERM in the epoch's first window
stream the uninterrupted run's samples again and end bit-identical to it (accumulation over 2 batches,
dropout, Adam)."""

from __future__ import annotations

import signal

import pytest
import torch
from state_compare import states_equal  # tests/
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset

from deepepochs import Callback, Preempted, SnapshotCallback, Trainer
from deepepochs.errors import DeepEpochsWarning


class Stream(IterableDataset):
    """24 samples a pass, drawn from the stream's own generator (each pass draws new ones)."""

    def __init__(self):
        self.generator = torch.Generator().manual_seed(7)

    def __iter__(self):
        for _ in range(24):
            x = torch.randn(6, generator=self.generator)
            yield x, (x[0] - x[1] > 0).long()


class FaultAt(Callback):
    """An exception (or SIGTERM to the process) after the training batch `batch` (0-based) of epoch `epoch`."""

    def __init__(self, epoch: int, batch: int, fault: str = "exception"):
        self.at, self.fault, self.done = (epoch, batch), fault, False

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if not self.done and (trainer.loop.epoch, batch_idx) == self.at:
            self.done = True
            if self.fault == "exception":
                raise RuntimeError("injected")
            signal.raise_signal(signal.SIGTERM)


def _trainer(callbacks=(), **options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 2))
    return Trainer(model, F.cross_entropy, torch.optim.Adam(model.parameters(), lr=0.01), epochs=3,
                   gradient_accumulation_steps=2, device="cpu", log_batch=False, show_info=False,
                   callbacks=list(callbacks), running_id="run", **options)


def _result(trainer):
    return {"model": trainer.raw_model.state_dict(), "opt": trainer.opt[0].opt.state_dict(),
            "history": trainer.history}


@pytest.fixture(scope="module")
def reference():
    trainer = _trainer()
    trainer.fit(DataLoader(Stream(), batch_size=4))
    return _result(trainer)


@pytest.mark.parametrize("at", [(1, 0), (2, 0)], ids=["epoch-1", "epoch-2"])
def test_a_refit_before_the_epochs_first_update_streams_the_epochs_samples_again(reference, at):
    """A fault after the epoch's first batch, inside its first window: the refit starts the epoch again with
    the stream's generator where the epoch began, bit-identical and without a warning."""
    trainer, data = _trainer([FaultAt(*at)]), DataLoader(Stream(), batch_size=4)
    with pytest.raises(RuntimeError, match="injected"):
        trainer.fit(data)
    trainer.fit(data)
    assert states_equal(_result(trainer), reference)


def test_a_refit_inside_the_epoch_streams_past_its_trained_batches_from_the_epochs_start(reference):
    """A fault inside epoch 2 after two updates: the trained batches are streamed past from the epoch's start
    (with the documented warning that such a stream's order is its own), then training continues exactly."""
    trainer, data = _trainer([FaultAt(2, 4)]), DataLoader(Stream(), batch_size=4)
    with pytest.raises(RuntimeError, match="injected"):
        trainer.fit(data)
    with pytest.warns(DeepEpochsWarning, match="resuming inside an epoch"):
        trainer.fit(data)
    assert states_equal(_result(trainer), reference)


def test_a_resume_inside_the_epochs_first_window_streams_its_samples_again(reference, tmp_path):
    """SIGTERM after epoch 2's second batch, the last of its first window (the fit stops at that window's
    update): a new trainer and stream resume from the snapshot, streaming past its batches from the epoch's
    start (with the warning), bit-identical."""
    trainer = _trainer([FaultAt(2, 1, "SIGTERM"), SnapshotCallback(tmp_path, on_signals=("SIGTERM",))])
    with pytest.raises(Preempted):
        trainer.fit(DataLoader(Stream(), batch_size=4))
    resumed = _trainer([SnapshotCallback(tmp_path, on_signals=("SIGTERM",))], resume=True)
    with pytest.warns(DeepEpochsWarning, match="resuming inside an epoch"):
        resumed.fit(DataLoader(Stream(), batch_size=4))
    assert states_equal(_result(resumed), reference)
