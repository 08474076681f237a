"""Mixed precision: precision='fp16' (autocast + GradScaler, also on CPU) or 'bf16' (autocast, no scaler).

Run: `python examples/16-amp.py [--precision fp16|bf16|fp32] [--small]`. On a machine without CUDA the
CPU autocast and the CPU GradScaler are used, so the fp16 overflow handling can be watched anywhere.
"""

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, Optimizer, Trainer
from deepepochs.metrics import accuracy

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--precision", default="fp16", choices=["fp32", "fp16", "bf16"])
parser.add_argument("--small", action="store_true", help="2 epochs on less data")
args = parser.parse_args()
n, epochs = (512, 2) if args.small else (4096, 6)

torch.manual_seed(0)
x = torch.randn(n, 32)
y = (x[:, :4].sum(dim=1) > 0).long()
split = n * 3 // 4
train_dl = DataLoader(TensorDataset(x[:split], y[:split]), batch_size=64, shuffle=True)
val_dl = DataLoader(TensorDataset(x[split:], y[split:]), batch_size=256)

model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 2))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
# A step-wise scheduler advances only after updates the scaler let through (skipped ones do not count).
sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=epochs * len(train_dl))


class SkipCounter(Callback):
    """fp16 only: the GradScaler skips an update whose gradients overflowed and halves its scale."""

    def __init__(self):
        self.skipped = 0

    def on_skip_optimize(self, trainer, optimize_index):
        self.skipped += 1

    def on_after_train_epochs(self, trainer, tasks, metrics, epoch_idx):
        if trainer.scaler is not None:
            print(f"  epoch {epoch_idx + 1}: loss scale {trainer.scaler.get_scale():.0f},"
                  f" {self.skipped} update(s) skipped so far")


counter = SkipCounter()
with Trainer(model, F.cross_entropy, Optimizer(opt, sched, sched_on="step"), epochs=epochs,
             precision=args.precision, metrics=[accuracy], callbacks=[counter], log_batch=False) as trainer:
    trainer.fit(train_dl, val_dl)
    print("test:", trainer.test(val_dl))
    # The skipped updates are exactly the ones the scheduler did not count.
    print(f"updates applied: {sched.last_epoch} of {epochs * len(train_dl)} ({counter.skipped} skipped)")
