"""One run, one writer: a fit locks its run's folders (`deepepochs.checkpoint.run_lock`).

The acceptance tests start real processes on one run (the preemption target, tests/preemption): a second
one fails naming the first, or waits for it and resumes from its snapshot; a SIGKILLed holder's lock is
taken over by the next process, which resumes. The others check, in one process against a lock held
through a second descriptor (flock treats it as another holder), what takes the lock and what does not.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import CheckCallback, ConfigError, LogCallback, RunLockedError, SnapshotCallback, Trainer
from deepepochs.checkpoint.run_lock import LOCK_FILE, RunLock

TARGET = Path(__file__).parent / "preemption" / "snapshot_target.py"

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL") or os.name == "nt", reason="needs POSIX flock")


def _start(ckpt_dir, *extra):
    """The target training run `run` under `ckpt_dir`: slow enough data that it holds its lock for seconds."""
    return subprocess.Popen([sys.executable, str(TARGET), str(ckpt_dir), str(Path(ckpt_dir).parent / "out.pt"),
                             "--every", "5", "--slow-data", "0.01", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _until_training(proc) -> str:
    """Read `proc`'s output up to its 'training' line (its fit began, so it holds the lock); returns it."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.strip() == "training":
            return "".join(seen)
    raise AssertionError(f"the run never trained: {''.join(seen)}{proc.stderr.read()[-3000:]}")


