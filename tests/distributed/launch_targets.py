"""Functions that ``tests/distributed/test_launch.py`` hands to ``launch``.

They live in their own importable module (not in the test file) because spawned children import ``main``
by module and name: the test module itself is not importable under that name in a child. Every collective
has a timeout, so a child can never wait forever even if ``launch`` failed to stop it.
"""

import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = [
    "TORCHRUN_VARIABLES",
    "CallableHoldingALock",
    "exit_without_traceback_on_rank_1",
    "gather_environments_and_all_reduce",
    "raise_on_rank_1_while_rank_0_is_stuck",
    "raise_on_rank_1_while_rank_0_waits_in_a_barrier",
    "rank_1_exits_badly_after_main_returned",
    "report_process",
    "return_unpicklable_on_rank_0",
    "train_with_a_trainer",
]

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_REPORTED_VARIABLES = (*TORCHRUN_VARIABLES, "OMP_NUM_THREADS")


def _join_gloo_group(timeout_s: float) -> None:
    """Initialise the default group from the environment, as the Trainer does on CPU."""
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))


def report_process() -> dict:
    """Return this process's id and the launch-related environment variables it sees."""
    return {
        "pid": os.getpid(),
        "env": {name: os.environ.get(name) for name in _REPORTED_VARIABLES},
        "torch_threads": torch.get_num_threads(),
    }


def gather_environments_and_all_reduce() -> dict:
    """Join a gloo group from the environment, gather every rank's report and sum ``rank + 1`` over ranks."""
    _join_gloo_group(timeout_s=30)
    try:
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report_process())
        value = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(value)
        return {"returned_by_rank": dist.get_rank(), "reports": reports, "sum": value.item()}
    finally:
        dist.destroy_process_group()


def raise_on_rank_1_while_rank_0_is_stuck() -> str:
    """Raise on rank 1 while rank 0 sleeps, like a rank stuck in a collective that never notices."""
    if os.environ["RANK"] == "1":
        raise ValueError("rank 1 failed on purpose")
    # Bounded, so that a launch that failed to stop this rank makes the test slow and failing, not hung.
    time.sleep(60)
    return "rank 0 was not stopped"


def raise_on_rank_1_while_rank_0_waits_in_a_barrier() -> str:
    """Both ranks join a group; rank 1 then raises while rank 0 waits in a barrier rank 1 never enters."""
    # The timeout only bounds orphans if launch is broken; the test requires a much faster failure.
    _join_gloo_group(timeout_s=60)
    if dist.get_rank() == 1:
        time.sleep(1.0)  # let rank 0 reach the barrier first
        raise ValueError("rank 1 failed while rank 0 waits in a barrier")
    dist.barrier()
    return "rank 0 passed a barrier that rank 1 never entered"


def exit_without_traceback_on_rank_1() -> str:
    """Rank 1 ends its process with exit code 3 and no Python traceback; rank 0 returns."""
    if os.environ["RANK"] == "1":
        os._exit(3)
    return "rank 0 finished"


def return_unpicklable_on_rank_0() -> object:
    """Return a lock, which pickle cannot serialise, so the result cannot travel back to the caller."""
    return threading.Lock()


class CallableHoldingALock:
    """A top-level callable whose instances cannot be pickled (they hold a lock)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __call__(self) -> str:
        return "never spawned"


def train_with_a_trainer() -> float:
    """A clean DDP fit with a Trainer, as a user's main() would do; each rank registers an atexit handler
    that writes `$DEEPEPOCHS_TEST_ATEXIT_DIR/rank-<rank>`. Returns rank 0's final training loss."""
    import atexit

    from torch.nn import functional as F

    from deepepochs import Trainer

    folder, rank = os.environ.get("DEEPEPOCHS_TEST_ATEXIT_DIR"), os.environ["RANK"]
    if folder:
        atexit.register(lambda: open(os.path.join(folder, f"rank-{rank}"), "w").close())
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    data = [(x[i:i + 8], x[i:i + 8].sum(1, keepdim=True)) for i in range(0, 64, 8)]
    model = torch.nn.Linear(4, 1)
    trainer = Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.05), epochs=2, device="cpu",
                      log_batch=False, show_info=False)
    try:
        loss = trainer.fit(data, data[:3])["train"]["loss"][-1]
        trainer.test(data[:3])
        return loss
    finally:
        trainer.close()


def rank_1_exits_badly_after_main_returned() -> dict:
    """main() returns on both ranks; then rank 1's atexit handler waits until rank 0 is done too and ends
    its process with exit code 3 (as a crashing library handler would)."""
    import atexit

    rank = int(os.environ["RANK"])
    marker_dir = os.environ["DEEPEPOCHS_TEST_DONE_DIR"]
    open(os.path.join(marker_dir, f"main-returned-{rank}"), "w").close()
    if rank == 1:
        def exit_badly():
            deadline = time.monotonic() + 30
            while not os.path.exists(os.path.join(marker_dir, "main-returned-0")) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # rank 0 writes its result and done marker right after main() returns
            os._exit(3)

        atexit.register(exit_badly)
    return {"rank": rank}
