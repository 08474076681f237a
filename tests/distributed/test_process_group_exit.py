"""The process group and rendezvous store deepepochs creates from the environment are released at
interpreter exit (an atexit handler), not left to the interpreter's teardown: there, their C++ threads
were destroyed while still joinable in 5-7 of 30 clean two-process torchrun runs (SIGABRT, "terminate
called without an active exception"); released at exit, 0 of 30 (measured, see CHANGELOG)."""

import socket
import sys

import pytest
import torch.distributed as dist

from deepepochs.parallel import process_group

pytestmark = pytest.mark.skipif(not dist.is_available() or sys.platform == "win32", reason="needs torch.distributed")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_group_and_store_deepepochs_created_are_released_by_the_exit_handler(monkeypatch):
    """A group joined from RANK/WORLD_SIZE/MASTER_* (no close() called): the exit handler destroys it and
    drops the store; a group the caller created is left alone."""
    assert not dist.is_initialized()
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(name, value)
    use = process_group.GroupUse("gloo", 30)
    assert use.owned and dist.is_initialized() and process_group._env_store is not None
    process_group._release_at_exit()
    assert not dist.is_initialized() and process_group._env_store is None
    use.release()  # a close() after it changes nothing
    assert not dist.is_initialized()


def test_the_exit_handler_leaves_a_group_the_caller_created(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        use = process_group.GroupUse("gloo", 30)
        assert not use.owned
        process_group._release_at_exit()
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
