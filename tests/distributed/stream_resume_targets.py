"""Target for the DDP stream test: each of 2 ranks trains on a DataLoader over its own
`RandomSampler(replacement=True, num_samples=k, generator=g)` (seeded by the rank), with dropout, BatchNorm,
torch noise while loading, Adam and a step-wise StepLR; with $DEEPEPOCHS_TEST_SNAPSHOTS a SnapshotCallback
writes there and the run resumes from it, and rank `$DEEPEPOCHS_TEST_SIGNAL_RANK` sends itself SIGTERM after
its training batch `$DEEPEPOCHS_TEST_SIGNAL_AT` of the run (1-based)."""

import os
import signal

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, RandomSampler, TensorDataset

from deepepochs import Callback, Optimizer, SnapshotCallback, Trainer

__all__ = ["AT_ENV", "FOLDER_ENV", "SIGNAL_RANK_ENV", "train"]

FOLDER_ENV = "DEEPEPOCHS_TEST_SNAPSHOTS"
SIGNAL_RANK_ENV = "DEEPEPOCHS_TEST_SIGNAL_RANK"
AT_ENV = "DEEPEPOCHS_TEST_SIGNAL_AT"
N, DRAWS, BATCH = 40, 32, 4  # each rank draws 32 samples an epoch with replacement: 8 batches


class Noisy(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g)

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(6), self.y[i]


class SigtermAt(Callback):
    def __init__(self, at):
        self.at, self.seen = at, 0

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        self.seen += 1
        if self.seen == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def train() -> dict:
    """The fit on this rank; rank 0's weights, optimizer and scheduler states and records (as lists)."""
    folder = os.environ.get(FOLDER_ENV)
    rank = int(os.environ.get("RANK", "0"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.8)
    callbacks = []
    if folder:
        callbacks.append(SnapshotCallback(folder, every_n_updates=None))
        if os.environ.get(SIGNAL_RANK_ENV) == str(rank):
            callbacks.append(SigtermAt(int(os.environ[AT_ENV])))
    sampler = RandomSampler(range(N), replacement=True, num_samples=DRAWS,
                            generator=torch.Generator().manual_seed(100 + rank))
    val = Noisy()
    trainer = Trainer(model, F.cross_entropy, Optimizer(opt, sched, sched_on="step"), epochs=3, device="cpu",
                      callbacks=callbacks, resume=bool(folder), running_id="ddp", gradient_accumulation_steps=2,
                      log_batch=False, show_info=False)
    try:
        records = trainer.fit(DataLoader(Noisy(), batch_size=BATCH, sampler=sampler),
                              DataLoader(TensorDataset(val.x[:16], val.y[:16]), batch_size=8))
    finally:
        trainer.close()
    states = {"model": model.state_dict(), "opt": opt.state_dict()["state"], "sched": sched.state_dict()}
    return {"states": _lists(states), "records": records, "completed": trainer.loop.completed_epochs}


def _lists(value):
    """Tensors as lists (what `launch` returns crosses processes as plain data)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    return value
