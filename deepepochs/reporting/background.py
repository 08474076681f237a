"""`BackgroundCalls`: calls to a service that may be slow or down (an experiment tracker's server), run
in order on a thread of their own through a bounded queue, so that the training loop never waits for them.

The caller's side never blocks: `put` drops a call when the queue is full (the service is too slow to keep
up) and counts it; a call that raises is counted and its error kept. `report()` hands the first failure,
and later a count of drops, to the caller once each, so the caller can say so on its own thread (a warning
raised on the worker thread would reach nobody). `close(timeout)` waits at most `timeout` seconds for the
calls already queued, then leaves the thread behind (a daemon: it cannot keep the process alive). As the
TensorBoard writers do (`summary_writer.RunWriters`), the thread is also ended when its owner is freed
without `close()`, and at the interpreter's exit, after the same bounded wait.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable

__all__ = ["BackgroundCalls"]

_STOP = object()  # the sentinel that ends the worker


class _Shared:
    """What the worker thread and the caller share (never the `BackgroundCalls` object itself, so that
    freeing it can end the thread)."""

    def __init__(self, maxsize: int):
        self.calls: queue.Queue = queue.Queue(maxsize)
        self.lock = threading.Lock()
        self.failed = 0
        self.first_error: str | None = None
        self.dropped = 0


def _work(shared: _Shared) -> None:
    """The worker: run each queued call; count and keep the first error of those that raise."""
    while True:
        call = shared.calls.get()
        try:
            if call is _STOP:
                return
            call()
        except Exception as e:  # a service error costs this call, never the worker
            with shared.lock:
                shared.failed += 1
                if shared.first_error is None:
                    shared.first_error = f"{type(e).__name__}: {e}"
        finally:
            shared.calls.task_done()


def _stop(shared: _Shared, thread: threading.Thread, timeout: float) -> bool:
    """Wait up to `timeout` seconds for the queued calls, then ask the worker to end; whether it ended."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            shared.calls.put(_STOP, timeout=max(0.0, deadline - time.monotonic()))
            break
        except queue.Full:
            if time.monotonic() >= deadline:
                return False
    thread.join(max(0.0, deadline - time.monotonic()))
    return not thread.is_alive()


class BackgroundCalls:
    """Run calls in order on one daemon thread, through a queue of at most `maxsize` calls.

    Args:
        name: the thread's name (shown by debuggers and `threading.enumerate()`).
        maxsize: how many calls may wait; a call put while the queue is full is dropped.
        exit_timeout: how long the interpreter's exit (or freeing this object unclosed) waits for the
            queued calls.
    """

    def __init__(self, name: str, maxsize: int = 1000, exit_timeout: float = 10.0):
        self._shared = _Shared(maxsize)
        self._thread = threading.Thread(target=_work, args=(self._shared,), name=name, daemon=True)
        self._thread.start()
        self._closed = False
        self._reported_error = False
        self._reported_drops = 0
        self._finalizer = weakref.finalize(self, _stop, self._shared, self._thread, exit_timeout)

    def put(self, call: Callable[[], object]) -> bool:
        """Queue `call` without waiting; False when it was dropped (the queue is full, or closed)."""
        if not self._closed:
            try:
                self._shared.calls.put_nowait(call)
                return True
            except queue.Full:
                pass
        with self._shared.lock:
            self._shared.dropped += 1
        return False

    @property
    def failed(self) -> int:
        """How many calls raised."""
        return self._shared.failed

    @property
    def dropped(self) -> int:
        """How many calls were dropped (queue full or closed)."""
        return self._shared.dropped

    def pending(self) -> int:
        """How many queued calls have not finished yet."""
        return self._shared.calls.unfinished_tasks

    def report(self) -> list[str]:
        """What was not said yet: the first failure (once, with its reason), then the calls dropped since
        the last report."""
        out = []
        with self._shared.lock:
            if self._shared.first_error is not None and not self._reported_error:
                self._reported_error = True
                out.append(f"a call failed ({self._shared.first_error})")
            if self._shared.dropped > self._reported_drops:
                out.append(f"{self._shared.dropped - self._reported_drops} call(s) were dropped: the queue of"
                           f" {self._shared.calls.maxsize} was full")
                self._reported_drops = self._shared.dropped
        return out

    def flush(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds until every call queued so far has run; whether they all did."""
        deadline = time.monotonic() + timeout
        calls = self._shared.calls
        with calls.all_tasks_done:
            while calls.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                calls.all_tasks_done.wait(left)
        return True

    def close(self, timeout: float) -> bool:
        """Run what is queued, waiting at most `timeout` seconds, then end the thread (idempotent); whether
        everything queued ran. Calls put afterwards are dropped."""
        if self._closed:
            return not self._thread.is_alive()
        self._closed = True
        self._finalizer.detach()
        return _stop(self._shared, self._thread, timeout)
