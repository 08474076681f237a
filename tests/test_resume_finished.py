"""Resuming a finished run: a run that stopped early or reached its epoch target says
it is finished when resumed with resume=True, trains nothing and returns its records; a run whose target
is raised trains on; a stale or missing record changes nothing."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, CheckCallback, Trainer, set_seed
from deepepochs.checkpoint.finished import FINISHED_FILE
from deepepochs.errors import DeepEpochsWarning


def _loader(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(48, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=16)


def constant(preds, targets):
    """Never improves after its first value: CheckCallback(mode='max', patience=p) stops at epoch 1 + p."""
    return torch.tensor(1.0)


class CountBatches(Callback):
    def __init__(self):
        self.batches = 0

    def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
        self.batches += 1


def _run(tmp_path, epochs, resume=False, patience=2, save_best=True):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    counter = CountBatches()
    check = CheckCallback("constant", mode="max", patience=patience, save_best=save_best, ckpt_dir=tmp_path / "c")
    trainer = Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.05), epochs=epochs,
                      metrics=[constant], callbacks=[check, counter], resume=resume, log_batch=False,
                      running_id=None if resume else "run")
    return trainer, counter


def test_an_early_stopped_run_resumed_says_it_is_finished_and_returns_its_records(tmp_path, capsys):
    """Stopped early after epoch 3 of 10; the rerun with resume=True trains no batch, returns the first
    run's records, says why it is finished, and holds the run's history and epoch count."""
    first, _ = _run(tmp_path, epochs=10)
    records = first.fit(_loader(), _loader(1))
    first.close()
    assert len(records["train"]["loss"]) == 3 and (tmp_path / "c" / "run" / FINISHED_FILE).is_file()
    capsys.readouterr()
    again, counter = _run(tmp_path, epochs=10, resume=True)
    with again:
        resumed = again.fit(_loader(), _loader(1))
        assert counter.batches == 0
        assert resumed == records and again.history == records
        assert again.loop.completed_epochs == 3
    out = capsys.readouterr().out
    assert "Run run is finished (stopped early after epoch 3: val constant did not improve" in out
    assert "returns its records without training" in out
    marker = tmp_path / "c" / "run" / FINISHED_FILE
    assert f"To train on from its last checkpoint (as deepepochs 0.6 did), delete {marker} and fit again; to"\
           " start afresh, pass a new running_id" in out


def test_following_the_finished_message_trains_on_like_0_6(tmp_path):
    """The finished message's advice works: with the run's end record deleted, resume=True trains on from
    the last checkpoint until patience stops it again, as deepepochs 0.6.18 did on a rerun."""
    first, _ = _run(tmp_path, epochs=10)
    first.fit(_loader(), _loader(1))
    first.close()
    (tmp_path / "c" / "run" / FINISHED_FILE).unlink()
    again, counter = _run(tmp_path, epochs=10, resume=True)
    with again:
        records = again.fit(_loader(), _loader(1))
    # the newest checkpoint is the best one, of epoch 1: epochs 2 and 3 (3 batches each) train again and
    # patience 2 stops the run again
    assert counter.batches == 2 * 3
    assert again.loop.completed_epochs == 3 and again.loop.stop is not None
    # fit() returns the whole run's records: epoch 1 from the checkpoint, then epochs 2 and 3 trained again
    assert len(records["train"]["loss"]) == 3 and records == again.history


def test_a_run_that_reached_its_target_is_finished_until_the_target_is_raised(tmp_path, capsys):
    """Two epochs of two: resumed with epochs=2 nothing trains and its records come back; with epochs=4
    epochs 3 and 4 train (only their records are returned) and the history covers all four."""
    first, _ = _run(tmp_path, epochs=2, patience=0, save_best=False)
    records = first.fit(_loader(), _loader(1))
    first.close()
    same, counter = _run(tmp_path, epochs=2, resume=True, patience=0, save_best=False)
    with same:
        assert same.fit(_loader(), _loader(1)) == records and counter.batches == 0
    assert "completed 2 of 2 epoch(s)" in capsys.readouterr().out
    more, counter = _run(tmp_path, epochs=4, resume=True, patience=0, save_best=False)
    with more:
        new = more.fit(_loader(), _loader(1))
        assert counter.batches == 2 * 3 and len(new["train"]["loss"]) == 4 and new == more.history
        assert more.history["train"]["loss"][:2] == records["train"]["loss"]
        assert len(more.history["train"]["loss"]) == 4


def test_a_record_older_than_the_checkpoint_or_unreadable_is_ignored(tmp_path):
    """A finished record from before the loaded checkpoint's epoch (stale) or a damaged one does not stop
    the resumed run from training; the damaged one is named in a warning."""
    first, _ = _run(tmp_path, epochs=2, patience=0, save_best=False)
    first.fit(_loader(), _loader(1))
    first.close()
    marker = tmp_path / "c" / "run" / FINISHED_FILE
    data = torch.load(marker, weights_only=True)
    data["completed_epochs"] = 1  # the checkpoint holds epoch 2
    torch.save(data, marker)
    stale, counter = _run(tmp_path, epochs=3, resume=True, patience=0, save_best=False)
    with stale:
        assert len(stale.fit(_loader(), _loader(1))["train"]["loss"]) == 3 and counter.batches == 3
    marker.write_bytes(b"not a torch file")
    damaged, counter = _run(tmp_path, epochs=4, resume=True, patience=0, save_best=False)
    with damaged, pytest.warns(DeepEpochsWarning, match=r"resume ignored .*finished\.pt: cannot read run-end record"
                                                         r" .*truncated or corrupt"):
        assert len(damaged.fit(_loader(), _loader(1))["train"]["loss"]) == 4 and counter.batches == 3


class _Noisy(torch.utils.data.Dataset):
    """Samples with NumPy and `random` noise drawn per item (a resume must replay those draws too)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        noise = torch.from_numpy(np.random.normal(0, 0.05, 4).astype("float32")) * random.random()
        return self.x[i] + noise, self.y[i]


