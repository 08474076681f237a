"""Preemption on a real SLURM: jobs signalled by `scancel`, a job that runs into its time limit, a job that
requeues itself, and 2-task `srun` DDP jobs stopped each way the SLURM guide lists. Every stopped job
continues (resubmitted, requeued, or run to the end) to a result bit-identical, on every model, optimizer
and scheduler tensor, to an uninterrupted run.

The training script is `tests/preemption/snapshot_target.py`; its DataLoader workers print `worker <id>`
when they start, which is when the tests signal the job. SLURM is started by `.ci/start-slurm` (the
`slurm` fixture) or the tests skip.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

import pytest
import torch
from conftest import TARGET
from state_compare import assert_same_run  # tests/, on sys.path under pytest

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


SIZE = ("--epochs", "2", "--samples", "240")  # 2 epochs of 60 batches, 20 updates


def _command(ckpt, out, *args) -> str:
    return shlex.join([sys.executable, str(TARGET), str(ckpt), str(out), "--every", "7", *SIZE, *args])


def _reference(folder, *args):
    """The uninterrupted run, outside SLURM (the same machine and torch: the same numbers)."""
    done = subprocess.run([sys.executable, str(TARGET), str(folder), str(folder / "ref.pt"), *SIZE, *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(folder / "ref.pt", weights_only=True)


@pytest.fixture(scope="module")
def fork_reference(tmp_path_factory):
    return _reference(tmp_path_factory.mktemp("fork-reference"), *FORK)


def _finish_here(ckpt, out, *args):
    """Continue a stopped run to its end outside SLURM."""
    done = subprocess.run([sys.executable, str(TARGET), str(ckpt), str(out), "--every", "7", *SIZE, *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out, weights_only=True)


SPAWN = ("--workers", "2", "--context", "spawn", "--persistent")  # started once: spawn is slow to start
FORK = ("--workers", "2", "--context", "fork")
# Jobs that `scancel` stops once their workers run load each sample in 10-20 ms (1-3 s an epoch, against
# 0.2-0.4 s at full speed), so that the signal, which SLURM delivers up to a second or more later, still
# finds the job training: the results are the same; a job submitted again may go at full speed.
SLOWED = ("--slow-data", "0.01")


def test_scancel_term_full_stops_a_job_with_spawn_workers_and_a_resubmitted_job_continues_exactly(slurm, tmp_path):
    """`scancel --signal=TERM --full` (every process of the job, workers too): exit 143 with a snapshot; the
    same script submitted again ends as the uninterrupted run."""
    ckpt, out, output = tmp_path / "ckpt", tmp_path / "out.pt", tmp_path / "job.out"
    job = slurm.submit(tmp_path, _command(ckpt, out, *SPAWN, *SLOWED), "--ntasks=1", "--cpus-per-task=1")
    slurm.wait_for_lines(output, "worker ", 2, job)
    slurm.scancel(job, "--signal=TERM", "--full")
    fields = slurm.wait(job)
    text = output.read_text()
    assert "Preempted by SIGTERM at a commit point; snapshot" in text, text[-3000:]
    assert fields["ExitCode"] == "143:0", fields
    assert not out.exists()
    again = slurm.submit(tmp_path, _command(ckpt, out, *SPAWN), "--ntasks=1", "--cpus-per-task=1")
    assert slurm.wait(again)["JobState"] == "COMPLETED", output.read_text()[-3000:]
    (tmp_path / "reference").mkdir()
    assert_same_run(torch.load(out, weights_only=True), _reference(tmp_path / "reference", *SPAWN))


def test_a_usr1_to_the_batch_step_stops_the_job_which_requeues_itself_and_continues_exactly(slurm, tmp_path,
                                                                                             fork_reference):
    """USR1 to the batch step only (what `#SBATCH --signal=B:USR1@N` sends before the time limit), fork
    workers: a snapshot, `scontrol requeue` (requeue=True), and the requeued job ends as the uninterrupted
    run."""
    ckpt, out, output = tmp_path / "ckpt", tmp_path / "out.pt", tmp_path / "job.out"
    job = slurm.submit(tmp_path, _command(ckpt, out, *FORK, *SLOWED, "--requeue"), "--ntasks=1",
                       "--cpus-per-task=1", "--requeue")
    slurm.wait_for_lines(output, "worker ", 2, job)
    slurm.scancel(job, "--signal=USR1", "--batch")
    fields = slurm.wait(job, restarts=1)
    text = output.read_text()
    assert "Preempted by SIGUSR1 at a commit point; snapshot" in text, text[-3000:]
    assert f"SLURM job {job} requeued" in text, text[-3000:]
    assert fields["JobState"] == "COMPLETED" and fields["Restarts"] == "1", fields
    assert_same_run(torch.load(out, weights_only=True), fork_reference)


def test_a_job_at_its_time_limit_with_fork_workers_stops_with_a_snapshot_that_continues_exactly(slurm, tmp_path,
                                                                                               fork_reference):
    """`--time=1`: at the limit SLURM sends SIGTERM to every process of the job (the workers die too); the
    job leaves a snapshot, from which the run ends as the uninterrupted one. The data is slowed down in the
    job only (each sample sleeps 1 s: an epoch takes 2 minutes), so that the limit (60 s, checked by SLURM
    every 30 s) falls inside the first epoch; the run is finished outside SLURM at full speed."""
    ckpt, out, output = tmp_path / "ckpt", tmp_path / "out.pt", tmp_path / "job.out"
    job = slurm.submit(tmp_path, _command(ckpt, out, *FORK, "--slow-data", "1"), "--ntasks=1",
                       "--cpus-per-task=1", "--time=1")
    fields = slurm.wait(job, timeout=240)
    text = output.read_text()
    assert fields["JobState"] == "TIMEOUT", fields
    assert "Preempted by SIGTERM at a commit point; snapshot" in text, text[-3000:]
    assert not out.exists()
    assert_same_run(_finish_here(ckpt, out, *FORK), fork_reference)


# `exec srun`: srun is the batch shell (Slurm.submit execs the command), so a signal to the batch step
# (`#SBATCH --signal=B:USR1@N`, `scancel --batch`) reaches srun, which passes it on to the tasks.
SRUN = "srun --kill-on-bad-exit=0 "
DDP = ("--ntasks=2", "--cpus-per-task=1")
DDP_ARGS = ("--workers", "1", "--context", "fork")


@pytest.fixture(scope="module")
def ddp_reference(slurm, tmp_path_factory):
    """An uninterrupted 2-task srun job's result; two DDP ranks from SLURM's variables (no torchrun)."""
    folder = tmp_path_factory.mktemp("ddp-reference")
    job = slurm.submit(folder, SRUN + _command(folder / "ckpt", folder / "ref.pt", *DDP_ARGS), *DDP, name="ref")
    fields = slurm.wait(job)
    text = (folder / "ref.out").read_text()
    assert fields["JobState"] == "COMPLETED", text[-3000:]
    assert text.count("training") == 2, text[-3000:]  # two ranks, one per task
    return torch.load(folder / "ref.pt", weights_only=True)


def _stopped_cleanly(text: str, ckpt, out, signal_name: str) -> None:
    """Rank 0 (only) reports the stop with its snapshot; no result and no half-written file are left."""
    assert text.count(f"Preempted by {signal_name} at a commit point; snapshot") == 1, text[-3000:]
    assert not out.exists()
    assert not [p for p in os.listdir(ckpt / "run") if p.endswith(".tmp")]


def _resubmitted_ends_as(reference, slurm, tmp_path, ckpt, out, output) -> str:
    """Submit the stopped 2-task job again (at full speed), check that it ends as `reference`; its output."""
    again = slurm.submit(tmp_path, SRUN + _command(ckpt, out, *DDP_ARGS), *DDP, name="ddp")
    assert slurm.wait(again)["JobState"] == "COMPLETED", output.read_text()[-3000:]
    assert_same_run(torch.load(out, weights_only=True), reference)
    return output.read_text()


@pytest.mark.parametrize(("stop", "signal_name"), [
    ((), "SIGTERM"),  # SLURM ends the job: srun cannot kill a step being ended, the tasks get KillWait seconds
    (("--signal=TERM",), "SIGTERM"),  # the steps only: srun itself is not signalled
    (("--signal=USR1", "--full"), "SIGUSR1"),  # every process; srun passes USR1 on
    (("--signal=USR1", "--batch"), "SIGUSR1"),  # the batch shell (srun) only: what `--signal=B:USR1@N` does
], ids=["cancel", "term-steps", "usr1-full", "usr1-batch"])
def test_a_two_task_srun_job_stopped_by_scancel_continues_exactly_when_resubmitted(slurm, tmp_path, ddp_reference,
                                                                                     stop, signal_name):
    """`exec srun --ntasks=2 python train.py` stopped by `scancel` as the guide says: both ranks stop at one
    commit point, rank 0 writes the snapshot, and the same job submitted again ends as the uninterrupted
    2-task job."""
    ckpt, out, output = tmp_path / "ckpt", tmp_path / "out.pt", tmp_path / "ddp.out"
    job = slurm.submit(tmp_path, SRUN + _command(ckpt, out, *DDP_ARGS, "--slow-data", "0.02"), *DDP, name="ddp")
    slurm.wait_for_lines(output, "worker ", 2, job)  # one per rank (1 worker, 120 samples: 2.4 s an epoch)
    slurm.scancel(job, *stop)
    slurm.wait(job)
    _stopped_cleanly(output.read_text(), ckpt, out, signal_name)
    _resubmitted_ends_as(ddp_reference, slurm, tmp_path, ckpt, out, output)


def test_a_two_task_srun_job_warned_before_its_time_limit_stops_and_continues_exactly(slurm, tmp_path,
                                                                                       ddp_reference):
    """`--time=2 --signal=USR1@30`: SLURM sends USR1 to the tasks 30 to 60 s before the limit (its check runs
    every 30 s and sends the signal early rather than late); both ranks stop with a snapshot and the job ends
    before its limit. Data slowed down in this job only, so that the warning falls inside the first epoch;
    the job submitted again (at full speed) ends as the uninterrupted 2-task job."""
    ckpt, out, output = tmp_path / "ckpt", tmp_path / "out.pt", tmp_path / "ddp.out"
    job = slurm.submit(tmp_path, SRUN + _command(ckpt, out, *DDP_ARGS, "--slow-data", "0.5"), *DDP, "--time=2",
                       "--signal=USR1@30", name="ddp")
    fields = slurm.wait(job, timeout=240)
    assert fields["JobState"] != "TIMEOUT", (fields, output.read_text()[-3000:])  # it ended before the limit
    _stopped_cleanly(output.read_text(), ckpt, out, "SIGUSR1")
    _resubmitted_ends_as(ddp_reference, slurm, tmp_path, ckpt, out, output)


def test_a_two_task_srun_job_at_its_time_limit_stops_with_a_snapshot_and_continues_exactly(slurm, tmp_path,
                                                                                          ddp_reference):
    """`--time=1` without a warning: SLURM ends the step and sends SIGTERM to the tasks and to srun, which says
    "forcing job termination" but cannot kill a step SLURM is already ending: the tasks have `KillWait`
    seconds, and both ranks stop with a snapshot. Data slowed down in this job only, so that the limit falls
    inside the run; the job submitted again ends as the uninterrupted 2-task job."""
    ckpt, out, output = tmp_path / "ckpt", tmp_path / "out.pt", tmp_path / "ddp.out"
    job = slurm.submit(tmp_path, SRUN + _command(ckpt, out, *DDP_ARGS, "--slow-data", "0.45"), *DDP, "--time=1",
                       name="ddp")
    fields = slurm.wait(job, timeout=240)
    assert fields["JobState"] == "TIMEOUT", (fields, output.read_text()[-3000:])
    _stopped_cleanly(output.read_text(), ckpt, out, "SIGTERM")
    _resubmitted_ends_as(ddp_reference, slurm, tmp_path, ckpt, out, output)


def test_scancel_term_full_makes_srun_kill_its_tasks_and_the_job_continues_from_its_last_snapshot(slurm, tmp_path,
                                                                                                ddp_reference):
    """`scancel --signal=TERM --full` signals srun too, and srun answers a SIGTERM by killing its tasks at
    once (SLURM 22.05; the guide says to send USR1 or TERM to the steps only): no rank stops cleanly, and the
    job submitted again continues from the last periodic snapshot to the uninterrupted 2-task job's end."""
    ckpt, out, output = tmp_path / "ckpt", tmp_path / "out.pt", tmp_path / "ddp.out"
    job = slurm.submit(tmp_path, SRUN + _command(ckpt, out, *DDP_ARGS, "--slow-data", "0.1"), *DDP, name="ddp")
    slurm.wait_for_file(ckpt / "run", "snapshot-u*.ckpt", job, output)
    slurm.scancel(job, "--signal=TERM", "--full")
    slurm.wait(job)
    text = output.read_text()
    assert "srun: forcing job termination" in text and "Preempted" not in text, text[-3000:]
    assert not out.exists()
    text = _resubmitted_ends_as(ddp_reference, slurm, tmp_path, ckpt, out, output)
    assert "Resumed run run" in text, text[-3000:]
