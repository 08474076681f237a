"""Start a training function in one process per device, the way ``torchrun`` would (DDP-1, DDP-2).

``launch(main)`` is the entry point of multi-process training from a plain ``python train.py`` (or an IDE's
run button). It does not train anything itself: it starts the processes, gives each one the environment
variables ``torchrun`` would give it, runs ``main()`` in each, and hands rank 0's return value back.

Division of labour with the Trainer:

- ``launch`` sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
  ``MASTER_PORT`` in every child before ``main()`` runs. It never initialises a process group.
- The Trainer built inside ``main()`` reads those variables, picks its device from ``LOCAL_RANK``,
  initialises the default process group from the environment (gloo on CPU, nccl on CUDA) and destroys it
  in ``close()``. Under ``torchrun`` the same variables come from ``torchrun``, so the Trainer's code path is
  identical.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import inspect
import os
import pickle
import signal
import socket
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from numbers import Integral
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

from deepepochs.errors import ConfigError, DeepEpochsWarning, DistributedError, Preempted

__all__ = ["launch"]

T = TypeVar("T")

# The variables torchrun exports to each worker; the Trainer reads them to join the group.
_ENV_RANK = "RANK"
_ENV_LOCAL_RANK = "LOCAL_RANK"
_ENV_WORLD_SIZE = "WORLD_SIZE"
_ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
_ENV_MASTER_ADDR = "MASTER_ADDR"
_ENV_MASTER_PORT = "MASTER_PORT"
_ENV_OMP_THREADS = "OMP_NUM_THREADS"

# All processes run on this machine, so rank 0's rendezvous store listens on the loopback interface only.
_MASTER_ADDR = "127.0.0.1"

# After one rank fails, the others get this long to exit on their own (for example after their own
# collective errored), then SIGTERM, then the same again before SIGKILL. Kept short so that a rank blocked
# in a collective that will never complete does not keep the caller waiting.
_SHUTDOWN_GRACE_S = 2.0

# ``ProcessContext.join(grace_period=...)`` exists only in newer torch releases; older ones SIGTERM the
# survivors at once, which is just as prompt.
_JOIN_HAS_GRACE_PERIOD = "grace_period" in inspect.signature(mp.ProcessContext.join).parameters

_RESULT_FILE = "rank0-result.pickle"
# Signals the parent passes on to its children: those a SnapshotCallback listens for by default.
_FORWARDED_SIGNALS = ("SIGTERM", "SIGUSR1")

# How much of the children's stderr an error message carries (its end), for failures without a traceback
# file (a child that died importing the script).
_STDERR_TAIL = 16384

_IMPORTABLE_FIX = (
    "define main at the top level of an importable .py file and call launch(main) under "
    "`if __name__ == '__main__':` (in a notebook, save main to a module, import it and pass the imported "
    "function), or pass num_processes=1 to run it in this process"
)


def launch(main: Callable[[], T], num_processes: int | None = None) -> T:
    """Run ``main()`` in ``num_processes`` processes and return rank 0's result.

    Each process is a fresh Python interpreter (spawn start method) that imports ``main`` and calls it with
    no arguments, so everything a rank needs (data, model, optimizer, ``Trainer``) is created inside
    ``main``. The environment variables ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` are set in each process before ``main()`` runs, exactly as under
    ``torchrun``; the ``Trainer`` initialises the process group from them. ``launch`` itself never does.

    - Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` are set) or when a process group is already
      initialised, ``main()`` is simply called in every rank; rank 0 gets its result and the other ranks
      get None, as they would if ``launch`` had started them, so ``if result is not None: print(result)``
      prints once under either launcher. The process count is then ``torchrun``'s (``num_processes`` is
      ignored).
    - ``num_processes=1`` calls ``main()`` in this process, without touching the environment; handy for
      debugging, and any callable (a lambda too) is accepted.
    - With several processes, the first failing process ends the whole group (the others are terminated,
      even when blocked in a collective) and :class:`~deepepochs.errors.DistributedError` is raised here
      with that process's traceback. Nothing is restarted.
    - While the processes run, ``OMP_NUM_THREADS=1`` is set if the caller has not set it. The caller's
      environment and its SIGINT/SIGTERM/SIGUSR1 handlers are the same after the call as before it.
    - SIGTERM and SIGUSR1 sent to this process while the processes run are passed on to them. When every
      rank ends ``fit`` with :class:`~deepepochs.errors.Preempted` (a ``SnapshotCallback`` stopped them at
      one commit point), ``Preempted`` is raised here too: left uncaught, the script exits with its
      status (143 for SIGTERM) and a requeued job resumes with ``resume=True``. A forwarded signal that
      did not end in ``Preempted`` is delivered to the caller's own handler once the processes ended.

    The return value of rank 0 travels back by pickle, so it must be a plain picklable object: a dict of
    floats, lists, strings... Convert tensors with ``.item()`` or ``.tolist()`` (or at least ``.cpu()``);
    the other ranks' return values are discarded.

    Args:
        main: A function taking no arguments. With more than one process it must be importable by the child
            processes: defined at the top level of a module or of the script being run, not a lambda, not a
            nested function, not defined in a notebook cell or an interactive session.
        num_processes: How many processes to start. ``None`` means one per visible CUDA device
            (``torch.cuda.device_count()``), or 1 when there is none. Choose the devices with
            ``CUDA_VISIBLE_DEVICES``.

    Returns:
        What ``main()`` returned in the rank 0 process; None in the other ranks of a ``torchrun`` job.

    Raises:
        ConfigError: ``num_processes`` is not a positive int or None, ``main`` is not callable, or (with
            more than one process) ``main`` cannot be imported by the child processes (a lambda, a nested
            function, one defined in a notebook or under the script's ``if __name__ == '__main__':``).
        DistributedError: A process raised an exception or died; the message holds its traceback (a
            child that died before ``main`` ran, e.g. importing the script, carries the end of what the
            children printed to stderr). The children's stderr reaches the caller's as it comes.

    Example:
        ``launch`` runs any no-argument function; with one process it simply calls it:

        >>> from deepepochs.launch import launch
        >>> launch(lambda: {"loss": 0.25}, num_processes=1)
        {'loss': 0.25}

        A multi-process training script (save as ``train.py``, run ``python train.py``)::

            import torch
            from torch import nn
            from torch.nn import functional as F
            from torch.utils.data import DataLoader, TensorDataset
            from deepepochs import Trainer, launch


            def main():
                x = torch.randn(256, 16)
                y = (x[:, 0] > 0).long()
                train_dl = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
                model = nn.Linear(16, 2)
                opt = torch.optim.Adam(model.parameters(), lr=1e-3)
                with Trainer(model, F.cross_entropy, opt, epochs=3) as trainer:
                    trainer.fit(train_dl)
                    return trainer.test(train_dl)


            if __name__ == "__main__":
                print(launch(main, num_processes=2))
    """
    if not callable(main):
        raise ConfigError(
            f"main must be a callable taking no arguments (got {main!r} of type {type(main).__name__}); "
            "pass the function itself, e.g. launch(main), not launch(main())"
        )
    _check_num_processes(num_processes)

    # Already inside a distributed job: torchrun (or another launcher) started this process, or the caller
    # set up the group by hand. Starting more processes here would nest jobs, so just run.
    if _inside_distributed_job():
        rank = _job_rank()  # read before main(): a Trainer inside it may destroy the group it made
        result = main()
        return result if rank == 0 else None  # one rule under every launcher: rank 0's result, else None

    world_size = num_processes if num_processes is not None else max(1, torch.cuda.device_count())
    if world_size == 1:
        return main()
    _check_importable(main)
    return _spawn(main, int(world_size))


def _check_num_processes(num_processes: object) -> None:
    """Raise ConfigError unless ``num_processes`` is None or a positive integer (bool is not a count)."""
    if num_processes is None:
        return
    if isinstance(num_processes, bool) or not isinstance(num_processes, Integral) or num_processes < 1:
        raise ConfigError(
            "num_processes must be a positive int, or None for one process per visible GPU "
            f"(got {num_processes!r} of type {type(num_processes).__name__}); e.g. num_processes=2"
        )


def _job_rank() -> int:
    """This process's global rank in the job it already belongs to (the live group's, else ``RANK``)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get(_ENV_RANK, "0"))
    except ValueError:
        return 0  # a malformed RANK is the Trainer's to report when it joins the group


