"""What `test_ddp_profile.py` runs in two processes through `launch`: a profiled fit under DDP (gloo, CPU)
whose rank 1 reads a dataset that sleeps per item (a straggler), writing one trace with torch's operators of a
window of updates. Each rank saves its table and trace path to `$DEEPEPOCHS_TEST_OUT/rank<r>.pt`.
"""

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from deepepochs import ProfileCallback, Trainer

__all__ = ["OUT_ENV", "SLEEP", "run_profiled"]

OUT_ENV = "DEEPEPOCHS_TEST_OUT"
SLEEP = 0.01  # seconds per item on rank 1


class Items(Dataset):
    """16 items; on rank 1 each `__getitem__` sleeps `SLEEP`."""

    def __init__(self, rank):
        generator = torch.Generator().manual_seed(rank)
        self.x, self.y = torch.randn(16, 4, generator=generator), torch.randint(0, 2, (16,), generator=generator)
        self.rank = rank

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.rank == 1:
            time.sleep(SLEEP)
        return self.x[i], self.y[i]


def run_profiled() -> int:
    """One profiled fit of 2 epochs, 4 batches per epoch and rank."""
    torch.set_num_threads(1)
    out = Path(os.environ[OUT_ENV])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"file://{out / 'group-store'}", rank=rank,
                            world_size=int(os.environ["WORLD_SIZE"]))
    try:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        profiler = ProfileCallback(trace=out / "profile.json", torch_profiler=True)  # updates 3 to 5 (of 4)
        trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), epochs=2,
                          callbacks=[profiler], log_batch=False, show_info=False, run_lock="off")
        trainer.fit(DataLoader(Items(rank), batch_size=4))
        result = {"table": profiler.table, "trace_path": profiler.trace_path, "straggler": profiler.straggler,
                  "summary": profiler.summary()}
    finally:
        dist.destroy_process_group()
    torch.save(result, out / f"rank{rank}.pt")
    return rank
