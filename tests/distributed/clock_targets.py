"""What ``tests/distributed/test_ddp_update_clock.py`` runs in two processes through ``launch``: a fit by
updates over an IterableDataset that runs dry on rank 1 first (7 batches on rank 0, 5 on rank 1), with a
validation point every 4 updates and a budget of 12. Each rank saves what it saw to
``$DEEPEPOCHS_TEST_OUT/rank<r>.pt``."""

import os
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from deepepochs import Callback, Trainer

__all__ = ["OUT_ENV", "main"]

OUT_ENV = "DEEPEPOCHS_TEST_OUT"


class RankStream(IterableDataset):
    """This rank's stream: 7 batches of 4 samples on rank 0, 5 on rank 1, then it ends."""

    def __init__(self, rank):
        g = torch.Generator().manual_seed(10 + rank)
        batches = 7 if rank == 0 else 5
        self.x = torch.randn(batches * 4, 6, generator=g)
        self.y = torch.randint(0, 3, (batches * 4,), generator=g)

    def __iter__(self):
        return iter(zip(self.x, self.y))


class Points(Callback):
    """The update count at each validation point and each epoch's end, as this rank saw them."""

    def __init__(self):
        self.points, self.epochs = [], []

    def on_after_val_epochs(self, trainer, tasks, metrics, epoch_idx):
        self.points.append(trainer.loop.run.updates)

    def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx):
        self.epochs.append(trainer.loop.run.updates)


def main():
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
    points = Points()
    g = torch.Generator().manual_seed(2)
    val = DataLoader(TensorDataset(torch.randn(30, 6, generator=g), torch.randint(0, 3, (30,), generator=g)),
                     batch_size=8)
    with Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), max_updates=12,
                 device="cpu", callbacks=[points], log_batch=False, show_info=False) as trainer:
        records = trainer.fit(DataLoader(RankStream(rank), batch_size=4), val, val_every_n_updates=4)
        state = {k: v.clone() for k, v in trainer.raw_model.state_dict().items()}
        updates, epochs = trainer.loop.run.updates, trainer.loop.completed_epochs
    out = {"records": records, "state": state, "updates": updates, "epochs": epochs, "points": points.points,
           "epoch_ends": points.epochs}
    torch.save(out, Path(os.environ[OUT_ENV]) / f"rank{rank}.pt")
