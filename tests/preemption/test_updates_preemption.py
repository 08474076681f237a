"""A job training by updates (`Trainer(max_updates=30)`, `fit(val_every_n_updates=7)`) over a stream drawn
with replacement from its sampler's own generator, sent a real SIGTERM at a random update and resumed in a
fresh process, ends bit-identical to the job never stopped: every model, optimizer and scheduler tensor,
every validation point's row and the training record. The job never stopped is itself the plain PyTorch loop
a user writes for it, bit for bit (in one process and in `DistributedDataParallel`).

The target (`updates_target.py`) has dropout and BatchNorm, noise from torch's, NumPy's and Python's
generators in its training step, Adam with a step-wise StepLR and windows of 2 batches; its process waits
at the chosen batch (or validation point) until the test's SIGTERM has reached its `SnapshotCallback`.
Signals fall inside an accumulation window (the window's first batch ran: its micro-batches, and what
they drew, are dropped), at a window's end, and inside a validation point between updates; the job runs in
one process, with 2 fork DataLoader workers, over torchdata's `StatefulDataLoader`, and as 2 DDP processes
(gloo, `launch`; the signal reaches rank 1 only).

`make test` runs a quick set (a signal inside a window in each of one process, fork workers and DDP, and
the plain loops: about 20 processes, a minute of CPU); `DEEPEPOCHS_UPDATES_PREEMPTION=full` (`make
updates-preemption`) runs every stream at several seeded random positions.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from state_compare import states_equal  # tests/, on sys.path under pytest

TARGET = Path(__file__).with_name("updates_target.py")
UPDATES, EVERY, K = 30, 7, 2  # the target's budget, validation interval and window
FULL = os.environ.get("DEEPEPOCHS_UPDATES_PREEMPTION", "") == "full"

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name == "nt", reason="POSIX signals")


def _env():
    """This checkout on the target's path; no torchrun variables (a `--ddp` job starts its own group)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                            "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _command(folder, *options):
    return [sys.executable, str(TARGET), str(folder), str(folder / "out.pt"), *options]


def _run(folder, *options) -> dict:
    """Run the target to its end in a fresh process; what it saved."""
    proc = subprocess.run(_command(folder, *options), capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(folder / "out.pt", weights_only=False)


def _stopped(folder, *options) -> str:
    """Run the target until it says it waits at its signal point, send that process SIGTERM, and check that
    the job stopped with a snapshot and status 143; its output."""
    proc = subprocess.Popen(_command(folder, "--snapshots", *options), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())
    try:
        line = proc.stdout.readline()
        while line and not line.startswith(("at ", "in-val ")):
            line = proc.stdout.readline()
        assert line, proc.stderr.read()[-3000:]
        os.kill(int(line.split()[-1]), signal.SIGTERM)  # a real signal to the waiting process (rank 1 under DDP)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert "Preempted by SIGTERM at a commit point; snapshot" in stdout + stderr, stderr[-3000:]
    return stdout + stderr


def _assert_same_run(got, want):
    for key in ("model", "opt", "sched", "records", "updates"):
        assert states_equal(got[key], want[key]), key
    assert got["updates"] == UPDATES and got["records"]["val"]["updates"] == [7, 14, 21, 28, 30]


STREAMS = {  # name: the target's options (DataLoader, processes)
    "one-process": (),
    "fork-workers": ("--workers", "2"),
    "stateful-loader": ("--stateful",),
    "ddp": ("--ddp",),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The job never stopped, per stream kind: one process (with or without workers, over a DataLoader or
    torchdata's: the same numbers, since nothing is drawn while loading) or 2 DDP processes."""
    runs = {}

    def run(ddp: bool):
        if ddp not in runs:
            folder = tmp_path_factory.mktemp("reference")
            runs[ddp] = _run(folder, *(("--ddp",) if ddp else ()))
        return runs[ddp]

    return run


def _positions(stream: str, count: int) -> list:
    """Seeded random training batches to signal after: the first batch of a window (inside it) or its last
    (at its end), never the run's first window or its last; distinct (each has a folder of its own)."""
    return random.Random(stream).sample(range(3, 2 * UPDATES - 2), count)


QUICK = [("one-process", "inside-window"), ("fork-workers", "inside-window"), ("ddp", "inside-window")]
CASES = [(stream, where) for stream in STREAMS for where in ("inside-window", "window-end", "in-validation")]


@pytest.mark.parametrize(("stream", "where"), [c for c in CASES if FULL or c in QUICK],
                         ids=[f"{s}-{w}" for s, w in CASES if FULL or (s, w) in QUICK])
def test_a_sigterm_at_a_random_update_then_a_resume_in_a_fresh_process_ends_as_the_job_never_stopped(
        tmp_path, reference, stream, where):
    """SIGTERM inside a window (after its first batch), at a window's end or during a validation point at a
    seeded random update; the resumed job (a new process, resume=True) ends with the uninterrupted job's
    every tensor, validation row and training record."""
    if stream == "fork-workers" and "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("needs the fork start method")
    if stream == "stateful-loader":
        pytest.importorskip("torchdata.stateful_dataloader")
    options = STREAMS[stream]
    for batch in _positions(f"{stream}-{where}", 3 if FULL else 1):
        folder = tmp_path / str(batch)
        folder.mkdir()
        if where == "in-validation":
            signal_at = ("--signal-in-val", str(EVERY * (1 + batch % 3)))  # the point after update 7, 14 or 21
        else:
            signal_at = ("--signal-at", str(batch - batch % K + (1 if where == "inside-window" else K)))
        _stopped(folder, *options, *signal_at)
        _assert_same_run(_run(folder, "--snapshots", *options), reference(stream == "ddp"))


@pytest.mark.parametrize("ddp", [False, True], ids=["one-process", "ddp"])
def test_the_job_never_stopped_trains_as_the_plain_pytorch_loop(tmp_path, reference, ddp):
    """The reference of the resumes: the plain loop (30 updates of 2 batches, each batch's loss halved, the
    validation loss after every 7th update and the last, the epoch's mean training loss; under DDP the model
    in `DistributedDataParallel` with `no_sync` inside a window, the validation sums over the ranks) gives
    the same weights, buffers, optimizer and scheduler states and records as the Trainer, bit for bit."""
    _assert_same_run(_run(tmp_path, "--plain", *(("--ddp",) if ddp else ())), reference(ddp))