def _inside_distributed_job() -> bool:
    """Return whether this process already belongs to a distributed job (torchrun env or live group)."""
    if _ENV_RANK in os.environ and _ENV_WORLD_SIZE in os.environ:
        return True
    return dist.is_available() and dist.is_initialized()


def _check_importable(main: Callable[[], Any]) -> None:
    """Raise ConfigError when spawned children could not import ``main``.

    A spawned child is a new interpreter: it receives ``main`` pickled *by reference* (module name plus
    qualified name) and imports it again. That fails for objects that have no importable name, and it
    fails late and obscurely (an AttributeError in every child), so we check in the parent first.
    """
    name = getattr(main, "__qualname__", None) or getattr(main, "__name__", None) or repr(main)
    if getattr(main, "__name__", None) == "<lambda>":
        raise ConfigError(f"main is a lambda, which child processes cannot import; {_IMPORTABLE_FIX}")
    if "<locals>" in name:
        raise ConfigError(
            f"main ({name!r}) is defined inside another function, which child processes cannot import; "
            f"{_IMPORTABLE_FIX}"
        )
    # A script run as ``python train.py`` is fine: spawn re-imports it in each child as ``__mp_main__``.
    # An interactive session or a notebook kernel has a ``__main__`` without a file to re-import.
    if getattr(main, "__module__", None) == "__main__" and not hasattr(sys.modules["__main__"], "__file__"):
        raise ConfigError(
            f"main ({name!r}) is defined in an interactive session or notebook, whose code child processes "
            f"cannot import; {_IMPORTABLE_FIX}"
        )
    guard = _defined_only_under_main_guard(main)
    if guard is not None:
        raise ConfigError(
            f"main ({name!r}) is defined under `if __name__ == '__main__':` (line {guard} of "
            f"{sys.modules['__main__'].__file__}); child processes import the script without running that "
            f"block, so they cannot find main; {_IMPORTABLE_FIX}"
        )
    try:
        pickle.loads(pickle.dumps(main))
    except Exception as exc:
        raise ConfigError(
            f"main ({name!r}) cannot be pickled for the child processes "
            f"({type(exc).__name__}: {exc}); {_IMPORTABLE_FIX}"
        ) from exc


