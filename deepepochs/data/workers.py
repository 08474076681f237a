"""Starting a stage's data: DataLoader workers that never take a Ctrl-C.

A Ctrl-C in a terminal (and a scheduler's SIGINT to the job) reaches the whole process group, DataLoader
workers included. The main process handles it (the stage rolls back, see `deepepochs.engine.signals`); a worker
that took it would die instead: a spawn worker still importing prints its KeyboardInterrupt traceback, and
torch's SIGCHLD handler then raises "DataLoader worker is killed by signal: Interrupt" wherever the main
process is, even inside the iterator's `__del__`, and a persistent worker is gone for the next epoch.

So every stage makes its data's iterator through `start` (where a DataLoader starts its workers), with SIGINT
blocked in the calling thread meanwhile: a new process inherits the mask (fork copies it, and exec keeps it),
so the workers keep a SIGINT pending and end when the stage shuts them down, as torch's own worker loop
intends (it swallows KeyboardInterrupt). The main process loses nothing: a SIGINT that arrived while blocked
is delivered when `start` returns. Processes a worker starts inherit the mask too.

multiprocessing's resource tracker is started first, outside the block (started at the first spawn or
forkserver worker, it unblocks SIGINT in the starting thread once it runs, which would expose every worker
started after it). The fork server, which forks forkserver workers (the default start method on Linux from
Python 3.14), is then started inside the block: it keeps the mask, and so does every worker it forks. A fork
server that other code started before deepepochs' first forkserver DataLoader cannot be shielded so (its
mask is its own): its workers may take a Ctrl-C, which a warning says once, naming the way out (start
nothing on the fork server before the first fit, or use fork or spawn workers). Data whose workers start
later than its `iter()` (an iterator wrapping a DataLoader inside its `__next__`) is not covered either.

A stage that ends before its iterators are exhausted (an exception, a Ctrl-C, the update budget reached
mid-epoch) shuts their workers down as it ends (`stage`), not when the garbage collector reaches them: an
iterator held by a traceback's reference cycle is collected in any order with its queues, and a spawn worker
still starting then finds the queues' semaphores gone, dies with its own traceback, and torch's SIGCHLD
handler raises "exited unexpectedly" wherever the main process is. Persistent workers stay with their
DataLoader, which holds their iterator and reuses it, when the stage ends normally; a stage that failed
shuts them down too and makes the DataLoader start new ones when next iterated (its iterator stopped
mid-epoch, and the DataLoader itself may be garbage in the traceback's cycle, as one made inline in the
call is once a notebook goes on after the interrupt).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import signal
import warnings
import weakref
from multiprocessing import forkserver, resource_tracker

import attrs
import torch

from deepepochs import torch_private
from deepepochs.errors import DeepEpochsWarning

__all__ = ["stage", "start"]

_BLOCKABLE = hasattr(signal, "pthread_sigmask")  # POSIX
#: per running stage (innermost last: a callback may run another stage inside one), what it started
_stages: list[_Started] = []


@attrs.define(eq=False)
class _Started:
    """What a running stage started: the iterators whose workers it shuts down as it ends, and the
    DataLoaders whose persistent workers it shuts down if it fails (both held weakly)."""

    iterators: weakref.WeakSet = attrs.field(factory=weakref.WeakSet)
    persistent: weakref.WeakSet = attrs.field(factory=weakref.WeakSet)


@contextlib.contextmanager
def stage():
    """Run a stage: as it ends, however it ends, shut down the workers of the iterators `start` made in it
    that are still running; if it fails, those of its DataLoaders' persistent workers too (module doc)."""
    started = _Started()
    _stages.append(started)
    failed = True
    try:
        yield
        failed = False
    finally:
        _stages.remove(started)  # by identity (eq=False)
        for iterator in list(started.iterators):
            torch_private.shutdown_loader_workers(iterator)
        if failed:
            for loader in list(started.persistent):
                torch_private.drop_persistent_workers(loader)


def start(data, seed: int | None = None):
    """`iter(data)`, with SIGINT blocked in this thread while it runs; within a `stage`, shut down when it ends
    (see the module doc). With `seed`, a DataLoader with persistent workers that holds no iterator (a failed
    stage shut it down, or the DataLoader is new in a resumed run) makes one without drawing its base seed
    from its generators: its workers are seeded from `seed` (`deepepochs.engine.loader_starts`)."""
    if not _BLOCKABLE:
        iterator = _made(data, seed)
    else:
        _helpers_first(data)
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            iterator = _made(data, seed)
        finally:
            if signal.SIGINT not in previous:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if _stages and hasattr(iterator, "_shutdown_workers"):
        started = _stages[-1]
        if getattr(data, "persistent_workers", False):
            started.persistent.add(data)
        else:
            started.iterators.add(iterator)
    return iterator


def _made(data, seed: int | None):
    """`iter(data)`; with `seed` (see `start`), the base seed drawn from a generator of its own instead of the
    DataLoader's (torch's global one when it has none), which stay as they are. The sampler keeps its own
    reference to the generator it shuffles with, so its draws are the DataLoader's as before."""
    if seed is None or not getattr(data, "persistent_workers", False) or torch_private.holds_iterator(data):
        return iter(data)
    own = data.generator
    data.generator = torch.Generator().manual_seed(seed)
    try:
        return iter(data)
    finally:
        data.generator = own


def _helpers_first(data) -> None:
    """Start the multiprocessing helpers `data`'s workers would start, before SIGINT is blocked (module doc)."""
    if not getattr(data, "num_workers", 0):
        return
    context = getattr(data, "multiprocessing_context", None)  # a DataLoader's; None: multiprocessing's default
    method = (context.get_start_method() if context is not None
              else multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0])
    if method in ("forkserver", "spawn"):
        resource_tracker.ensure_running()
    if method == "forkserver":
        _start_fork_server()


#: The fork server this module started with SIGINT blocked (its pid), or None.
_shielded_server: list = [None]


def _start_fork_server() -> None:
    """Start multiprocessing's fork server with SIGINT blocked in this thread, so that it and every worker it
    forks keep it blocked; warn once when another fork server runs already (module doc)."""
    server = forkserver._forkserver  # noqa: SLF001  (the stdlib's one server; its pid says whether it runs)
    running = getattr(server, "_forkserver_pid", None)
    if running is not None and running != _shielded_server[0]:
        if _shielded_server[0] != "warned":
            _shielded_server[0] = "warned"
            warnings.warn("forkserver DataLoader workers may take a Ctrl-C: the fork server was started before"
                          " deepepochs could start it with SIGINT blocked, and every worker it forks keeps its"
                          " signal mask; start nothing on the fork server before the first fit, or use"
                          " multiprocessing_context='fork' or 'spawn'", DeepEpochsWarning, stacklevel=4)
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        forkserver.ensure_running()
    finally:
        if signal.SIGINT not in previous:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _shielded_server[0] = getattr(server, "_forkserver_pid", None)
