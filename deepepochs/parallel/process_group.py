"""The default process group's lifecycle under DDP and FSDP: joining the job the environment describes,
who owns the group, and destroying it when the last trainer using it closes.

A policy that finds no group initialises one from the torchrun-style environment (`RANK`, `WORLD_SIZE`,
`MASTER_ADDR`, `MASTER_PORT`, as `torchrun` and `deepepochs.launch` set them) and owns it; a group the
caller initialised stays the caller's and is never destroyed here. Several trainers of one process share
the group deepepochs created; the last to close destroys it.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os

import torch.distributed as dist

from deepepochs.errors import DistributedError

__all__ = ["GroupUse", "env_int"]


def env_int(name: str) -> int:
    """The integer value of environment variable `name` (RANK, WORLD_SIZE, LOCAL_RANK), or a clear error."""
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise DistributedError(f"environment variable {name} must be an integer (got {value!r})") from None


# How many live users (`GroupUse` objects not yet released) the default group this module initialised has
# (0: none, or the group belongs to the caller). Two Trainers may share one group; the last one to close
# destroys it.
_owned_group_users = 0

# The job's rendezvous store (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT), opened once per process, and how
# many groups were initialised on it. Why not `init_process_group()` from the environment each time: that
# opens a new store per group and rank 0 re-binds MASTER_PORT for it, so a second Trainer in the same
# process races peers still connected to the old store (a run of repeated re-inits hung here once). One
# store with a fresh key prefix per group avoids the race; every rank creates its Trainers in the same
# order, so the prefixes agree. The store stays open until the process exits (`_release_at_exit`).
_env_store = None
_groups_initialised = 0
_group_timeout_s = [None]  # the timeout of the group this module initialised last


def _init_group_from_env(backend: str, timeout: float) -> None:
    """Initialise the default process group from the torchrun-style environment variables; its collectives
    fail after `timeout` seconds of waiting for another rank."""
    global _env_store, _groups_initialised
    if _env_store is None:
        try:
            _env_store, _, _ = next(dist.rendezvous("env://"))
        except ValueError as exc:  # a variable is missing or malformed
            raise DistributedError(
                f"cannot join the distributed job described by the environment ({exc}); start the script "
                "with torchrun or deepepochs.launch, which set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and "
                "MASTER_PORT"
            ) from exc
        atexit.register(_release_at_exit)
    store = dist.PrefixStore(f"deepepochs/group-{_groups_initialised}", _env_store)
    _groups_initialised += 1
    dist.init_process_group(backend, store=store, rank=env_int("RANK"), world_size=env_int("WORLD_SIZE"),
                            timeout=datetime.timedelta(seconds=timeout))


def _release_at_exit() -> None:
    """At interpreter exit (atexit, while Python still runs): destroy the group deepepochs created if no
    `close()` did, and let go of the job's store, so that their C++ threads are joined here.

    Why: left to the interpreter's teardown, a TCPStore client and gloo's threads were destroyed while
    still joinable in 5-7 of 30 clean two-process torchrun runs here (SIGABRT, "terminate called without
    an active exception", after the script had finished: the launcher, or srun, then reports a failed
    task); released here, 0 of 30."""
    global _env_store, _owned_group_users
    try:
        if _owned_group_users > 0 and dist.is_initialized():
            _owned_group_users = 0
            dist.destroy_process_group()
    finally:
        _env_store = None
        gc.collect()  # the PrefixStores of the destroyed groups held it too


class GroupUse:
    """One policy's use of the default process group, from joining it to `release`.

    Args:
        backend: the backend of a group initialised here ('nccl' on CUDA, else 'gloo').
        timeout: seconds a collective waits for the other ranks, when the group is initialised here.

    Attributes:
        owned: whether this use holds a group deepepochs created (initialised here, or by an earlier user
            still alive); False once released.
        timeout_s: the group's timeout when deepepochs created it; None for a group the caller made (its
            creator chose).
    """

    def __init__(self, backend: str, timeout: float):
        global _owned_group_users
        if not dist.is_initialized():
            _init_group_from_env(backend, timeout)
            _owned_group_users = 0
            self.owned = True
            _group_timeout_s[0] = timeout
        else:
            self.owned = _owned_group_users > 0
        self.timeout_s = _group_timeout_s[0] if self.owned else None
        if self.owned:
            _owned_group_users += 1

    def release(self) -> None:
        """End this use: the group is destroyed when deepepochs created it and no other user remains. A
        second call does nothing."""
        global _owned_group_users
        if not self.owned:
            return
        self.owned = False
        _owned_group_users = max(_owned_group_users - 1, 0)  # 0 already when the exit handler released it
        if _owned_group_users == 0 and dist.is_initialized():
            dist.destroy_process_group()
