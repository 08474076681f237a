"""The parent's side of a multi-process launch: start the children (spawn), wait for them, pass SIGTERM and
SIGUSR1 on to them, and give the caller back its environment and signal handlers unchanged.

What each child runs is :mod:`~deepepochs.launch.child`; how a failure ends the group is
:mod:`~deepepochs.launch.failures`.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import pickle
import signal
import socket
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

from deepepochs.errors import DeepEpochsWarning, DistributedError
from deepepochs.launch.child import _MASTER_ADDR, _RESULT_FILE, _done_path, _read_preempted, _run_rank
from deepepochs.launch.failures import _SHUTDOWN_GRACE_S, _ChildrenStderr, _distributed_error, _stop_processes

__all__ = ["_spawn"]

T = TypeVar("T")

# Set to 1 in the children unless the caller set it (see `_spawn`).
_ENV_OMP_THREADS = "OMP_NUM_THREADS"

# ``ProcessContext.join(grace_period=...)`` exists only in newer torch releases; older ones SIGTERM the
# survivors at once, which is just as prompt.
_JOIN_HAS_GRACE_PERIOD = "grace_period" in inspect.signature(mp.ProcessContext.join).parameters

# Signals the parent passes on to its children: those a SnapshotCallback listens for by default.
_FORWARDED_SIGNALS = ("SIGTERM", "SIGUSR1")


def _spawn(main: Callable[[], T], world_size: int) -> T:
    """Start ``world_size`` children running ``main``, wait for all, and return rank 0's result."""
    # Why spawn and not fork: a forked child inherits the parent's CUDA context (unusable, CUDA cannot be
    # re-initialised after fork) and the state of threads that do not exist in the child (OpenMP pools,
    # dataloader workers), which deadlocks. Spawn starts clean interpreters on every platform.
    #
    # Why a free port: a fixed MASTER_PORT (the usual 29500) collides with any other job on this machine.
    # Binding port 0 lets the OS pick an unused one. It is released before rank 0's TCPStore binds it, a
    # tiny window in which another program could take it; torch's own launchers accept the same race.
    master_port = _find_free_port()

    # Why OMP_NUM_THREADS=1: each process would otherwise start one OpenMP thread per core, so N processes
    # oversubscribe the CPU N times over and CPU training slows down badly (torchrun sets the same
    # default). It must be in the environment *before* spawning: torch reads it when the child imports it.
    env_updates = {} if _ENV_OMP_THREADS in os.environ else {_ENV_OMP_THREADS: "1"}

    received: list[int] = []  # preemption signals the caller got while the children ran (forwarded to them)
    _start_resource_tracker()
    with (
        _restored_signal_handlers(),
        _temporary_environ(env_updates),
        tempfile.TemporaryDirectory(prefix="deepepochs-launch-") as result_dir,
        _ChildrenStderr() as stderr,
    ):
        result_path = os.path.join(result_dir, _RESULT_FILE)
        context = mp.start_processes(
            _run_rank,
            # main travels pickled and is unpickled inside _run_rank, where torch records any error with its
            # traceback for the parent (an error while spawn unpickles the arguments would only be printed)
            args=(pickle.dumps(main), world_size, master_port, result_path),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        stderr.started()
        _forward_preemption_signals(context.processes, received)
        join_kwargs = {"grace_period": _SHUTDOWN_GRACE_S} if _JOIN_HAS_GRACE_PERIOD else {}
        try:
            # join() returns False while some processes still run; on the first failure it terminates the
            # others (a rank blocked in a collective would otherwise wait for its dead peer forever) and
            # raises ProcessRaisedException (a traceback was captured) or ProcessExitedException.
            while not context.join(**join_kwargs):
                pass
        except ProcessException as exc:
            _stop_processes(context.processes)
            if not (isinstance(exc, ProcessExitedException) and os.path.exists(result_path)
                    and all(os.path.exists(_done_path(result_path, r)) for r in range(world_size))):
                raise _distributed_error(exc, context.error_files, world_size, stderr.tail()) from exc
            # Every rank's main() returned and rank 0's result was delivered: the run succeeded, whatever
            # ended a process afterwards (at exit, e.g. in an atexit handler of the user's or a library).
            how = f"signal {exc.signal_name}" if exc.signal_name else f"exit code {exc.exit_code}"
            warnings.warn(f"launch: rank {exc.error_index} of {world_size} ended with {how} after main() had"
                          " returned on every rank; the result of rank 0 is returned", DeepEpochsWarning,
                          stacklevel=2)
        finally:
            # Normally a no-op. Matters when the caller is interrupted (Ctrl-C) while waiting: no child
            # may outlive the call.
            _stop_processes(context.processes)

        preempted = _read_preempted(result_dir, world_size)
        if preempted is not None:
            raise preempted
        if not os.path.exists(result_path) and not received:
            raise DistributedError(
                f"launch: rank 0 of {world_size} exited without returning from main() (did main() call "
                "sys.exit(0) or catch KeyboardInterrupt?); no result to return"
            )
        result = None
        if os.path.exists(result_path):
            with open(result_path, "rb") as fh:
                result = pickle.load(fh)
    if received:  # not a clean preemption: the caller's own handler (by default: the end) gets the signal now
        signal.raise_signal(received[0])
    return result


def _forward_preemption_signals(processes: list[Any], received: list[int]) -> None:
    """While the children run, SIGTERM and SIGUSR1 sent to this process are passed on to them (a
    `SnapshotCallback` there stops every rank at one commit point) and remembered in `received`.
    `_restored_signal_handlers` gives the caller's handlers back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        return

    def forward(signum, frame):
        received.append(signum)
        for process in processes:
            if process.is_alive():
                try:
                    os.kill(process.pid, signum)
                except OSError:
                    pass

    for name in _FORWARDED_SIGNALS:
        number = getattr(signal, name, None)
        if number is not None:
            signal.signal(number, forward)


def _start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker now, before `_ChildrenStderr` points stderr at its pipe.

    Why: the first spawn starts the tracker, a process that lives as long as this one and keeps a copy of
    stderr. Started while stderr is the pipe, it holds the pipe open after the children ended, so the pump
    never saw the end of it and every launch waited `_SHUTDOWN_GRACE_S` (2 s) for nothing at its end.
    """
    try:
        from multiprocessing import resource_tracker
    except ImportError:  # Windows: no resource tracker
        return
    with contextlib.suppress(Exception):  # only a speed-up: without it launch still works, 2 s slower
        resource_tracker.ensure_running()


def _find_free_port() -> int:
    """Return a TCP port on the loopback interface that is unused right now (chosen by the OS)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_MASTER_ADDR, 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _temporary_environ(updates: Mapping[str, str]) -> Iterator[None]:
    """Set ``updates`` in ``os.environ`` and afterwards restore each key's previous value (or absence)."""
    previous = {key: os.environ.get(key) for key in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _restored_signal_handlers() -> Iterator[None]:
    """Give back the caller's SIGINT, SIGTERM and SIGUSR1 handlers afterwards, whatever the code inside changed."""
    signals = (signal.SIGINT, *(getattr(signal, name) for name in _FORWARDED_SIGNALS if hasattr(signal, name)))
    saved = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        # Handlers can only be installed from the main thread; launched from another thread, nothing here
        # could have changed them either. ``None`` means a handler not installed from Python: leave it.
        if threading.current_thread() is threading.main_thread():
            for sig, handler in saved.items():
                if handler is not None and signal.getsignal(sig) is not handler:
                    signal.signal(sig, handler)
