"""Resume as a requeued job uses it: `resume=True` with a `running_id` is scoped to that run (fresh when it
has no files, never another run's files); `fit()` returns the whole run's records in every case; a resume
says which run it loaded, from where and why, where inside an epoch it continues, and which epochs it
trains again when only a best-epoch checkpoint was kept."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, CheckCallback, SnapshotCallback, Trainer

N, BATCH, LR = 48, 8, 0.05


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 4, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(N, 1, generator=g)


def _loader(seed=0):
    return DataLoader(TensorDataset(*_data(seed)), batch_size=BATCH)


def _model():
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def _plain(epochs):
    """Plain PyTorch: SGD on the same batches; final weights and per-epoch sample-weighted train losses."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(epochs):
        total = 0.0
        for x, y in _loader():
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(x)
        losses.append(total / N)
    return model.state_dict(), losses


class CountBatches(Callback):
    def __init__(self):
        self.batches = 0

    def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
        self.batches += 1


class CrashAt(Callback):
    """Raises at the first training batch of 1-based epoch `epoch` (a job killed there)."""

    def __init__(self, epoch):
        self.epoch = epoch

    def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
        if trainer.loop.epoch == self.epoch:
            raise RuntimeError("killed")


def _trainer(folder, epochs, running_id=None, resume=True, save_best=False, mode="min", callbacks=()):
    model = _model()
    check = CheckCallback("loss", on_stage="val", mode=mode, save_best=save_best, ckpt_dir=folder)
    return Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=LR), epochs=epochs,
                   callbacks=[check, *callbacks], running_id=running_id, resume=resume, log_batch=False)


def test_resume_true_with_a_running_id_takes_only_that_runs_files_and_starts_it_fresh_without_them(tmp_path,
                                                                                                  capsys):
    """Two jobs share a ckpt_dir: 'ref' finished; 'pre' (resume=True) starts fresh instead of returning
    'ref's records, is preempted, and its requeue (same command) resumes 'pre' and ends where an
    uninterrupted plain PyTorch loop ends, with the whole run's records."""
    with _trainer(tmp_path, 3, "ref") as ref:
        ref.fit(_loader(), _loader(1))
    capsys.readouterr()
    counter = CountBatches()
    pre = _trainer(tmp_path, 4, "pre", callbacks=[counter, CrashAt(3)])
    with pytest.raises(RuntimeError, match="killed"):
        pre.fit(_loader(), _loader(1))
    pre.close()
    assert counter.batches == 2 * N // BATCH + 1  # epochs 1 and 2 (and the batch that crashed): not 'ref's run
    out = capsys.readouterr().out
    assert "resume=True with running_id='pre': no checkpoint found" in out and "starting run pre fresh" in out
    counter = CountBatches()
    with _trainer(tmp_path, 4, "pre", callbacks=[counter]) as requeued:
        records = requeued.fit(_loader(), _loader(1))
        assert requeued.running_id == "pre" and counter.batches == 2 * N // BATCH  # epochs 3 and 4
    out = capsys.readouterr().out
    assert f"Resumed run pre (resume=True with running_id='pre') from {tmp_path / 'pre'}" in out
    assert "2 epoch(s) completed, continuing with epoch 3" in out
    weights, losses = _plain(4)
    for name, value in requeued.raw_model.state_dict().items():
        torch.testing.assert_close(value, weights[name], msg=name)
    assert records["train"]["loss"] == pytest.approx(losses, rel=1e-5)  # all four epochs
    assert len(records["val"]["loss"]) == 4


def test_resume_true_without_a_running_id_still_takes_the_newest_run(tmp_path, capsys):
    """Without a running_id, resume=True loads the newest checkpoint of any run and says so."""
    with _trainer(tmp_path, 2, "only") as first:
        first.fit(_loader(), _loader(1))
    with _trainer(tmp_path, 3) as again:
        records = again.fit(_loader(), _loader(1))
        assert again.running_id == "only" and len(records["train"]["loss"]) == 3
    assert "Resumed run only (resume=True without a running_id: the newest checkpoint of any run)" in \
        capsys.readouterr().out


def test_a_resume_whose_file_already_reached_the_fits_target_says_so_and_trains_nothing(tmp_path, capsys):
    """A run stopped at its last epoch's end (a snapshot, no finished-run record): the same command again
    loads that file, says the fit's target is reached (not "continuing with epoch 3") and trains no batch."""
    model = _model()
    snapshots = SnapshotCallback(tmp_path, every_n_updates=None)
    with Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=LR), epochs=2, callbacks=[snapshots],
                 running_id="run", resume=True, log_batch=False) as first:
        first.fit(_loader(), _loader(1))
    capsys.readouterr()
    model, counter = _model(), CountBatches()
    with Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=LR), epochs=2,
                 callbacks=[SnapshotCallback(tmp_path, every_n_updates=None), counter], running_id="run",
                 resume=True, log_batch=False) as again:
        records = again.fit(_loader(), _loader(1))
    out = capsys.readouterr().out
    assert "2 epoch(s) completed, the fit's target of 2 epoch(s) is reached" in out, out
    assert "continuing" not in out
    assert counter.batches == 0 and len(records["train"]["loss"]) == 2
    weights, _ = _plain(2)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, weights[name], msg=name)