def _defined_only_under_main_guard(main: Callable[[], Any]) -> int | None:
    """The line where the script run as ``__main__`` defines ``main``'s name inside an
    ``if __name__ == '__main__':`` block, when nothing at its top level defines that name too; else None.

    A spawned child imports the script under another name (``__mp_main__``), so such a block never runs
    there and the child cannot find ``main``. Read from the script's source; a source that cannot be read
    or parsed gives None (the child's own error then carries its traceback)."""
    if getattr(main, "__module__", None) != "__main__" or "." in getattr(main, "__qualname__", "."):
        return None
    path = getattr(sys.modules["__main__"], "__file__", None)
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
    except (OSError, TypeError, SyntaxError, ValueError):
        return None
    name = main.__name__
    guarded_line = None
    for node in tree.body:
        if _is_main_guard(node):
            guarded_line = guarded_line or next(
                (inner.lineno for inner in ast.walk(node) if name in _names_bound(inner)), None)
        elif any(name in _names_bound(inner) for inner in ast.walk(node)):
            return None  # defined (or imported) outside the guard as well
    return guarded_line


def _is_main_guard(node: ast.stmt) -> bool:
    """Whether `node` is ``if __name__ == '__main__':`` (either operand order)."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare) or len(node.test.ops) != 1:
        return False
    sides = [node.test.left, *node.test.comparators]
    return (isinstance(node.test.ops[0], ast.Eq)
            and any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides)
            and any(isinstance(x, ast.Constant) and x.value == "__main__" for x in sides))


def _names_bound(node: ast.AST) -> set[str]:
    """The module-level names `node` itself binds (a def, a class, an assignment target, an import)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        return {node.id}
    return set()


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


def _preempted_path(result_dir: str, rank: int) -> str:
    return os.path.join(result_dir, f"rank{rank}.preempted")


