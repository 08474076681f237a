"""SLURM as an environment deepepochs knows: `srun --ntasks=N python train.py` trains DDP without torchrun, and
a preempted job can requeue itself.

Inside a task of an `srun` step (SLURM sets `SLURM_STEP_ID`) of several tasks, with no torchrun-style
variables already set, `adopt_environment` derives them from SLURM's:

==============  ====================================================================================
`RANK`          `SLURM_PROCID`
`WORLD_SIZE`    `SLURM_STEP_NUM_TASKS` (the step's tasks; `SLURM_NTASKS` where it is missing)
`LOCAL_RANK`    `SLURM_LOCALID`
`MASTER_ADDR`   the first host of `SLURM_STEP_NODELIST` (else `SLURM_JOB_NODELIST`), `node[01-04]` expanded
`MASTER_PORT`   `MASTER_PORT` if the job set it, else 20000 + `SLURM_JOB_ID` % 20000: every task of the job
                derives the same port, and jobs sharing a node mostly differ
==============  ====================================================================================

The batch script itself (no `SLURM_STEP_ID`: `python train.py` run directly by `sbatch`) is one process,
whatever `--ntasks` says. A variable set already (torchrun inside the job) is never replaced.
"""

from __future__ import annotations

import os
import re
import subprocess

from deepepochs.errors import ConfigError

__all__ = ["adopt_environment", "first_host", "in_slurm_job", "requeue", "torch_environment"]

_NEEDED = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_ID")


def in_slurm_job(environ=None) -> bool:
    """Whether this process runs inside a SLURM job (`SLURM_JOB_ID` is set)."""
    return "SLURM_JOB_ID" in (os.environ if environ is None else environ)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM host list: `node[03-05,9],gpu1` -> `node03`."""
    match = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodelist.strip())
    if not match or not match.group(1) and not match.group(2):
        raise ConfigError(f"SLURM host list {nodelist!r} names no host")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def torch_environment(environ=None) -> dict[str, str] | None:
    """The torchrun-style variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`) this
    SLURM task implies, or None when it is no task of a multi-task `srun` step or torchrun's variables are
    set already. Raises `ConfigError` naming the SLURM variables missing for it."""
    env = os.environ if environ is None else environ
    if "SLURM_STEP_ID" not in env or "RANK" in env or "WORLD_SIZE" in env:
        return None
    tasks = env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS"))
    nodes = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST"))
    missing = [name for name in _NEEDED if name not in env]
    if tasks is None:
        missing.append("SLURM_STEP_NUM_TASKS (or SLURM_NTASKS)")
    if nodes is None and "MASTER_ADDR" not in env:
        missing.append("SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST)")
    if missing:
        raise ConfigError(f"this process runs in a SLURM step (SLURM_STEP_ID={env['SLURM_STEP_ID']!r}) but the"
                          f" environment lacks {', '.join(missing)}, which distributed training takes its ranks"
                          " and rendezvous from; start the tasks with srun inside the job, or set RANK,"
                          " WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT yourself")
    values = {name: env[name] for name in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_ID")}
    values["tasks"] = tasks
    for name, value in values.items():
        if not value.strip().isdigit():
            shown = "SLURM_STEP_NUM_TASKS" if name == "tasks" else name
            raise ConfigError(f"SLURM variable {shown} must be a non-negative integer (got {value!r})")
    if int(tasks) < 2:
        return None
    port = env.get("MASTER_PORT") or str(20000 + int(values["SLURM_JOB_ID"]) % 20000)
    return {"RANK": values["SLURM_PROCID"].strip(), "WORLD_SIZE": tasks.strip(),
            "LOCAL_RANK": values["SLURM_LOCALID"].strip(),
            "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(nodes), "MASTER_PORT": port}


def adopt_environment() -> bool:
    """Set the torchrun-style variables from SLURM's when this is a task of a multi-task `srun` step (see the
    module doc); variables already set stay. Whether it set them."""
    values = torch_environment()
    if values is None:
        return False
    for name, value in values.items():
        os.environ.setdefault(name, value)
    return True


def requeue(job_id: str | None = None) -> str:
    """Ask SLURM to requeue job `job_id` (default: this job, `SLURM_JOB_ID`): `scontrol requeue <id>`. Returns
    what it did, for the log; raises `ConfigError` outside a SLURM job and `RuntimeError` when scontrol
    fails."""
    job_id = job_id or os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise ConfigError("requeue needs a SLURM job: SLURM_JOB_ID is not set (run the script with sbatch, or"
                          " drop requeue=True)")
    try:
        done = subprocess.run(["scontrol", "requeue", str(job_id)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"scontrol requeue {job_id} could not run: {exc}") from exc
    if done.returncode != 0:
        raise RuntimeError(f"scontrol requeue {job_id} failed ({done.returncode}): {done.stderr.strip()}")
    return f"SLURM job {job_id} requeued"