def _best_only_fit(folder, epochs, resume=False):
    """A best-only `CheckCallback('loss', on_stage='val')` run (BatchNorm, dropout, shuffling, noise) whose
    validation loss is best at epoch 2 of 3; returns its records and final weights."""
    set_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 4, generator=g)
    model = nn.Sequential(nn.BatchNorm1d(4), nn.Dropout(0.2), nn.Linear(4, 1))
    check = [] if folder is None else [CheckCallback("loss", on_stage="val", ckpt_dir=folder)]
    with Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.05), epochs=epochs, callbacks=check,
                 resume=resume, running_id=None if resume else "run", log_batch=False) as trainer:
        records = trainer.fit(DataLoader(_Noisy(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=True),
                              DataLoader(TensorDataset(x[:16], 0.6 * x[:16].sum(1, keepdim=True)), batch_size=8))
        return records, {k: v.clone() for k, v in trainer.raw_model.state_dict().items()}


@pytest.mark.parametrize("epochs", [3, 5])
def test_a_finished_run_whose_best_epoch_was_not_its_last_continues_from_the_best_file_like_the_uninterrupted_run(
        tmp_path, capsys, epochs):
    """Three epochs, best at epoch 2 (best-only checkpoint), resumed with epochs=3 or 5: the file's
    progress counts, so epochs 3 onwards train once each under their own labels, and the records and
    weights equal an uninterrupted run of that many epochs bit for bit; the message says why."""
    first, _ = _best_only_fit(tmp_path, 3)
    assert min(range(3), key=first["val"]["loss"].__getitem__) == 1  # the fixture's premise: best at epoch 2
    capsys.readouterr()
    resumed, weights = _best_only_fit(tmp_path, epochs, resume=True)
    out = capsys.readouterr().out
    expected, expected_weights = _best_only_fit(None, epochs)
    assert resumed == expected
    assert all(torch.equal(weights[k], expected_weights[k]) for k in expected_weights)
    labels = [line.split()[1] for line in out.splitlines() if line.startswith("E ")]
    assert labels == [f"{e}/{epochs}" for e in range(3, epochs + 1)]
    assert ("Run run had completed 3 of 3 epoch(s), but its latest state was not saved: its newest checkpoint is"
            " of epoch 2, so the run continues from there and epoch 3 will be trained again") in out
    assert "newest checkpoint is of epoch 2: epoch 3 will be trained again" not in out  # said once


def test_an_early_stopped_run_resumed_from_its_best_epoch_stays_stopped_and_names_the_loaded_epoch(tmp_path, capsys):
    """Stopped early after epoch 3 with its best (and only file) of epoch 1: the resume trains nothing and
    says the weights loaded are those of epoch 1."""
    first, _ = _run(tmp_path, epochs=10)
    records = first.fit(_loader(), _loader(1))
    first.close()
    capsys.readouterr()
    again, counter = _run(tmp_path, epochs=10, resume=True)
    with again:
        assert again.fit(_loader(), _loader(1)) == records and counter.batches == 0
    assert "the weights loaded are those of epoch 1, its checkpoint" in capsys.readouterr().out
