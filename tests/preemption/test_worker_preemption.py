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


# ---- validation workers: the same stop, one stage over ------------------------------------------------------
@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The uninterrupted run (validation without workers: the weights do not depend on them)."""
    folder = tmp_path_factory.mktemp("reference")
    return _run_to_end(folder / "ckpt", folder / "ref.pt", "--epochs", EPOCHS)


def _wait_for_line(proc, prefix: str) -> None:
    while True:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()[-3000:]
        if line.startswith(prefix):
            return


@pytest.mark.parametrize(("context", "sig"), [("fork", signal.SIGTERM), ("spawn", signal.SIGTERM),
                                              ("spawn", signal.SIGUSR1)])
def test_the_job_signalled_during_validation_with_workers_stops_at_the_epochs_last_update(tmp_path, reference_run,
                                                                                        context, sig):
    """The signal kills the validation DataLoader's workers, so validation cannot finish: the fit ends with
    `Preempted` (128 + the signal) and a snapshot of the epoch's last update (its training stage done), not
    with torch's worker error; the resumed run validates that epoch again and ends bit-identical."""
    if context not in multiprocessing.get_all_start_methods():
        pytest.skip(f"start method {context!r} is not available here")
    from deepepochs.checkpoint import read_checkpoint  # noqa: PLC0415

    val = ("--val-workers", "2", "--val-context", context)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out.pt"
    proc = _start(ckpt, out, *val, "--val-slow", "0.02", "--every", "1000", "--epochs", EPOCHS)
    _wait_for_line(proc, "val-worker ")  # the first epoch's validation runs
    time.sleep(0.3)
    os.killpg(proc.pid, sig)
    stdout, stderr = proc.communicate(timeout=120)
    name = signal.Signals(sig).name
    assert proc.returncode == 128 + sig, stderr[-3000:]
    assert f"Preempted by {name} at a commit point; snapshot" in stderr, stderr[-3000:]
    # (with spawn, multiprocessing's resource tracker, in the job too, may print its own KeyError when a
    # SIGUSR1 ended it: not the fit's)
    assert "exited unexpectedly" not in stderr and "RuntimeError" not in stderr, stderr[-3000:]
    snapshots = sorted((ckpt / "run").glob("snapshot-*.ckpt"))
    assert [p.name for p in snapshots] == ["snapshot-u000000050.ckpt"]  # 150 batches / k=3: epoch 1's last update
    position = read_checkpoint(snapshots[0]).position
    assert (position["epoch"], position["task_index"], position["batches_done"]) == (1, 0, 150)  # training done
    assert_same_run(_run_to_end(ckpt, out, *val, "--every", "1000", "--epochs", EPOCHS), reference_run)


_EVALUATE_SCRIPT = """
import sys, time
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import deepepochs as de
sys.path.insert(0, {folder!r})
from snapshot_target import SlowData

def ready(worker_id):
    print("eval-worker", worker_id, flush=True)

x, y = torch.randn(64, 8), torch.randint(0, 4, (64,))
model = nn.Linear(8, 4)
trainer = de.Trainer(model, nn.functional.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                     callbacks=[de.SnapshotCallback({ckpt!r})], log_batch=False, show_info=False)
data = DataLoader(SlowData(TensorDataset(x, y), 0.05), batch_size=8, num_workers=2,
                  multiprocessing_context="fork", worker_init_fn=ready)
getattr(trainer, sys.argv[1])(data)
print("finished", flush=True)
"""


@pytest.mark.parametrize("stage", ["test", "predict"])
def test_the_job_signalled_during_test_or_predict_with_workers_ends_by_the_signal(tmp_path, stage):
    """test() and predict() listen for no signal (a SnapshotCallback arms its signals during fit only): the
    job's SIGTERM has its default effect, the process ends killed by it, as documented."""
    script = tmp_path / "evaluate.py"
    script.write_text(_EVALUATE_SCRIPT.format(folder=str(TARGET.parent), ckpt=str(tmp_path / "ckpt")))
    proc = subprocess.Popen([sys.executable, str(script), stage], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    _wait_for_line(proc, "eval-worker ")
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGTERM, stderr[-3000:]
    assert "finished" not in stdout