def _read_preempted(result_dir: str, world_size: int) -> Preempted | None:
    """Rank 0's `Preempted` when every rank stopped on one (see `_run_rank`), else None."""
    paths = [_preempted_path(result_dir, rank) for rank in range(world_size)]
    if not all(os.path.exists(path) for path in paths):
        return None
    with open(paths[0], "rb") as fh:
        code, signal_name, snapshot = pickle.load(fh)
    return Preempted(code, signal_name, None if snapshot is None else Path(snapshot))


def _run_rank(local_rank: int, main_pickled: bytes, world_size: int, master_port: int, result_path: str) -> None:
    """Child-process entry: export the torchrun-style environment, run ``main()``, save rank 0's result.

    Top level of this module so that ``torch.multiprocessing`` can pickle it by reference.
    """
    main = pickle.loads(main_pickled)
    os.environ.update(
        {
            _ENV_RANK: str(local_rank),
            _ENV_LOCAL_RANK: str(local_rank),
            _ENV_WORLD_SIZE: str(world_size),
            _ENV_LOCAL_WORLD_SIZE: str(world_size),
            _ENV_MASTER_ADDR: _MASTER_ADDR,
            _ENV_MASTER_PORT: str(master_port),
        }
    )
    # No init_process_group here: the Trainer creates the group from these variables (and so owns it and
    # destroys it), exactly as it does under torchrun.
    try:
        result = main()
    except Preempted as stop:
        # Every rank stopped at the same commit point (SnapshotCallback): no failure. The parent raises it
        # once all ranks ended so; a clean exit here keeps the others from being terminated meanwhile.
        with open(_preempted_path(os.path.dirname(result_path), local_rank), "wb") as fh:
            pickle.dump((stop.code, stop.signal_name, None if stop.path is None else str(stop.path)), fh)
        _exit_quietly()
    if local_rank == 0:
        _write_result(result, result_path)
    open(_done_path(result_path, local_rank), "w").close()
    _exit_quietly()


def _done_path(result_path: str, rank: int) -> str:
    """The marker a rank leaves beside the result file once its main() has returned."""
    return os.path.join(os.path.dirname(result_path), f"rank{rank}.done")


def _exit_quietly() -> None:
    """End a child whose main() returned: run its atexit handlers, flush its output, then leave without
    the interpreter's teardown.

    Why: that teardown sometimes aborts (SIGABRT, "terminate called without an active exception") when
    C++ threads of gloo or the TCPStore are destroyed while still joinable, after main() returned and the
    result was saved; plain torch does it too. The parent would then report a failed rank and drop the
    result. The child has nothing left to do, so it skips the teardown; the atexit handlers main()
    registered still run (`atexit._run_exitfuncs`, CPython's own hook for this; skipped if absent).
    """
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if run_exitfuncs is not None:
        run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


def _write_result(result: Any, result_path: str) -> None:
    """Pickle rank 0's result to ``result_path`` atomically (the parent reads it after all ranks exit)."""
    try:
        payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"launch: the value main() returned on rank 0 ({type(result).__name__}) cannot be sent back to "
            f"the caller ({type(exc).__name__}: {exc}); return plain picklable Python objects, converting "
            "tensors with .item() or .tolist()"
        ) from exc
    partial_path = result_path + ".partial"
    with open(partial_path, "wb") as fh:
        fh.write(payload)
    os.replace(partial_path, result_path)


