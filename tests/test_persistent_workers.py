"""DataLoaders with persistent workers in training and validation: a refit after an exception and a resume
after SIGTERM end bit-identical to the uninterrupted fit (by updates, shuffling, dropout, Adam, validation
points), and the run that makes the workers anew says once that draws inside them start afresh."""

from __future__ import annotations

import multiprocessing
import signal
import warnings

import pytest
import torch
from state_compare import states_equal  # tests/
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

from deepepochs import Callback, Preempted, SnapshotCallback, Trainer
from deepepochs.errors import DeepEpochsWarning

pytestmark = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods() or
                                not hasattr(signal, "SIGTERM"), reason="needs fork workers and POSIX signals")

UPDATES, VAL_EVERY = 18, 5  # 6 updates an epoch: validation points inside epochs 1, 2 and 3


class Boom(Exception):
    pass


class FaultAt(Callback):
    """An exception (or a signal to the process) after the `at`-th update of this trainer's life."""

    def __init__(self, at: int, fault: str):
        self.at, self.fault, self.count = at, fault, 0

    def on_after_optimize(self, trainer, optimize_index):
        self.count += 1
        if self.count == self.at:
            if self.fault == "exception":
                raise Boom(f"update {self.at}")
            signal.raise_signal(signal.SIGTERM)


