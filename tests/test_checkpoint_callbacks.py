"""Callbacks that keep a state (`state_dict()` and `load_state_dict()`): every checkpoint holds it under
`callbacks`, by the callback's class name (and `state_key`); a rollback puts it back as the last commit point
left it, so a refit after a fault inside a window ends with the uninterrupted run's state; a new trainer
loading an epoch's file continues it exactly; two of one name are refused; a callback holding tensors of
its own without those methods is named in a warning, once; an older file without the key loads, a damaged
entry is refused naming the field. (A program's own EMA object kept in a callback, resumed after SIGTERM:
tests/callbacks/test_ema_conventions.py.)"""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from state_compare import states_equal as same
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, CheckpointError, ConfigError, Trainer, checkpoint
from deepepochs.errors import DeepEpochsWarning

QUIET = dict(log_batch=False, show_info=False, device="cpu")


class Noisy(nn.Module):
    """Adds NumPy's and Python's draws in training."""

    def forward(self, x):
        return x + 1e-3 * float(np.random.rand()) - 1e-3 * random.random() if self.training else x


def make(callbacks, epochs=3, noisy=True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.3), nn.ReLU(),
                          Noisy() if noisy else nn.Identity(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), 0.1, momentum=0.9)
    return Trainer(model, F.cross_entropy, opt, epochs=epochs, callbacks=callbacks, gradient_accumulation_steps=2,
                   **QUIET)


def data():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(48, 4, generator=g), torch.randint(0, 3, (48,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(2))


def seed():
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)


class Tally(Callback):
    """A state changed inside windows (forwards seen) and after each update (a running sum of the weights)."""

    def __init__(self, state_key=None):
        self.state_key = state_key
        self.seen, self.total = 0, torch.zeros(8, 4)

    def on_before_train_forward(self, trainer):
        self.seen += 1

    def on_after_optimize(self, trainer, optimize_index):
        self.total = 0.5 * self.total + trainer.raw_model[0].weight.detach()

    def state_dict(self):
        return {"seen": self.seen, "total": self.total.clone()}

    def load_state_dict(self, state):
        self.seen, self.total = state["seen"], state["total"].clone()


class FailAt(Callback):
    """Raises once before the forward of training batch `batch` (1-based) of epoch `epoch`."""

    def __init__(self, epoch, batch):
        self.epoch, self.batch, self.done = epoch, batch, False

    def on_before_train_forward(self, trainer):
        if not self.done and trainer.loop.epoch == self.epoch and trainer.loop.batch_idx == self.batch:
            self.done = True
            raise RuntimeError("injected fault")


def run_through(noisy=True):
    tally = Tally()
    trainer = make([tally], noisy=noisy)
    seed()
    trainer.fit(data())
    return tally.state_dict(), trainer.raw_model.state_dict()


@pytest.fixture(scope="module")
def uninterrupted():
    return run_through()


# A refit after a fault replays torch's generators from the last commit point, not NumPy's or Python's (a
# resumed file restores all of them): the runs a fault interrupts draw from torch's alone.
@pytest.fixture(scope="module")
def uninterrupted_torch_only():
    return run_through(noisy=False)


@pytest.mark.parametrize("epoch,batch", [(2, 4), (2, 5), (3, 2)])
def test_a_fault_inside_a_window_puts_the_state_back_and_the_refit_ends_as_the_uninterrupted_run(
        uninterrupted_torch_only, epoch, batch):
    """A fault at a window's second batch, at a window's first, and early in the last epoch: the forwards
    the discarded window counted are taken back, and the refit ends with the uninterrupted state."""
    tally = Tally()
    trainer = make([tally, FailAt(epoch, batch)], noisy=False)
    seed()
    with pytest.raises(RuntimeError, match="injected fault"):
        trainer.fit(data())
    done = 6 * (epoch - 1) + (batch - 1) // 2 * 2  # forwards of the committed windows
    assert tally.seen == done
    trainer.fit(data())
    assert same(tally.state_dict(), uninterrupted_torch_only[0])
    assert same(trainer.raw_model.state_dict(), uninterrupted_torch_only[1])


