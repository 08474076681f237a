"""What ``tests/callbacks/test_mlflow_updates.py`` runs in two processes through ``launch``: a fit by updates
(a budget of 8, a validation point every 4 updates, a learning rate decayed per update) logged to the MLflow
server ``$DEEPEPOCHS_TEST_MLFLOW`` names, in the experiment ``$DEEPEPOCHS_TEST_EXPERIMENT``. Each rank saves
its records and whether it held a tracker's worker thread to
``$DEEPEPOCHS_TEST_OUT/rank<r>.pt``."""

import os
import threading
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import MLflowCallback, Optimizer, Trainer

__all__ = ["EXPERIMENT_ENV", "OUT_ENV", "RUNNING_ID", "URI_ENV", "main", "schedule"]

OUT_ENV = "DEEPEPOCHS_TEST_OUT"
URI_ENV = "DEEPEPOCHS_TEST_MLFLOW"
EXPERIMENT_ENV = "DEEPEPOCHS_TEST_EXPERIMENT"
RUNNING_ID = "ddp-by-updates"


def schedule(opt):
    """The learning rate decayed linearly to a tenth over 10 updates."""
    return torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=10)


def main():
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g)
    train = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(5))
    val = DataLoader(TensorDataset(x[:40], y[:40]), batch_size=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tracker = MLflowCallback(os.environ[URI_ENV], experiment=os.environ[EXPERIMENT_ENV], close_timeout=120)
    with Trainer(model, F.cross_entropy, Optimizer(opt, schedule(opt), sched_on="step"), max_updates=8,
                 device="cpu", callbacks=[tracker], running_id=RUNNING_ID, log_batch=False,
                 show_info=False) as trainer:
        records = trainer.fit(train, val, val_every_n_updates=4)
        worker = any(t.name == "deepepochs-mlflow" and t.is_alive() for t in threading.enumerate())
        out = {"records": records, "updates": trainer.loop.run.updates, "epochs": trainer.loop.completed_epochs,
               "worker": worker}
    torch.save(out, Path(os.environ[OUT_ENV]) / f"rank{rank}.pt")