class NoisySamples(Dataset):
    """Samples with `torch.rand` noise drawn in `__getitem__` (in the workers' generators)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.rand(self.x.shape[1]), self.y[i]


def _loaders(train_persistent: bool, val_persistent: bool, own_generator: bool = True, noisy: bool = False):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(60, 6, generator=g)
    y = (x[:, 0] - x[:, 1] > 0).long()
    dataset = (NoisySamples if noisy else TensorDataset)(x[:48], y[:48])
    workers = {"num_workers": 1, "multiprocessing_context": "fork"}
    generator = torch.Generator().manual_seed(5) if own_generator else None
    train = DataLoader(dataset, batch_size=8, shuffle=True, generator=generator,
                       persistent_workers=train_persistent, **workers)
    val = DataLoader(TensorDataset(x[48:], y[48:]), batch_size=4, persistent_workers=val_persistent, **workers)
    return train, val


def _trainer(folder=None, resume=False, fault=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 2))
    callbacks = [] if fault is None else [fault]
    if folder is not None:
        callbacks.append(SnapshotCallback(folder, on_signals=("SIGTERM",)))
    return Trainer(model, F.cross_entropy, torch.optim.Adam(model.parameters(), lr=0.01), max_updates=UPDATES,
                   device="cpu", log_batch=False, show_info=False, callbacks=callbacks, resume=resume,
                   running_id="run")


def _fit(trainer, loaders):
    trainer.fit(*loaders, val_every_n_updates=VAL_EVERY)
    return {"model": trainer.raw_model.state_dict(), "opt": trainer.opt[0].opt.state_dict(),
            "history": trainer.history}


def _reference(**options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepEpochsWarning)
        return _fit(_trainer(), _loaders(**options))


def _refit(at: int, **options):
    """An exception after update `at`, then `fit()` again with the same trainer and DataLoaders."""
    trainer, loaders = _trainer(fault=FaultAt(at, "exception")), _loaders(**options)
    with pytest.raises(Boom):
        _fit(trainer, loaders)
    return _fit(trainer, loaders)


def _resume(folder, at: int, **options):
    """SIGTERM after update `at` (a snapshot), then a new trainer with new DataLoaders resumes."""
    with pytest.raises(Preempted):
        _fit(_trainer(folder, fault=FaultAt(at, "SIGTERM")), _loaders(**options))
    return _fit(_trainer(folder, resume=True), _loaders(**options))


PERSISTENT = [pytest.param(True, False, id="train"), pytest.param(False, True, id="val"),
              pytest.param(True, True, id="both")]


@pytest.mark.slow
@pytest.mark.parametrize(("train_persistent", "val_persistent"), PERSISTENT)
@pytest.mark.parametrize("at", [7, 9], ids=["at-epoch-start", "mid-epoch"])
def test_a_refit_with_persistent_workers_ends_as_the_uninterrupted_fit(train_persistent, val_persistent, at):
    """An exception after update `at` (7: the refit starts epoch 2 afresh; 9: inside epoch 2, after a
    validation point that reused the workers), then `fit()` again: bit-identical, with the warning that
    draws inside the workers start afresh; a training loader drawing its base seeds from torch's global
    generator too."""
    options = {"train_persistent": train_persistent, "val_persistent": val_persistent,
               "own_generator": at == 9}
    reference = _reference(**options)
    with pytest.warns(DeepEpochsWarning, match="persistent workers start anew.*persistent_workers=False"):
        result = _refit(at, **options)
    assert states_equal(result, reference)


@pytest.mark.slow
@pytest.mark.parametrize(("train_persistent", "val_persistent"), PERSISTENT)
def test_a_resume_with_persistent_workers_ends_as_the_uninterrupted_fit(train_persistent, val_persistent,
                                                                       tmp_path):
    """SIGTERM after update 11 (a snapshot inside epoch 2), a new trainer and new DataLoaders resume:
    bit-identical, with the warning."""
    options = {"train_persistent": train_persistent, "val_persistent": val_persistent}
    reference = _reference(**options)
    with pytest.warns(DeepEpochsWarning, match="persistent workers start anew"):
        result = _resume(tmp_path, 11, **options)
    assert states_equal(result, reference)


@pytest.mark.slow
def test_a_resume_from_an_epoch_end_file_with_persistent_workers_ends_as_the_uninterrupted_fit(tmp_path):
    """A fit by epochs to 2, then a new trainer with new DataLoaders resumed from its epoch-end file to 4:
    the validation of epoch 3 draws no base seed the uninterrupted run's never drew; bit-identical."""
    def fit(epochs, resume, folder):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.3), nn.Tanh(), nn.Linear(8, 2))
        trainer = Trainer(model, F.cross_entropy, torch.optim.Adam(model.parameters(), lr=0.01), epochs=epochs,
                          device="cpu", log_batch=False, show_info=False, resume=resume, running_id="run",
                          callbacks=[SnapshotCallback(folder)])
        trainer.fit(*_loaders(True, True, own_generator=False))
        return {"model": model.state_dict(), "opt": trainer.opt[0].opt.state_dict(), "history": trainer.history}

    reference = fit(4, False, tmp_path / "reference")
    fit(2, False, tmp_path / "run")
    with pytest.warns(DeepEpochsWarning, match="persistent workers start anew"):
        assert states_equal(fit(4, True, tmp_path / "run"), reference)


def test_a_fault_before_the_first_validation_makes_its_workers_afresh_without_a_warning():
    """An exception after update 3, before the validation loader's first iterator: the refit makes it as the
    uninterrupted run did (drawing its base seed), bit-identical and without the warning."""
    options = {"train_persistent": False, "val_persistent": True}
    reference = _reference(**options)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeepEpochsWarning)
        assert states_equal(_refit(3, **options), reference)


@pytest.mark.slow
def test_a_resume_with_persistent_workers_drawing_in_the_dataset_warns_once_naming_the_ways_out(tmp_path):
    """Persistent training workers drawing `torch.rand` in `__getitem__`: a resume inside epoch 2 cannot put
    the workers' generators back; it says so once, naming a seed per sample and persistent_workers=False."""
    options = {"train_persistent": True, "val_persistent": True, "noisy": True}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _resume(tmp_path, 8, **options)
    said = [str(w.message) for w in caught if issubclass(w.category, DeepEpochsWarning)
            and "persistent workers start anew" in str(w.message)]
    assert len(said) == 1 and "per sample" in said[0] and "persistent_workers=False" in said[0]