def _distributed_error(
    exc: ProcessException, error_files: list[str | None], world_size: int, stderr_tail: str = ""
) -> DistributedError:
    """Build the caller-facing error from torch's, with the traceback of every rank that raised.

    torch reports the rank whose exit it noticed first. When a rank's collective failed *because* its
    peer died, both may have written a traceback; ordering them by the time they were written puts the
    root cause first. A rank that died before its function ran (its script failed when the child imported
    it) or without raising leaves no traceback file: the end of the children's stderr (`stderr_tail`) is
    carried instead, which holds whatever traceback the child printed.
    """
    tracebacks = []
    for rank, path in enumerate(error_files):
        if path is None or not os.path.exists(path):
            continue
        with contextlib.suppress(Exception):
            with open(path, "rb") as fh:
                tracebacks.append((os.path.getmtime(path), rank, pickle.load(fh)))
        # torch leaves these temporary files behind; they have been read now.
        with contextlib.suppress(OSError):
            os.unlink(path)
    tracebacks.sort()

    printed = "Traceback (most recent call last)" in stderr_tail
    if isinstance(exc, ProcessExitedException):
        how = f"signal {exc.signal_name}" if exc.signal_name else f"exit code {exc.exit_code}"
        if printed:
            header = (
                f"launch: rank {exc.error_index} of {world_size} died with {how}; processes still running "
                "were stopped. The children printed the traceback below (often the script failing when a "
                "child imports it: code outside `if __name__ == '__main__':` runs in every child)."
            )
        else:
            header = (
                f"launch: rank {exc.error_index} of {world_size} died with {how} without a Python traceback; "
                "processes still running were stopped. A signal often means the system killed it (out of "
                "memory); an exit code without traceback can come from os._exit(), sys.exit() or a crash in "
                "native code. If main is defined in a script, check that launch() is called under "
                "`if __name__ == '__main__':`."
            )
    else:
        first_rank = tracebacks[0][1] if tracebacks else exc.error_index
        header = (
            f"launch: rank {first_rank} of {world_size} raised an exception; processes still running "
            "were stopped."
        )
    if not tracebacks:
        printed_text = f"\n--- the children's stderr (last lines) ---\n{stderr_tail.rstrip()}" if stderr_tail else ""
        return DistributedError(f"{header}\n{exc.msg}{printed_text}")
    sections = [f"\n--- rank {rank} traceback ---\n{text.rstrip()}" for _, rank, text in tracebacks]
    return DistributedError(header + "\n" + "\n".join(sections))


class _ChildrenStderr:
    """The children's stderr: a pipe whose contents go on to this process's stderr as they come, the
    last `_STDERR_TAIL` bytes kept for the error message (the children inherit the pipe as their fd 2,
    set just while they start). Without a usable fd 2 (an embedded interpreter) nothing is changed."""

    def __init__(self):
        self._tail = bytearray()
        self._saved = self._write = self._thread = None

    def __enter__(self):
        try:
            sys.stderr.flush()
            self._saved = os.dup(2)
        except (OSError, ValueError, AttributeError):
            return self
        read, self._write = os.pipe()
        self._thread = threading.Thread(target=self._pump, args=(read,), name="deepepochs-launch-stderr",
                                        daemon=True)
        self._thread.start()
        os.dup2(self._write, 2)
        return self

    def _pump(self, read: int) -> None:
        with os.fdopen(read, "rb", buffering=0) as pipe:
            while chunk := pipe.read(65536):
                with contextlib.suppress(OSError):
                    os.write(self._saved, chunk)
                self._tail += chunk
                del self._tail[:-_STDERR_TAIL]

    def started(self) -> None:
        """The children hold the pipe now: give this process its own stderr back."""
        if self._write is not None:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                sys.stderr.flush()
            os.dup2(self._saved, 2)
            os.close(self._write)
            self._write = None

    def tail(self) -> str:
        """The end of what the children wrote to stderr (waits briefly for the last of it)."""
        if self._thread is not None:
            self._thread.join(_SHUTDOWN_GRACE_S)
        return self._tail.decode("utf-8", "replace")

    def __exit__(self, *exc_info) -> None:
        self.started()
        if self._saved is not None:
            if self._thread is not None:
                self._thread.join(_SHUTDOWN_GRACE_S)
                if self._thread.is_alive():  # a grandchild (a DataLoader worker) still holds the pipe:
                    return  # keep the fd the pump writes to open, or its number could be reused elsewhere
            os.close(self._saved)


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


def _stop_processes(processes: list[Any]) -> None:
    """Terminate (SIGTERM, then SIGKILL after a grace period) and reap every child still alive."""
    alive = [p for p in processes if p.is_alive()]
    for process in alive:
        process.terminate()
    for process in alive:
        process.join(_SHUTDOWN_GRACE_S)
        if process.is_alive():
            process.kill()
            process.join()


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
