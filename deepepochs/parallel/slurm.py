"""SLURM as an environment deepepochs knows: `srun --ntasks=N python train.py` trains DDP without torchrun, and
a preempted job can requeue itself.

Inside a task of an `srun` step (SLURM sets `SLURM_STEP_ID`) of several tasks, with no torchrun-style
variables already set, `adopt_environment` derives them from SLURM's:

==============  ====================================================================================
`RANK`          `SLURM_PROCID`
`WORLD_SIZE`    `SLURM_STEP_NUM_TASKS` (the step's tasks; `SLURM_NTASKS` where it is missing)
`LOCAL_RANK`    `SLURM_LOCALID`
`MASTER_ADDR`   the first host of `SLURM_STEP_NODELIST` (else `SLURM_JOB_NODELIST`), as SLURM expands it
                (`rack[1-2]-node[01-02]` -> `rack1-node01`)
`MASTER_PORT`   `MASTER_PORT` if the job set it, else 20000 + `SLURM_JOB_ID` % 20000: every task of the job
                derives the same port, and jobs sharing a node mostly differ
==============  ====================================================================================

The batch script itself (no `SLURM_STEP_ID`: `python train.py` run directly by `sbatch`) is one process,
whatever `--ntasks` says. A variable set already (torchrun inside the job) is never replaced. A rank
(`SLURM_PROCID`) not below the task count is refused at once: torch would wait forever for the missing ranks.
"""

from __future__ import annotations

import os
import re
import subprocess

from deepepochs.config import decimal_variable
from deepepochs.errors import ConfigError

__all__ = ["adopt_environment", "first_host", "in_slurm_job", "requeue", "torch_environment"]

_NEEDED = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_ID")


def in_slurm_job(environ=None) -> bool:
    """Whether this process runs inside a SLURM job (`SLURM_JOB_ID` is set)."""
    return "SLURM_JOB_ID" in (os.environ if environ is None else environ)


#: One bracket group of a host list item and the text before it: `rack[1-2]` of `rack[1-2]-node[01-02]`.
_GROUP = re.compile(r"([^\[\]]*)\[([^\[\]]*)\]")
#: One entry of a bracket group: a number or a rising range of numbers, zero padding kept (`003-005`).
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def _items(nodelist: str) -> list[str]:
    """The items of a host list: split at commas and blanks outside brackets, empty ones dropped."""
    items, item, depth = [], "", 0
    for char in nodelist:
        depth += (char == "[") - (char == "]")
        if depth == 0 and (char == "," or char.isspace()):
            items.append(item)
            item = ""
        else:
            item += char
    return [i for i in [*items, item] if i]


def _first_of_item(item: str) -> str | None:
    """The first host of one host list item, or None when SLURM would refuse it. An item is a plain name, or
    one or more bracket groups each after its text (`a[1-2]-b[01-02]`) with nothing after the last; a group
    lists numbers and rising ranges (`1-3,5`); the first host takes each group's first entry, as written."""
    if "[" not in item and "]" not in item:
        return item
    first, end = "", 0
    for group in _GROUP.finditer(item):
        if group.start() != end:
            return None
        end = group.end()
        entries = [_RANGE.fullmatch(entry) for entry in group.group(2).split(",")]
        if not entries or any(e is None or e.group(2) is not None and int(e.group(2)) < int(e.group(1))
                              for e in entries):
            return None
        first += group.group(1) + entries[0].group(1)
    return first if end == len(item) and end > 0 else None


def first_host(nodelist: str, variable: str = "") -> str:
    """The first host of a SLURM host list, the one `scontrol show hostnames` prints first:
    `rack[1-2]-node[01-02]` -> `rack1-node01`, `a[1-3,5],b7` -> `a1`, `node[003-005]` -> `node003`.

    Items are separated by commas or blanks; an item is a host name or a name with bracket groups of numbers
    and ranges (zero padding kept). A list SLURM refuses (text after a bracket group, a range running
    backwards, an empty or non-numeric group, unbalanced brackets, no item) is a `ConfigError` quoting it
    (and naming `variable`, the SLURM variable it came from, when given)."""
    items = _items(nodelist)
    firsts = [_first_of_item(item) for item in items]
    if not items or None in firsts:
        bad = "names no host" if not items else f"has an item SLURM refuses, {items[firsts.index(None)]!r}"
        source = f" (from {variable})" if variable else ""
        raise ConfigError(f"SLURM host list {nodelist!r}{source} {bad}: a host list is hosts and bracketed ranges"
                          " (`node[01-04,07],gpu1`) separated by commas")
    return firsts[0]


def torch_environment(environ=None) -> dict[str, str] | None:
    """The torchrun-style variables (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`) this
    SLURM task implies, or None when it is no task of a multi-task `srun` step or torchrun's variables are
    set already. Raises `ConfigError` naming the SLURM variables missing for it."""
    env = os.environ if environ is None else environ
    if "SLURM_STEP_ID" not in env or "RANK" in env or "WORLD_SIZE" in env:
        return None
    tasks = env.get("SLURM_STEP_NUM_TASKS", env.get("SLURM_NTASKS"))
    nodes = env.get("SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST"))
    nodes_from = "SLURM_STEP_NODELIST" if "SLURM_STEP_NODELIST" in env else "SLURM_JOB_NODELIST"
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
    source = "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in env else "SLURM_NTASKS"
    values["tasks"] = tasks
    for name, value in values.items():
        decimal_variable(source if name == "tasks" else name, value, "SLURM variable")
    if int(tasks) < 2:
        return None
    if int(values["SLURM_PROCID"]) >= int(tasks):  # torch would wait forever: that rank is outside the world
        raise ConfigError(f"SLURM_PROCID={values['SLURM_PROCID'].strip()} is not below the task count"
                          f" {source}={tasks.strip()}: a task's rank must be one of 0 to the task count - 1; start"
                          " the tasks with srun inside the job and leave these variables as SLURM sets them")
    port = env.get("MASTER_PORT") or str(20000 + int(values["SLURM_JOB_ID"]) % 20000)
    return {"RANK": values["SLURM_PROCID"].strip(), "WORLD_SIZE": tasks.strip(),
            "LOCAL_RANK": values["SLURM_LOCALID"].strip(),
            "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(nodes, nodes_from), "MASTER_PORT": port}


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