def test_an_epoch_file_holds_the_state_by_name_and_a_new_trainer_loading_it_continues_exactly(
        uninterrupted, tmp_path):
    """After 2 of 3 epochs `checkpoint.save` writes the state under `callbacks['Tally']` (a plain torch.load
    reads it); a new trainer loading the file ends the third epoch with the uninterrupted state."""
    tally = Tally()
    trainer = make([tally])
    seed()
    trainer.fit(data(), epochs=2)
    checkpoint.save(trainer, tmp_path / "two.ckpt")
    saved = torch.load(tmp_path / "two.ckpt", weights_only=True)["callbacks"]
    assert list(saved) == ["Tally"] and saved["Tally"]["__dict__"]["seen"] == 12
    again = Tally()
    resumed = make([again])
    torch.manual_seed(1234)  # the file's generators count, not what this process drew
    resumed.load_checkpoint(tmp_path / "two.ckpt")
    assert again.seen == 12
    resumed.fit(data())
    assert same(again.state_dict(), uninterrupted[0])
    assert same(resumed.raw_model.state_dict(), uninterrupted[1])


def test_two_callbacks_of_one_name_are_refused_and_a_state_key_tells_them_apart(tmp_path):
    """Two `Tally`s without `state_key` are refused naming the name; with keys both are kept, each its own."""
    with pytest.raises(ConfigError, match=r"two callbacks keep their state under the name 'Tally'"):
        make([Tally(), Tally()])
    trainer = make([Tally("a"), Tally("b")], epochs=1)
    seed()
    trainer.fit(data())
    checkpoint.save(trainer, tmp_path / "one.ckpt")
    assert list(torch.load(tmp_path / "one.ckpt", weights_only=True)["callbacks"]) == ["Tally[a]", "Tally[b]"]


class Hoarder(Callback):
    """Holds a tensor and a module of its own, and the trainer's model, without state_dict()."""

    def on_attach(self, trainer):
        self.model = trainer.raw_model
        self.best, self.copy = torch.zeros(3), nn.Linear(2, 2)


class Borrower(Callback):
    """Holds only the trainer's model and its optimizer."""

    def on_attach(self, trainer):
        self.model, self.opt = trainer.raw_model, trainer.opt[0].opt


def test_a_callback_holding_tensors_without_state_methods_is_named_once_at_the_first_file(tmp_path):
    """One warning naming `Hoarder` and its attributes `best` and `copy` at the first file, none at the
    second; `Borrower`, holding the trainer's own model and optimizer, is not named."""
    trainer = make([Hoarder(), Borrower()], epochs=1)
    seed()
    trainer.fit(data())
    with pytest.warns(DeepEpochsWarning, match=r"callback Hoarder holds best, copy \(tensors") as caught:
        checkpoint.save(trainer, tmp_path / "a.ckpt")
    assert len([w for w in caught if "Borrower" in str(w.message) or "Hoarder" in str(w.message)]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        checkpoint.save(trainer, tmp_path / "b.ckpt")


def test_a_file_without_callbacks_loads_leaving_the_state_and_a_damaged_entry_is_refused_naming_it(tmp_path):
    """A file of an older version (no `callbacks` key) loads and the callback keeps its state; a file whose
    entry is not a stored state is refused naming `callbacks['Tally']`, with nothing changed."""
    trainer = make([Tally()], epochs=1)
    seed()
    trainer.fit(data())
    checkpoint.save(trainer, tmp_path / "new.ckpt")
    old = torch.load(tmp_path / "new.ckpt", weights_only=True)
    del old["callbacks"]
    torch.save(old, tmp_path / "old.ckpt")
    tally = Tally()
    tally.seen = 7
    other = make([tally])
    other.load_checkpoint(tmp_path / "old.ckpt")
    assert tally.seen == 7 and other.loop.completed_epochs == 1
    old["callbacks"] = {"Tally": {"seen": 3}}
    torch.save(old, tmp_path / "damaged.ckpt")
    with pytest.raises(CheckpointError, match=r"callbacks\['Tally'\] must be a stored callback state"):
        other.load_checkpoint(tmp_path / "damaged.ckpt")
    assert tally.seen == 7
