"""Starting gloo worker processes from a test: a free loopback port, and `mp.spawn` with a deadline.

Test modules in tests/ import this from their own folder (pytest puts it on `sys.path`)."""

from __future__ import annotations

import socket
import time

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for `init_method='tcp://127.0.0.1:<port>'`)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_with_deadline(worker, args: tuple, nprocs: int = 2, seconds: float = 120) -> None:
    """`mp.spawn(worker, args, nprocs)`; past `seconds` the processes are killed and the test fails (a hung
    collective must not hang the suite). A worker's exception is raised here, as `mp.spawn` raises it."""
    context = mp.spawn(worker, args=args, nprocs=nprocs, join=False, daemon=True)
    deadline = time.monotonic() + seconds
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {nprocs} worker processes did not finish within {seconds:.0f} s")
