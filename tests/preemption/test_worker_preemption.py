"""A scheduler signals the whole job: the training process and its DataLoader workers get the signal at
once (`os.killpg` on the job's process group, as SLURM does at a time limit or on `scancel`). The fit still
stops at a commit point with `Preempted` (status 143 for SIGTERM), and the resumed run ends bit-identical
to an uninterrupted run on every model, optimizer and scheduler tensor: fork, spawn and forkserver workers,
persistent or not, with and without accumulation, a sampler drawing with replacement from its own generator,
and a worker killed alone by a listed signal.

The target is `snapshot_target.py` (its workers print `worker <id>` when they start); the reference is the
same script with the same DataLoader, without a SnapshotCallback, run once without interruption.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from state_compare import assert_same_run  # tests/, on sys.path under pytest

TARGET = Path(__file__).with_name("snapshot_target.py")
EPOCHS = "3"
# The interrupted runs load each sample in 5 ms (1-1.5 s an epoch with 2-3 workers, against 0.4 s at full
# speed): a signal sent 0.3 s after the workers started reaches them while they still load the first epoch,
# not while they exit at its end. The results are the same; the resumed runs go at full speed.
SLOW = ("--slow-data", "0.005")

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg") or not hasattr(os, "waitid"),
                                reason="needs POSIX process groups and waitid")

CONFIGS = {  # name: the DataLoader and accumulation options of the target
    "fork": ("--workers", "2", "--context", "fork"),
    "fork-persistent-k1": ("--workers", "2", "--context", "fork", "--persistent", "--accumulate", "1"),
    "spawn": ("--workers", "2", "--context", "spawn"),
    "forkserver-persistent": ("--workers", "3", "--context", "forkserver", "--persistent"),
    "fork-replacement": ("--workers", "2", "--context", "fork", "--replacement"),  # a sampler with replacement
}


def _start(ckpt_dir, out, *extra):
    # a session of its own: the job's process group, which the scheduler signals as a whole
    return subprocess.Popen([sys.executable, str(TARGET), str(ckpt_dir), str(out), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _run_to_end(ckpt_dir, out, *extra):
    proc = _start(ckpt_dir, out, *extra)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    return torch.load(out, weights_only=True)


def _wait_for_workers(proc, workers: int) -> None:
    """Read the target's lines until the fit began and `workers` DataLoader workers started."""
    seen = set()
    while len(seen) < workers:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-3000:]
        if line.startswith("worker "):
            seen.add(line.split()[1])


def _skip_unavailable(config):
    args = CONFIGS[config]
    method = args[args.index("--context") + 1]
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"start method {method!r} is not available here")
    return args


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_whole_process_group_signalled_stops_with_143_and_resumes_bit_identical(tmp_path, config):
    """SIGTERM to the job's process group while workers run: `Preempted` (143) and a snapshot; the resumed
    run equals the uninterrupted one."""
    args = _skip_unavailable(config)
    reference = _run_to_end(tmp_path / "ref", tmp_path / "ref.pt", *args, "--epochs", EPOCHS)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out.pt"
    proc = _start(ckpt, out, *args, "--every", "7", "--epochs", EPOCHS, *SLOW)
    _wait_for_workers(proc, int(args[1]))
    time.sleep(0.3)  # inside the first epoch's training
    os.killpg(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Preempted by SIGTERM at a commit point; snapshot" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert not out.exists()  # it stopped before the end
    assert_same_run(_run_to_end(ckpt, out, *args, "--every", "7", "--epochs", EPOCHS), reference)


def _worker_pids(proc):
    """The pids of the target's DataLoader workers, once it runs two (skips where /proc cannot list them)."""
    _wait_for_workers(proc, 2)
    time.sleep(0.3)
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
    if not children.exists():
        proc.kill()
        pytest.skip("needs /proc to find the workers")
    workers = [int(pid) for pid in children.read_text().split()]
    assert workers, "the target runs no worker"
    return workers


def test_a_worker_killed_alone_by_a_listed_signal_is_a_preemption(tmp_path):
    """Only one DataLoader worker gets SIGTERM (the scheduler reached it first): the fit stops at a commit
    point with `Preempted`, not with torch's worker error, and the resume is exact."""
    args = CONFIGS["fork"]
    reference = _run_to_end(tmp_path / "ref", tmp_path / "ref.pt", *args, "--epochs", EPOCHS)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out.pt"
    proc = _start(ckpt, out, *args, "--every", "7", "--epochs", EPOCHS, *SLOW)
    os.kill(_worker_pids(proc)[0], signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Preempted by SIGTERM at a commit point; snapshot" in stderr, stderr[-3000:]
    assert_same_run(_run_to_end(ckpt, out, *args, "--every", "7", "--epochs", EPOCHS), reference)


def test_a_worker_that_fails_on_its_own_is_still_a_data_error(tmp_path):
    """A worker killed by a signal the callback does not list (SIGKILL: the kernel's out-of-memory killer)
    is torch's worker error as before: the fit fails, no `Preempted`."""
    args = CONFIGS["fork"]
    proc = _start(tmp_path / "ckpt", tmp_path / "out.pt", *args, "--every", "7", "--epochs", EPOCHS, *SLOW)
    os.kill(_worker_pids(proc)[0], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1, stderr[-3000:]
    assert "DataLoader worker" in stderr and "Preempted" not in stderr, stderr[-3000:]