def _wait_for_snapshot(folder: Path, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not list(folder.glob("snapshot-u*.ckpt")):
        assert time.monotonic() < deadline, "the holder wrote no snapshot"
        time.sleep(0.05)


def test_a_second_process_training_the_same_run_fails_naming_the_holder(tmp_path):
    """While one process trains run `run`, a second one on the same folder stops before training with
    `RunLockedError` naming the holder's pid, host, start time and lock file; the holder goes on."""
    ckpt = tmp_path / "ckpt"
    holder = _start(ckpt)
    try:
        _until_training(holder)
        second = subprocess.run([sys.executable, str(TARGET), str(ckpt), str(tmp_path / "second.pt"), "--every", "5"],
                                capture_output=True, text=True, timeout=120)
        assert second.returncode == 1
        assert "training" not in second.stdout
        message = second.stderr.strip().splitlines()[-1]
        assert message.startswith("deepepochs.errors.RunLockedError: run 'run' is being trained by another process:"
                                  f" pid {holder.pid} on host {socket.gethostname()}, since 20")
        assert f"lock file {ckpt / 'run' / LOCK_FILE}" in message and "run_lock='wait'" in message
        assert holder.poll() is None
    finally:
        holder.kill()
        holder.communicate()


def test_a_sigkilled_holders_lock_is_taken_over_and_the_run_resumes(tmp_path):
    """kill -9 leaves the lock file behind, but the kernel released the lock: the next process takes it
    over (saying whose it was), resumes from the last snapshot, finishes and removes the lock file."""
    ckpt = tmp_path / "ckpt"
    holder = _start(ckpt, "--workers", "2", "--context", "fork")  # forked workers must not keep the lock
    _until_training(holder)
    _wait_for_snapshot(ckpt / "run")
    holder.kill()
    holder.communicate()
    left = json.loads((ckpt / "run" / LOCK_FILE).read_text())
    assert left["pid"] == holder.pid and left["running_id"] == "run"
    nxt = subprocess.run([sys.executable, str(TARGET), str(ckpt), str(tmp_path / "next.pt"), "--every", "5"],
                         capture_output=True, text=True, timeout=300)
    assert nxt.returncode == 0, nxt.stderr[-3000:]
    assert (f"deepepochs: took over the run lock {ckpt / 'run' / LOCK_FILE} of run 'run', left by pid {holder.pid}"
            f" on host {socket.gethostname()}") in nxt.stdout
    assert "Resumed run run" in nxt.stdout and "continuing epoch 1 at its update" in nxt.stdout
    assert not (ckpt / "run" / LOCK_FILE).exists()


def test_a_waiting_process_trains_once_the_holder_is_preempted_and_resumes_its_snapshot(tmp_path):
    """run_lock='wait': the requeued job waits while its predecessor runs; SIGTERM stops the predecessor
    with its snapshot (exit 143), and the waiting job then resumes from that snapshot and finishes."""
    ckpt = tmp_path / "ckpt"
    holder = _start(ckpt)
    _until_training(holder)
    waiting = _start(ckpt, "--run-lock", "wait")
    try:
        line = waiting.stdout.readline()
        assert line.startswith(f"deepepochs: waiting for run 'run', which another process trains: pid {holder.pid}")
        _wait_for_snapshot(ckpt / "run")
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(timeout=120) == 143
        stdout, stderr = waiting.communicate(timeout=300)
    finally:
        for proc in (holder, waiting):
            proc.kill()
    assert waiting.returncode == 0, stderr[-3000:]
    assert "Resumed run run" in stdout and "took over" not in stdout
    assert not (ckpt / "run" / LOCK_FILE).exists()


# ---- in one process ----

def _data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _trainer(tmp_path, **kwargs):
    callbacks = [CheckCallback("loss", on_stage="train", ckpt_dir=tmp_path / "ckpt"),
                 LogCallback(log_dir=tmp_path / "logs")]
    return Trainer(nn.Linear(4, 2), F.cross_entropy, epochs=1, callbacks=callbacks, running_id="run",
                   log_batch=False, show_info=False, **kwargs)


@pytest.fixture
def held(tmp_path):
    """Run `run`'s checkpoint folder locked through another descriptor, as another process would hold it."""
    other = RunLock([tmp_path / "ckpt" / "run"], "run")
    assert other.try_acquire() == (None, [])
    yield other
    other.release()


def test_fit_locks_the_checkpoint_and_log_folders_while_it_runs_and_removes_the_lock_files(tmp_path):
    """Both run folders hold a lock file naming this process during the fit, and none after it."""
    seen = []

    class Look(CheckCallback):
        def on_before_epoch(self, trainer, *args):
            seen.extend(json.loads(p.read_text())["pid"] for p in tmp_path.glob(f"*/run/{LOCK_FILE}"))

    trainer = _trainer(tmp_path)
    trainer.add_callbacks([Look("loss", on_stage="train", save_best=False, ckpt_dir=tmp_path / "ckpt")])
    trainer.fit(_data())
    trainer.close()
    assert seen == [os.getpid(), os.getpid()]
    assert not list(tmp_path.glob(f"*/run/{LOCK_FILE}"))
    assert (tmp_path / "ckpt" / "run" / "train-loss.best.ckpt").exists()


def test_a_fit_refused_by_the_lock_writes_nothing_and_the_trainer_can_fit_later(held, tmp_path):
    """RunLockedError comes before the fit's first write; once the holder is gone the same trainer fits."""
    trainer = _trainer(tmp_path)
    with pytest.raises(RunLockedError, match=f"pid {os.getpid()} on host .*lock file {tmp_path}"):
        trainer.fit(_data())
    assert sorted(p.name for p in (tmp_path / "ckpt" / "run").iterdir()) == [LOCK_FILE]
    assert not (tmp_path / "logs").exists()
    held.release()
    trainer.fit(_data())
    trainer.close()
    assert trainer.loop.completed_epochs == 1


def test_test_predict_and_find_lr_take_no_lock(held, tmp_path):
    """They write no checkpoint, so they run while another process trains the run."""
    trainer = _trainer(tmp_path)
    data = _data()
    assert "loss" in trainer.test(data)
    assert trainer.predict(data).shape == (32, 2)
    assert len(trainer.find_lr(data, num_steps=3, plot=False).lrs) == 3
    trainer.close()


def test_resume_true_without_a_running_id_locks_the_run_it_will_load(tmp_path):
    """The resume's run (the newest checkpoint's, 'old'), not the trainer's start-time name, is locked
    before it loads: a refusal names it."""
    first = _trainer(tmp_path)
    first.running_id = "old"
    first.fit(_data())
    first.close()
    other = RunLock([tmp_path / "ckpt" / "old"], "old")
    other.try_acquire()
    try:
        trainer = Trainer(nn.Linear(4, 2), F.cross_entropy, epochs=2, resume=True, log_batch=False, show_info=False,
                          callbacks=[CheckCallback("loss", on_stage="train", ckpt_dir=tmp_path / "ckpt")])
        with pytest.raises(RunLockedError, match="run 'old' is being trained by another process"):
            trainer.fit(_data())
        assert trainer.loop.completed_epochs == 0, "refused before the resume loaded anything"
    finally:
        other.release()


def test_run_lock_off_trains_while_the_run_is_locked(held, tmp_path):
    """run_lock='off' takes no lock (file systems without flock)."""
    trainer = _trainer(tmp_path, run_lock="off")
    trainer.fit(_data())
    trainer.close()
    assert trainer.loop.completed_epochs == 1


def test_a_snapshot_callback_folder_is_locked_too(tmp_path):
    """A SnapshotCallback's `<ckpt_dir>/<running_id>` is a run folder like a CheckCallback's."""
    other = RunLock([tmp_path / "snaps" / "run"], "run")
    other.try_acquire()
    try:
        trainer = Trainer(nn.Linear(4, 2), F.cross_entropy, epochs=1, running_id="run", log_batch=False,
                          show_info=False, callbacks=[SnapshotCallback(tmp_path / "snaps", on_signals=())])
        with pytest.raises(RunLockedError, match="is being trained by another process"):
            trainer.fit(_data())
    finally:
        other.release()


def test_a_bad_run_lock_names_the_argument_and_the_choices():
    """The constructor refuses an unknown mode, naming the argument, the choices and the value."""
    with pytest.raises(ConfigError, match=r"run_lock must be one of 'error', 'wait', 'off' \(got 'yes'\)"):
        Trainer(nn.Linear(4, 2), F.cross_entropy, run_lock="yes")
