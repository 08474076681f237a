"""`launch_with_deadline`: a two-process `launch` that can never hang a test run (shared by the DDP tests)."""

import multiprocessing
import threading

import pytest

from deepepochs.launch import launch

__all__ = ["launch_with_deadline"]


def launch_with_deadline(main, seconds: float):
    """`launch(main, num_processes=2)`, killing its processes (and failing) after `seconds`."""
    before = set(multiprocessing.active_children())
    expired = threading.Event()

    def stop():
        expired.set()
        for child in set(multiprocessing.active_children()) - before:
            child.kill()

    timer = threading.Timer(seconds, stop)
    timer.daemon = True
    timer.start()
    try:
        return launch(main, num_processes=2)
    finally:
        timer.cancel()
        if expired.is_set():
            pytest.fail(f"{main.__name__} did not finish within {seconds} s; its processes were killed")
