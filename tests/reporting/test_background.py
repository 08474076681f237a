"""`BackgroundCalls`: calls to a slow or failing service run in order on their own thread; the caller never
waits, a full queue drops and says so, a failure is said once with its reason, close waits a bounded time."""

import gc
import threading
import time

from deepepochs.reporting.background import BackgroundCalls


def _threads(name):
    return [t for t in threading.enumerate() if t.name == name and t.is_alive()]


def test_calls_run_in_the_order_they_were_put():
    """Every call runs, once, in order, and close reports that everything queued ran."""
    calls, seen = BackgroundCalls("bg-order"), []
    for i in range(50):
        assert calls.put(lambda i=i: seen.append(i))
    assert calls.close(10)
    assert seen == list(range(50))
    assert calls.failed == 0 and calls.dropped == 0 and calls.report() == []


def test_a_full_queue_drops_the_call_without_waiting_and_reports_the_count_once():
    """With the worker blocked, calls past the queue's size are dropped at once and reported once."""
    release = threading.Event()
    calls = BackgroundCalls("bg-full", maxsize=2)
    calls.put(release.wait)  # taken by the worker, which then blocks
    time.sleep(0.2)
    start = time.monotonic()
    accepted = [calls.put(lambda: None) for _ in range(5)]
    assert time.monotonic() - start < 0.5
    assert accepted == [True, True, False, False, False] and calls.dropped == 3
    assert calls.report() == ["3 call(s) were dropped: the queue of 2 was full"]
    assert calls.report() == []
    release.set()
    assert calls.close(10)


def test_a_failing_call_is_reported_once_with_its_reason_and_the_next_calls_still_run():
    """The first error is kept with its type and message; later calls run; the report says it once."""
    calls, seen = BackgroundCalls("bg-fail"), []

    def fail(n):
        raise ConnectionError(f"server down ({n})")

    calls.put(lambda: fail(1))
    calls.put(lambda: fail(2))
    calls.put(lambda: seen.append("after"))
    assert calls.flush(10)
    assert seen == ["after"] and calls.failed == 2
    assert calls.report() == ["a call failed (ConnectionError: server down (1))"]
    assert calls.report() == []
    calls.close(10)


def test_close_waits_at_most_its_timeout_for_a_call_that_hangs():
    """A call that never returns costs close() its timeout, not more; calls put afterwards are dropped."""
    hang = threading.Event()
    calls = BackgroundCalls("bg-hang")
    calls.put(hang.wait)
    calls.put(lambda: None)
    start = time.monotonic()
    assert calls.close(0.5) is False
    assert 0.4 < time.monotonic() - start < 3
    assert calls.put(lambda: None) is False
    hang.set()


def test_an_unclosed_queue_ends_its_thread_when_it_is_freed():
    """Dropping the object without close() ends its worker thread (no thread outlives its owner)."""
    calls = BackgroundCalls("bg-freed")
    calls.put(lambda: None)
    assert _threads("bg-freed")
    del calls
    gc.collect()
    deadline = time.monotonic() + 10
    while _threads("bg-freed") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _threads("bg-freed")
