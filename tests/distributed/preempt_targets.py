"""Targets for the DDP preemption tests: ranks train with a SnapshotCallback; a SIGTERM may reach one rank
only (`DEEPEPOCHS_TEST_SIGNAL_RANK`), from inside its own loop (after a training batch of epoch 2, or with
`DEEPEPOCHS_TEST_SIGNAL_AT=epoch_end` at the end of epoch 1); the batch size and dropout are set by the
environment, so a snapshot of one world size can resume on another with the same global batch."""

import os
import signal

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, Optimizer, SnapshotCallback, Trainer

FOLDER_ENV = "DEEPEPOCHS_TEST_SNAPSHOTS"
SIGNAL_RANK_ENV = "DEEPEPOCHS_TEST_SIGNAL_RANK"
BATCH_ENV = "DEEPEPOCHS_TEST_BATCH"  # per-rank batch size (default 4)
DROPOUT_ENV = "DEEPEPOCHS_TEST_DROPOUT"  # dropout probability (default 0.25)
SIGNAL_AT_ENV = "DEEPEPOCHS_TEST_SIGNAL_AT"  # 'batch' (default) or 'epoch_end'


class SignalOneRank(Callback):
    """This rank sends itself SIGTERM after its training batch 4 (0-based) of epoch 2, or at the end of
    epoch 1 (its hooks, before the epoch's commit point)."""

    def __init__(self):
        self.at = os.environ.get(SIGNAL_AT_ENV, "batch")

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if self.at == "batch" and trainer.loop.epoch == 2 and batch_idx == 4:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx):
        if self.at == "epoch_end" and epoch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)


def train() -> dict:
    """A fit (shuffle, dropout, Adam, step-wise StepLR, k=2) on 2 ranks (`launch`) or in this process: with
    $DEEPEPOCHS_TEST_SNAPSHOTS a SnapshotCallback writes there and the run resumes from it; returns rank 0's
    weights and records."""
    folder = os.environ.get(FOLDER_ENV)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(float(os.environ.get(DROPOUT_ENV, "0.25"))), nn.ReLU(),
                          nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.8)
    callbacks = []
    if folder:
        callbacks.append(SnapshotCallback(folder, every_n_updates=None))
        if os.environ.get(SIGNAL_RANK_ENV) == os.environ.get("RANK", "0"):
            callbacks.append(SignalOneRank())
    trainer = Trainer(model, F.cross_entropy, Optimizer(opt, sched, sched_on="step"), epochs=3, device="cpu",
                      callbacks=callbacks, resume=bool(folder), running_id="ddp", gradient_accumulation_steps=2,
                      data_order="global",  # one process trains as 2 ranks do, and a snapshot moves between them
                      log_batch=False, show_info=False)
    try:
        batch = int(os.environ.get(BATCH_ENV, "4"))
        records = trainer.fit(DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True),
                              DataLoader(TensorDataset(x[:40], y[:40]), batch_size=8))
    finally:
        trainer.close()
    return {"weights": {k: v.tolist() for k, v in model.state_dict().items()}, "records": records,
            "completed": trainer.loop.completed_epochs}
