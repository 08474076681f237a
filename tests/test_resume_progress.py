"""`resume=True` takes the checkpoint that records the most progress (completed epochs, then updates; the
modification time only breaks a tie) and `SnapshotCallback(keep=)` prunes in the same order, so a run
folder copied without its times, or a file dated an hour ahead, neither sends a requeued job back to an
older snapshot nor gets the real progress deleted; a time that disagrees with the progress is warned about."""

import os
import shutil

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, SnapshotCallback, Trainer
from deepepochs.checkpoint import read_checkpoint
from deepepochs.errors import DeepEpochsWarning

EPOCHS = 3
HOUR_NS = 3600 * 10**9


def data():
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(24, 3, generator=g), torch.randn(24, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)  # 6 updates per epoch


class Job(Callback):
    """One job of a requeued run: records where it started (the snapshot count after the resume), and is
    killed after `updates` training batches (None: runs to the end)."""

    def __init__(self, updates=None):
        self.updates, self.done, self.started_at = updates, 0, None

    def on_before_fit(self, trainer, epochs):
        snapshot = next(cb for cb in trainer.callbacks if isinstance(cb, SnapshotCallback))
        self.started_at = (trainer.loop.completed_epochs, snapshot.updates)

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        self.done += 1
        if self.done == self.updates:
            raise RuntimeError("the job was preempted")


def run_job(folder, updates=None):
    """A job of the run `run` in `folder` (resume=True, as a requeued command line is): returns its `Job`
    record and the model's final parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 1))
    job = Job(updates)
    trainer = Trainer(model, F.mse_loss, torch.optim.Adam(model.parameters(), lr=0.01), epochs=EPOCHS,
                      callbacks=[SnapshotCallback(folder, every_n_updates=2, keep=2), job], resume=True,
                      running_id="run", log_batch=False, show_info=False, device="cpu")
    try:
        trainer.fit(data())
    except RuntimeError as error:
        assert "preempted" in str(error)
    finally:
        trainer.close()
    return job, [p.detach().clone() for p in model.parameters()]


def progress(path):
    ckpt = read_checkpoint(path)
    return ckpt.epoch, ckpt.monitors["snapshot"]["updates"]


def snapshots(folder):
    return sorted((folder / "run").glob("snapshot-u*.ckpt"), key=progress)


def date_ahead(path):
    """Give `path` a modification time an hour after now (a clock running ahead)."""
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + HOUR_NS))


def test_three_requeues_with_the_least_progressed_file_dated_an_hour_ahead_continue_and_prune_by_progress(tmp_path):
    """Before each of three requeues the least progressed snapshot is dated an hour ahead: each job warns,
    starts from the most progressed one, its pruning deletes the misdated file and keeps the two most
    progressed, and the run ends with the uninterrupted run's weights."""
    _, expected = run_job(tmp_path / "whole")
    folder = tmp_path / "requeued"
    run_job(folder, updates=5)
    written = {p.name: progress(p) for p in snapshots(folder)}
    for _ in range(3):
        files = snapshots(folder)
        assert len(files) == 2
        misdated, latest = files[0], files[-1]
        resumed_from = progress(latest)  # read now: the job's pruning deletes it
        date_ahead(misdated)
        # warned at the resume, then at the pruning that deletes it
        with pytest.warns(DeepEpochsWarning, match=f"{misdated.name} is dated after .* but records less progress"):
            job, _ = run_job(folder, updates=5)
        assert job.started_at == resumed_from  # continued from the most progressed file, not the newest
        assert not misdated.exists()
        written.update({p.name: progress(p) for p in snapshots(folder)})
        assert [progress(p) for p in snapshots(folder)] == sorted(written.values())[-2:]
    job, weights = run_job(folder)
    assert job.started_at[0] == EPOCHS - 1  # four jobs of 5 updates: the last one starts in the last epoch
    for got, want in zip(weights, expected):
        assert torch.equal(got, want)


def test_a_run_folder_copied_without_its_times_resumes_its_most_progressed_snapshot(tmp_path):
    """A copy that does not keep the times (the most progressed file copied first, so it is the oldest):
    resume=True from the copy continues from the most progressed file and ends exact."""
    _, expected = run_job(tmp_path / "whole")
    original = tmp_path / "original"
    run_job(original, updates=8)
    files = snapshots(original)
    most = progress(files[-1])
    copy = tmp_path / "copy" / "run"
    copy.mkdir(parents=True)
    for path in reversed(files):  # most progressed first: its copy gets the oldest time
        shutil.copyfile(path, copy / path.name)
    base = (copy / files[-1].name).stat().st_mtime_ns
    for offset, path in enumerate(reversed(files)):  # times a few seconds apart, least progressed newest
        os.utime(copy / path.name, ns=(base + offset * 10**9, base + offset * 10**9))
    with pytest.warns(DeepEpochsWarning, match="records less progress"):
        job, weights = run_job(tmp_path / "copy")
    assert job.started_at == most
    for got, want in zip(weights, expected):
        assert torch.equal(got, want)


def test_a_fresh_run_named_like_a_finished_one_resumes_its_own_files_not_the_older_runs(tmp_path):
    """A run started afresh (resume=False) in a folder holding a longer run of the same name: its requeue
    continues from its own snapshot, although the older run's files record more epochs."""
    run_job(tmp_path)  # the older run, finished: its files record 3 epochs
    older = {p.name for p in snapshots(tmp_path)}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.2), nn.Tanh(), nn.Linear(8, 1))
    fresh = Trainer(model, F.mse_loss, torch.optim.Adam(model.parameters(), lr=0.01), epochs=EPOCHS,
                    callbacks=[SnapshotCallback(tmp_path, every_n_updates=2, keep=2), Job(5)], resume=False,
                    running_id="run", log_batch=False, show_info=False, device="cpu")
    with pytest.raises(RuntimeError, match="preempted"):
        fresh.fit(data())
    fresh.close()
    own = {p.name for p in snapshots(tmp_path)} - older
    assert own == {"snapshot-u000000002.ckpt", "snapshot-u000000004.ckpt"}  # pruning kept the fresh run's
    job, _ = run_job(tmp_path, updates=1)
    assert job.started_at == (0, 4)
