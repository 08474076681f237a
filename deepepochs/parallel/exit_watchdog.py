"""A bound on a teardown step that torch may block in: past the bound the process ends with a clear message
instead of hanging (a launcher, or a SLURM job, would otherwise wait for it until its time limit).

Two watchmen, because a blocked step may or may not hold the GIL:

- a Python thread that waits on an event; when the step has not finished within `seconds`, it writes a
  message naming the step to stderr and ends the process with `os._exit(status)`. It can only act while
  the blocked thread released the GIL (a wait inside torch that releases it, such as a destructor joining
  gloo's threads);
- `faulthandler`'s C watchdog, a little later, for a step that blocks while holding the GIL (no Python
  thread can run then): it prints every thread's traceback and ends the process with status 1.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading

__all__ = ["bounded", "exit_status"]

# How much later than the Python watchman the C one acts (seconds).
_C_WATCHMAN_DELAY_S = 10.0


def exit_status() -> int:
    """The status the process would end with, as far as an exit handler can know: the code of an uncaught
    `SystemExit` (e.g. `Preempted`) or 1 after another uncaught exception, as the interpreter reported it
    (`sys.last_value`), else 0."""
    exc = getattr(sys, "last_value", None)
    if exc is None:
        return 0
    if isinstance(exc, SystemExit):
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 1


def _watch(done: threading.Event, what: str, seconds: float, status: int) -> None:
    if done.wait(seconds):
        return
    message = (f"deepepochs: {what} did not finish within {seconds:g} s (torch is blocked in it); ending "
               f"this process with exit status {status} instead of waiting\n")
    try:
        os.write(2, message.encode())
    except OSError:
        pass
    os._exit(status)


@contextlib.contextmanager
def bounded(what: str, seconds: float, status: int | None = None):
    """Run the block; if it has not finished within `seconds`, end the process (see the module docstring)
    with `status` (default: `exit_status()`), after writing a message naming `what` to stderr."""
    done = threading.Event()
    code = exit_status() if status is None else status
    watchman = threading.Thread(target=_watch, args=(done, what, seconds, code), daemon=True,
                                name="deepepochs-exit-watchdog")
    watchman.start()
    faulthandler.dump_traceback_later(seconds + _C_WATCHMAN_DELAY_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        done.set()
        watchman.join()
