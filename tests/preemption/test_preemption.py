"""A run killed at random moments (SIGKILL) or preempted (SIGTERM), and
resumed each time with `resume=True`, ends bit-identical to the uninterrupted run.

The target (`snapshot_target.py`) trains with shuffle=True, dropout, Adam, a step-wise scheduler and k=3
accumulation, writing a snapshot at every update (`every_n_updates=1`). The reference is the same script
without a SnapshotCallback, run once without interruption.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from state_compare import states_equal  # tests/, on sys.path under pytest

TARGET = Path(__file__).with_name("snapshot_target.py")
KILLS = int(os.environ.get("DEEPEPOCHS_KILLS", "20"))

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")


def _start(ckpt_dir, out, *extra):
    return subprocess.Popen([sys.executable, str(TARGET), str(ckpt_dir), str(out), *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _run_to_end(ckpt_dir, out, *extra):
    proc = _start(ckpt_dir, out, *extra)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    return stdout


EPOCHS = "5"  # 5 x 150 updates: 20 kills at most 0.12 s into each run cannot reach the end (~3 s of training)


def _interrupt(ckpt_dir, out, sig, delay: float, *extra):
    """Start a resumed run (`extra` arguments to the target after `--every 1 --epochs 5`), wait until it trains,
    then `delay` seconds, and send `sig`. Returns the exit status, or None when the run ended before the signal."""
    proc = _start(ckpt_dir, out, "--every", "1", "--epochs", EPOCHS, *extra)
    line = proc.stdout.readline()  # 'training': the imports are done and fit has begun
    while line and line.strip() != "training":  # before it: the resume decision, printed whatever show_info says
        line = proc.stdout.readline()
    assert line.strip() == "training", (line, proc.stderr.read()[-3000:])
    time.sleep(delay)
    if proc.poll() is None:
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=120)
        return proc.returncode, stdout + stderr
    proc.communicate()
    return None, ""


def _same(a, b) -> bool:
    return (all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
            and states_equal(a["opt"], b["opt"]) and a["sched"] == b["sched"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("reference")
    _run_to_end(folder, folder / "ref.pt", "--epochs", EPOCHS)
    return torch.load(folder / "ref.pt", weights_only=True)


def test_sigkill_at_random_moments_then_resume_is_bit_identical(tmp_path, reference):
    rng = random.Random(17)
    for _ in range(KILLS):  # each run is killed 0-0.12 s after it began training (or loading the snapshot)
        code, output = _interrupt(tmp_path, tmp_path / "out.pt", signal.SIGKILL, rng.uniform(0.0, 0.12))
        assert code == -signal.SIGKILL, output[-3000:]
    # The killed runs made progress together: each resumed from the last one's newest snapshot.
    updates = [int(p.name[len("snapshot-u"):][:9]) for p in (tmp_path / "run").glob("snapshot-u*.ckpt")]
    print(f"{KILLS} kills; the newest snapshot is after update {max(updates)} of {int(EPOCHS) * 150}")
    assert max(updates) > KILLS
    _run_to_end(tmp_path, tmp_path / "out.pt", "--every", "1", "--epochs", EPOCHS)
    result = torch.load(tmp_path / "out.pt", weights_only=True)
    assert _same(result, reference)
    # Never more than keep=2 snapshots, and no temporary file left behind by a killed write after the last run.
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert len([n for n in names if n.startswith("snapshot-")]) <= 2, names
    assert not [n for n in names if n.endswith(".tmp")], names


def test_sigterm_stops_at_a_commit_point_with_status_143_and_resumes_bit_identical(tmp_path, reference):
    rng = random.Random(3)
    stops = 0
    for _ in range(3):
        code, output = _interrupt(tmp_path, tmp_path / "out.pt", signal.SIGTERM, rng.uniform(0.05, 0.3))
        if code is None:
            break
        assert code == 128 + signal.SIGTERM, output[-3000:]
        assert "Preempted by SIGTERM at a commit point; snapshot" in output, output[-3000:]
        stops += 1
    assert stops >= 1
    if not (tmp_path / "out.pt").exists():
        _run_to_end(tmp_path, tmp_path / "out.pt", "--every", "1", "--epochs", EPOCHS)
    assert _same(torch.load(tmp_path / "out.pt", weights_only=True), reference)


# Background writes (`async_write=True`), each fsync slowed so that signals land while a write is in flight.
ASYNC = ("--async-write", "--slow-fsync", "0.02")


@pytest.mark.slow
def test_sigkill_during_background_writes_then_resume_is_bit_identical(tmp_path, reference):
    """A SIGKILL while a snapshot is written beside training leaves the snapshots before it complete: each
    resume takes the newest complete one, and the run ends bit-identical to the uninterrupted run."""
    rng = random.Random(29)
    for _ in range(KILLS // 4):
        code, output = _interrupt(tmp_path, tmp_path / "out.pt", signal.SIGKILL, rng.uniform(0.1, 0.5), *ASYNC)
        assert code == -signal.SIGKILL, output[-3000:]
        assert not [p for p in (tmp_path / "run").glob("snapshot-u*.ckpt") if p.stat().st_size == 0]
    updates = [int(p.name[len("snapshot-u"):][:9]) for p in (tmp_path / "run").glob("snapshot-u*.ckpt")]
    assert max(updates) >= KILLS // 4  # the killed runs made progress together
    _run_to_end(tmp_path, tmp_path / "out.pt", "--every", "1", "--epochs", EPOCHS, "--async-write")
    assert _same(torch.load(tmp_path / "out.pt", weights_only=True), reference)
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert len([n for n in names if n.startswith("snapshot-")]) <= 2, names
    assert not [n for n in names if n.endswith(".tmp")], names


@pytest.mark.slow
def test_sigterm_during_a_background_write_exits_143_with_both_snapshots_on_disk(tmp_path, reference):
    """A SIGTERM while a write is in flight: the fit writes its stop snapshot after that write ends and exits
    with 143 once both are on disk; the resume ends bit-identical."""
    code, output = _interrupt(tmp_path, tmp_path / "out.pt", signal.SIGTERM, 0.3, "--async-write", "--slow-fsync",
                              "0.1")
    assert code == 128 + signal.SIGTERM, output[-3000:]
    stop = int(output.split("snapshot-u")[1][:9])  # the snapshot the stop wrote, named in the message
    from deepepochs.checkpoint import read_checkpoint

    files = {int(p.name[len("snapshot-u"):][:9]): p for p in (tmp_path / "run").glob("snapshot-u*.ckpt")}
    assert stop in files and stop - 1 in files, (stop, sorted(files))  # the one in flight at the signal, too
    for path in files.values():
        assert read_checkpoint(path).updates in files
    _run_to_end(tmp_path, tmp_path / "out.pt", "--every", "1", "--epochs", EPOCHS, "--async-write")
    assert _same(torch.load(tmp_path / "out.pt", weights_only=True), reference)
