"""A real single-node SLURM for the tests in this folder: started by `.ci/start-slurm` (Debian's slurm-wlm and
munge, installed when missing), or the tests skip with the reason it gave. Helpers submit batch jobs and
follow them through `scontrol` (no accounting database is needed)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
START = ROOT / ".ci" / "start-slurm"
TARGET = ROOT / "tests" / "preemption" / "snapshot_target.py"
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE"}


@pytest.fixture(scope="session")
def slurm():
    """The running SLURM (started here when it is not), or a skip naming why it cannot run."""
    if sys.platform != "linux":
        pytest.skip("the SLURM tests start a SLURM on Linux only")
    if not START.exists():
        pytest.skip(f"{START} is missing")
    try:
        done = subprocess.run(["bash", str(START)], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        pytest.skip(".ci/start-slurm did not finish within 900 s")
    if done.returncode != 0 or shutil.which("sbatch") is None:
        reason = (done.stderr.strip().splitlines() or ["no reason given"])[-1]
        pytest.skip(f"no SLURM here: {reason}")
    return Slurm()


class Slurm:
    """Submit batch jobs and read their state."""

    def submit(self, folder: Path, command: str, *options: str, name: str = "job") -> str:
        """Submit `command` (run with `exec`, so the batch step's signals reach it) as a batch job whose
        output goes to `folder/<name>.out` (appended over requeues); the job id."""
        script = folder / f"{name}.sh"
        lines = ["#!/bin/bash", f"#SBATCH --output={folder / name}.out", "#SBATCH --open-mode=append",
                 f"#SBATCH --job-name={name}", *(f"#SBATCH {option}" for option in options),
                 f"cd {ROOT}", f"exec {command}"]
        script.write_text("\n".join(lines) + "\n")
        done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields for `job_id` (empty once SLURM forgot it)."""
        done = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", done.stdout))

    def wait(self, job_id: str, timeout: float = 180, restarts: int = 0) -> dict[str, str]:
        """Wait until the job finished (after `restarts` requeues at least); its fields. A requeued job
        waits for a begin time SLURM sets a while ahead; it is released at once."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in FINISHED and int(fields.get("Restarts", "0")) >= restarts:
                return fields
            if fields.get("JobState") == "PENDING" and fields.get("Reason") == "BeginTime":
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True,
                               timeout=60)
            time.sleep(0.3)
        subprocess.run(["scancel", job_id], timeout=60)
        raise AssertionError(f"job {job_id} did not finish within {timeout} s: {self.job(job_id)}")

    def wait_for_lines(self, output: Path, prefix: str, count: int, job_id: str, timeout: float = 120) -> None:
        """Wait until `count` distinct lines starting with `prefix` are in the job's output."""
        def seen() -> bool:
            text = output.read_text() if output.exists() else ""
            return len({line for line in text.splitlines() if line.startswith(prefix)}) >= count
        self._until(seen, f"{count} x {prefix!r}", job_id, output, timeout)

    def wait_for_file(self, folder: Path, pattern: str, job_id: str, output: Path, timeout: float = 120) -> None:
        """Wait until a file matching `pattern` is in `folder` (a snapshot the job wrote)."""
        self._until(lambda: folder.is_dir() and any(folder.glob(pattern)), str(folder / pattern), job_id, output,
                    timeout)

    def _until(self, done, what: str, job_id: str, output: Path, timeout: float) -> None:
        """Poll `done()` until it is true; fail if the job ends first (with its output's end), or cancel it and
        fail after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if done():
                return
            if self.job(job_id).get("JobState") in FINISHED:
                text = output.read_text() if output.exists() else ""
                raise AssertionError(f"job {job_id} ended before {what}: {text[-3000:]}")
            time.sleep(0.2)
        subprocess.run(["scancel", job_id], timeout=60)
        raise AssertionError(f"job {job_id}: no {what} within {timeout} s")

    def scancel(self, job_id: str, *options: str) -> None:
        done = subprocess.run(["scancel", *options, job_id], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
