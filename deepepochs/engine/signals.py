"""Holding Ctrl-C during an update: the update is a critical section.

A SIGINT that lands inside `optimizer.step()` (Adam on the CPU updates parameters one by one) would leave
some parameters updated and others not, and no rollback can tell which. While `fit` or `test` runs, the
guard replaces the SIGINT handler (main thread only); inside an update (`hold` ... `release`) a SIGINT is
noted and delivered when the update and its scheduler step are complete. Outside one, it is delivered at
once. A SIGINT the process ignores (a job started in the background) stays ignored: the guard is not
installed. Delivery means what the caller's handler would have done: call it, ignore the signal, or raise
`KeyboardInterrupt`. The caller's handler is put back when `fit`/`test` returns or raises.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["InterruptGuard"]


class InterruptGuard:
    """Defers SIGINT during critical sections; see the module doc."""

    __slots__ = ("holding", "pending", "_previous", "_installed")

    def __init__(self):
        self.holding = False
        self.pending = None
        self._previous = None
        self._installed = False

    def install(self) -> None:
        """Take over SIGINT until `uninstall` (a no-op outside the main thread or when already installed)."""
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        current = signal.getsignal(signal.SIGINT)
        if current is None:  # a handler set outside Python: it could not be put back
            return
        if current == signal.SIG_IGN:  # ignored (a background job): nothing to hold, and the processes the
            return  # stage starts keep inheriting the ignoring, which exec would reset for a handler
        try:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        except (ValueError, OSError):  # no signal support here (e.g. an embedded interpreter)
            return
        self._installed = True

    def uninstall(self) -> None:
        """Give SIGINT back to the handler that had it before `install`."""
        self.holding, self.pending = False, None
        if self._installed:
            self._installed = False
            signal.signal(signal.SIGINT, self._previous)

    def hold(self) -> None:
        """Enter a critical section: a SIGINT from now on waits for `release`."""
        self.holding = True

    def release(self) -> None:
        """Leave the critical section and deliver a SIGINT that arrived inside it."""
        self.holding = False
        pending = self.pending
        if pending is not None:
            self.pending = None
            self._deliver(*pending)

    def drop(self) -> None:
        """Leave the critical section after an exception, forgetting a held SIGINT (the exception wins)."""
        self.holding, self.pending = False, None

    def _handle(self, signum, frame) -> None:
        if self.holding:
            self.pending = (signum, frame)
        else:
            self._deliver(signum, frame)

    def _deliver(self, signum, frame) -> None:
        previous = self._previous
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt
