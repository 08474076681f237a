"""How a failing rank ends a launch: the other children are stopped (a grace period, SIGTERM, SIGKILL),
and the caller gets one :class:`~deepepochs.errors.DistributedError` carrying the failing rank's
traceback, or the end of what the children printed to stderr when there is none.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import sys
import threading
from typing import Any

from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

from deepepochs.errors import DistributedError

__all__ = ["_SHUTDOWN_GRACE_S", "_ChildrenStderr", "_distributed_error", "_stop_processes"]

# After one rank fails, the others get this long to exit on their own (for example after their own
# collective errored), then SIGTERM, then the same again before SIGKILL. Kept short so that a rank blocked
# in a collective that will never complete does not keep the caller waiting.
_SHUTDOWN_GRACE_S = 2.0

# How much of the children's stderr an error message carries (its end), for failures without a traceback
# file (a child that died importing the script).
_STDERR_TAIL = 16384


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
    stall = _stall_sentence(tracebacks)
    if stall is not None:  # said once, from rank 0's view where it wrote one, before the tracebacks
        with contextlib.suppress(OSError, ValueError, AttributeError):
            print(f"launch: {stall}", file=sys.stderr, flush=True)
        header = f"{header}\n{stall}"
    return DistributedError(header + "\n" + "\n".join(sections))


#: The first line of a rank's error that names every rank's place (`deepepochs.parallel.stall_report`).
_STALL_LINE = re.compile(r"DistributedError: (rank \d+ of \d+: a collective .*)$", re.MULTILINE)


def _stall_sentence(tracebacks: list) -> str | None:
    """The line of a rank's stall report that says who waits for whom, rank 0's where it wrote one."""
    found = {rank: match.group(1) for _, rank, text in tracebacks if (match := _STALL_LINE.search(text))}
    return found[min(found)] if found else None


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
