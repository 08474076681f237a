"""`launch_with_deadline`: a `launch` that can never hang a test run (shared by the DDP tests)."""

import multiprocessing
import threading

import pytest

from deepepochs.launch import launch

__all__ = ["TORCHRUN_VARIABLES", "launch_scenarios", "launch_with_deadline", "launched_ranks", "teardown_abort"]

#: What torchrun sets; a test launching its own processes clears them, so `launch` starts a fresh group.
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launch_with_deadline(main, seconds: float, num_processes: int = 2):
    """`launch(main, num_processes=num_processes)`, killing its processes (and failing) after `seconds`."""
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
        return launch(main, num_processes=num_processes)
    finally:
        timer.cancel()
        if expired.is_set():
            pytest.fail(f"{main.__name__} did not finish within {seconds} s; its processes were killed")


def launch_scenarios(main, out_env: str, out, seconds: float, num_processes: int = 2):
    """`launch_with_deadline` with the torchrun variables cleared and `out_env` naming the folder `out`,
    where the processes leave what they recorded."""
    with pytest.MonkeyPatch.context() as patch:
        for name in TORCHRUN_VARIABLES:
            patch.delenv(name, raising=False)
        patch.setenv(out_env, str(out))
        return launch_with_deadline(main, seconds=seconds, num_processes=num_processes)


def launched_ranks(main, out_env: str, out, seconds: float = 240, num_processes: int = 2) -> list:
    """`launch_scenarios`, then what each rank saved as `rank<r>.pt` in `out`, in rank order."""
    import torch  # noqa: PLC0415  (the other helpers here need no torch)

    launch_scenarios(main, out_env, out, seconds, num_processes)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(num_processes)]


def teardown_abort(returncode: int, stderr: str) -> bool:
    """Whether a torchrun run failed only by torch's known abort at interpreter exit: a worker ends with
    SIGABRT ("terminate called without an active exception", gloo's threads torn down while joinable; plain
    torch does it too, about 1 run in 12-24 here, README "Distributed training"). Callers still check what
    the run produced, so a run that failed before finishing its work still fails."""
    return returncode != 0 and "terminate called without an active exception" in stderr