def test_a_resume_from_an_older_best_checkpoint_says_which_epochs_are_trained_again(tmp_path, capsys):
    """Only a save_best monitor whose best is epoch 1 (mode='max' on a falling loss); the job dies in epoch
    4, so epochs 2 and 3 were done: the resume says they are trained again and why, and trains them."""
    crashed = _trainer(tmp_path, 5, "run", save_best=True, mode="max", callbacks=[CrashAt(4)])
    with pytest.raises(RuntimeError, match="killed"):
        crashed.fit(_loader(), _loader(1))
    crashed.close()
    capsys.readouterr()
    counter = CountBatches()
    with _trainer(tmp_path, 5, "run", save_best=True, mode="max", callbacks=[counter]) as resumed:
        records = resumed.fit(_loader(), _loader(1))
    out = capsys.readouterr().out
    assert "1 epoch(s) completed, continuing with epoch 2" in out
    assert ("Run run had completed 3 epoch(s), but its newest checkpoint is of epoch 1: epochs 2 to 3 will be"
            " trained again") in out
    assert "save_best=True saves only improving epochs" in out
    assert counter.batches == 4 * N // BATCH and len(records["train"]["loss"]) == 5
    weights, _ = _plain(5)
    for name, value in resumed.raw_model.state_dict().items():
        torch.testing.assert_close(value, weights[name], msg=name)


def test_fit_after_predict_on_a_resumed_finished_run_returns_the_runs_records(tmp_path):
    """predict() loads a pending resume (the finished run's weights); the fit after it trains nothing and
    returns the run's records, not empty ones."""
    with _trainer(tmp_path, 2, "done") as first:
        expected = first.fit(_loader(), _loader(1))
        want = first.raw_model(_data()[0]).detach()
    counter = CountBatches()
    with _trainer(tmp_path, 2, "done", callbacks=[counter]) as again:
        torch.testing.assert_close(again.predict(_loader()), want)
        assert again.fit(_loader(), _loader(1)) == expected and counter.batches == 0


class Stop(Callback):
    """Raises after training batch `batch` (0-based) of 1-based epoch `epoch`."""

    def __init__(self, epoch, batch):
        self.epoch, self.batch = epoch, batch

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if trainer.loop.epoch == self.epoch and batch_idx == self.batch:
            raise RuntimeError("killed")


def test_a_mid_epoch_resume_says_where_inside_the_epoch_it_continues_and_is_exact(tmp_path, capsys):
    """A fault in update 3 of epoch 2 (k=2) leaves the snapshot of update 2: the resume line says so, and the run ends
    as the uninterrupted one does, records included (dropout, shuffling and NumPy/random draws)."""

    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.Linear(8, 1))

        def forward(self, x):
            noise = float(np.random.rand()) + random.random()
            return self.body(x) + 1e-3 * noise

    def make(callbacks, resume):
        torch.manual_seed(0)
        np.random.seed(0)
        random.seed(0)
        model = Noisy()
        cbs = [SnapshotCallback(tmp_path, every_n_updates=1), *callbacks]
        return Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=LR), epochs=3, callbacks=cbs,
                       running_id="mid", resume=resume, gradient_accumulation_steps=2, log_batch=False)

    def shuffled():
        return DataLoader(TensorDataset(*_data()), batch_size=4, shuffle=True)

    with make([], False) as whole:
        reference = whole.fit(shuffled())
        weights = {k: v.clone() for k, v in whole.raw_model.state_dict().items()}
    first = make([Stop(2, 5)], False)
    with pytest.raises(RuntimeError, match="killed"):
        first.fit(shuffled())
    first.close()
    capsys.readouterr()
    with make([], True) as resumed:
        records = resumed.fit(shuffled())
        got = resumed.raw_model.state_dict()
    out = capsys.readouterr().out
    # the failing window (batches 5-6) was discarded: the snapshot is of update 2 of epoch 2
    assert ("snapshot-u000000008.ckpt: 1 epoch(s) completed, continuing epoch 2 at its update 3 (after 4 batch(es);"
            " update 9 of the run)") in out
    assert records == reference
    for name, value in got.items():
        assert torch.equal(value, weights[name]), name
