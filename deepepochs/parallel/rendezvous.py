"""Joining a job's rendezvous store within `Trainer(dist_timeout=...)`, or a `DistributedError` naming the ranks that
did not arrive.

torch's `env://` rendezvous waits for its store with torch's default of 30 minutes: a torchrun rank or an `srun`
task that never starts kept the others waiting that long, with nothing printed. Here every rank opens the store
(rank 0 serves it at `MASTER_ADDR:MASTER_PORT`) with the trainer's timeout, says that it arrived (one key per
rank), and waits for the others' keys for what is left of that timeout. Past it the error names the ranks whose
key is missing, the world size, the address and where those values came from (`launch`, SLURM, torchrun or plain
environment variables), so the fix (start that task, correct the address) is in the message.
"""

from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist

from deepepochs.errors import DistributedError
from deepepochs.launch.child import LAUNCH_MARK

__all__ = ["arrival_key", "environment_source", "join_store"]

_NEEDED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def arrival_key(rank: int) -> str:
    """The store key rank `rank` sets once it reached the store."""
    return f"deepepochs/arrived/{rank}"


def environment_source(environ=None) -> str:
    """Where this process's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT came from, in words."""
    env = os.environ if environ is None else environ
    if env.get(LAUNCH_MARK):
        return "deepepochs.launch"
    if "SLURM_STEP_ID" in env and env.get("RANK", "").strip() == env.get("SLURM_PROCID", "").strip():
        return "SLURM's task variables (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST)"
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    return "the environment variables RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT"


def _job() -> tuple[int, int, str, int]:
    """(rank, world size, master address, master port) from the environment, or a clear error."""
    missing = [name for name in _NEEDED if name not in os.environ]
    if missing:
        raise DistributedError(
            f"cannot join the distributed job described by the environment (missing {', '.join(missing)}); start"
            " the script with torchrun or deepepochs.launch, which set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR"
            " and MASTER_PORT")
    values = []
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        try:
            values.append(int(os.environ[name]))
        except ValueError:
            value = os.environ[name]
            raise DistributedError(f"environment variable {name} must be an integer (got {value!r})") from None
    rank, world, port = values
    return rank, world, os.environ["MASTER_ADDR"], port


def join_store(timeout: float):
    """The job's TCPStore, once every rank reached it; at most `timeout` seconds of waiting in all.

    Raises `DistributedError` when rank 0's store cannot be reached or served, or when some rank has not arrived
    in time (naming them)."""
    rank, world, addr, port = _job()
    where = (f"world size {world}, master {addr}:{port}, from {environment_source()}")
    deadline = time.monotonic() + timeout
    try:
        store = dist.TCPStore(addr, port, world, rank == 0, timeout=datetime.timedelta(seconds=timeout),
                              wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, OSError) as exc:  # torch's DistNetworkError / DistStoreError are RuntimeErrors
        said = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        if rank == 0:
            raise DistributedError(
                f"rank 0 could not serve the rendezvous store at {addr}:{port} ({where}): {said}; another program"
                " may use that port: choose a free MASTER_PORT") from exc
        raise DistributedError(
            f"rank {rank} of {world} could not reach the rendezvous store at {addr}:{port} within {timeout:g} s"
            f" (Trainer(dist_timeout=...)); {where}. Rank 0, which serves it, did not arrive: it did not start,"
            f" failed before joining, or runs elsewhere than MASTER_ADDR says. Torch said: {said}") from exc
    store.set(arrival_key(rank), str(os.getpid()))
    keys = [arrival_key(r) for r in range(world)]
    try:
        store.wait(keys, datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.01)))
    except RuntimeError as exc:
        try:
            missing = [r for r in range(world) if not store.check([arrival_key(r)])]
        except RuntimeError:  # rank 0, which serves the store, is gone meanwhile
            missing = [0]
        names = ", ".join(str(r) for r in missing) or "none (they arrived just now)"
        raise DistributedError(
            f"rank {rank} of {world}: the job's ranks did not all arrive within {timeout:g} s"
            f" (Trainer(dist_timeout=...)); missing rank(s): {names}; {where}. Start every task (each rank 0 to"
            f" {world - 1} once), or correct WORLD_SIZE") from exc
    return store
