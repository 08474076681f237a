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
import itertools
import os
import weakref
from collections.abc import Callable

import torch.distributed as dist

from deepepochs.config import decimal_variable
from deepepochs.parallel.exit_watchdog import bounded
from deepepochs.parallel.rendezvous import join_store

__all__ = ["EXIT_RELEASE_BOUND_S", "INTEGER_VARIABLES", "GroupUse", "destroy_group", "env_int"]


#: The integer variables torch's `env://` rendezvous and deepepochs read from the environment.
INTEGER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")


def env_int(name: str) -> int:
    """The integer value of environment variable `name` (RANK, WORLD_SIZE, LOCAL_RANK), or a `ConfigError`
    naming it."""
    return decimal_variable(name, os.environ[name])


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

# Numbers the uses of this process in the order they were made (the key of their heartbeats).
_use_numbers = itertools.count()

# The uses not yet released, which the exit handler releases (a script that never called close()).
_live_uses: weakref.WeakSet = weakref.WeakSet()

# How long the exit handler may take before the process is ended with a message instead (seconds). A
# clean release takes milliseconds; it waits only when torch blocks (a peer gone while work is in flight).
EXIT_RELEASE_BOUND_S = 60.0


def _init_group_from_env(backend: str, timeout: float) -> None:
    """Initialise the default process group from the torchrun-style environment variables; joining it and its
    collectives fail after `timeout` seconds of waiting for another rank (`rendezvous.join_store`)."""
    global _env_store, _groups_initialised
    if _env_store is None:
        for name in INTEGER_VARIABLES:  # before torch's own int() reads them
            if name in os.environ:
                env_int(name)
        _env_store = join_store(timeout)  # within `timeout`, or an error naming the ranks that did not arrive
    store = dist.PrefixStore(f"deepepochs/group-{_groups_initialised}", _env_store)
    _groups_initialised += 1
    dist.init_process_group(backend, store=store, rank=env_int("RANK"), world_size=env_int("WORLD_SIZE"),
                            timeout=datetime.timedelta(seconds=timeout))


def _release_at_exit() -> None:
    """At interpreter exit (atexit, while Python still runs): release every use of the group deepepochs
    created that no `close()` released, and let go of the job's store, so that their C++ threads are joined
    here, within `EXIT_RELEASE_BOUND_S` (past it the process ends with a message, see `exit_watchdog`).

    Why here: left to the interpreter's teardown, a TCPStore client and gloo's threads were destroyed while
    still joinable in 5-7 of 30 clean two-process torchrun runs (SIGABRT, "terminate called without an
    active exception", after the script had finished: the launcher, or srun, then reports a failed task).
    Why the garbage collection comes last: collecting while a DDP reducer still held the last reference to
    a destroyed group freed it with the GIL held, and gloo's destructor waited for a mutex that gloo's
    worker thread held while waiting for the GIL to free a tensor (a clean run that never exited). Each use
    now drops its reducer before the group is destroyed (`destroy_group`), so once they are released no
    collected object holds a group of deepepochs; the collection then frees the stores the destroyed groups'
    prefix stores held (left to the interpreter's teardown, 1 of 115 clean torchrun runs aborted there).

    Registered when this module is imported (`import deepepochs`): exit handlers run last-registered first,
    so a handler the user registers after importing deepepochs runs before this one and still finds the
    group."""
    global _env_store
    with bounded("releasing the process group deepepochs created, at interpreter exit", EXIT_RELEASE_BOUND_S):
        for use in list(_live_uses):
            use.release()
        _env_store = None
        gc.collect()


atexit.register(_release_at_exit)


def destroy_group() -> None:
    """Destroy the default group so that its last reference is dropped with the GIL released.

    `destroy_process_group` may leave the last reference in a C++ registry, freed with the GIL held; if
    gloo's worker thread then waits for the GIL (freeing its last tensors) while holding the mutex the
    destructor waits for, neither moves. Holding the group's Python object over the call makes that object
    the last reference: torch frees a process group's Python object with the GIL released."""
    group = dist.group.WORLD
    dist.destroy_process_group()
    del group


class GroupUse:
    """One policy's use of the default process group, from joining it to `release`.

    Args:
        backend: the backend of a group initialised here ('nccl' on CUDA, else 'gloo').
        timeout: seconds a collective waits for the other ranks, when the group is initialised here.
        before_release: called first by `release` (also from the exit handler): drops what of the user's
            holds the group (a DDP wrapper's reducer), so that the group is never freed by something
            collected later.

    Attributes:
        owned: whether this use holds a group deepepochs created (initialised here, or by an earlier user
            still alive); False once released.
        timeout_s: the group's timeout when deepepochs created it; None for a group the caller made (its
            creator chose).
        store_address: `(MASTER_ADDR, MASTER_PORT)` of the job's store when deepepochs created the group (the
            ranks' heartbeats are written there), else None.
        places_key: the store prefix this use's heartbeats go under: every rank makes its uses in the same
            order, so the n-th use of each rank shares one.
    """

    def __init__(self, backend: str, timeout: float, before_release: Callable[[], None] | None = None):
        global _owned_group_users
        self._before_release = before_release
        if not dist.is_initialized():
            _init_group_from_env(backend, timeout)
            _owned_group_users = 0
            self.owned = True
            _group_timeout_s[0] = timeout
        else:
            self.owned = _owned_group_users > 0
        self.timeout_s = _group_timeout_s[0] if self.owned else None
        self.store_address = (os.environ["MASTER_ADDR"], env_int("MASTER_PORT")) if self.owned else None
        self.places_key = f"deepepochs/places/{next(_use_numbers)}"
        if self.owned:
            _owned_group_users += 1
            _live_uses.add(self)

    def release(self) -> None:
        """End this use: the group is destroyed when deepepochs created it and no other user remains. A
        second call does nothing."""
        global _owned_group_users
        if self._before_release is not None:
            before, self._before_release = self._before_release, None
            before()
        if not self.owned:
            return
        self.owned = False
        _live_uses.discard(self)
        _owned_group_users = max(_owned_group_users - 1, 0)
        if _owned_group_users == 0 and dist.is_initialized():
            destroy_group()
