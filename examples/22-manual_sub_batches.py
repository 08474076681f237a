"""Manual sub-batching in a custom training step: split each DataLoader batch by hand.

Each sub-batch calls `self.loss(..., loss_adjust=sub_size / batch_size, do_optimize=False, do_metric=False)`
(its metrics come from the whole batch, below); non-final sub-batches run inside `self.no_sync()` (no
gradient all-reduce under DDP, a no-op in one process); one `self.optimize()` applies the whole batch. The
update equals a plain step on the full batch.

Run: `python examples/22-manual_sub_batches.py [--small]`.
"""

import argparse
import contextlib

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import EpochTask, TrainerBase
from deepepochs.metrics import accuracy

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--sub-batch", type=int, default=16, help="samples per sub-batch")
parser.add_argument("--small", action="store_true", help="2 epochs on less data")
args = parser.parse_args()
n, epochs = (512, 2) if args.small else (4096, 5)


class SubBatchTrainer(TrainerBase):
    def train_step(self, batch_x, batch_y, sub_batch=16):
        n = len(batch_x)
        pieces = list(zip(batch_x.split(sub_batch), batch_y.split(sub_batch)))
        outs = []
        for i, (xs, ys) in enumerate(pieces):
            last = i == len(pieces) - 1
            with contextlib.nullcontext() if last else self.no_sync():
                out = self.model(xs)
                # weight each sub-batch by its share of the batch: the gradients add up to the batch mean
                self.loss(out, ys, loss_adjust=len(xs) / n, do_optimize=False, do_metric=False)
            outs.append(out.detach())
        self.optimize()  # one update for the whole batch
        return self.batch_patches(torch.cat(outs), batch_y)  # the task's metrics on the full batch


torch.manual_seed(0)
x = torch.randn(n, 20)
y = (x[:, 0] * x[:, 1] > 0).long()
split = n * 3 // 4
train_dl = DataLoader(TensorDataset(x[:split], y[:split]), batch_size=128, shuffle=True)
val_dl = DataLoader(TensorDataset(x[split:], y[split:]), batch_size=256)

model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
trainer = SubBatchTrainer(model, F.cross_entropy, opt, epochs=epochs, metrics=[accuracy], log_batch=False)
with trainer:
    # EpochTask's extra keyword arguments reach the step method (here: the sub-batch size)
    trainer.fit(train_tasks=[EpochTask(train_dl, sub_batch=args.sub_batch)], val_dl=val_dl)
    print("test:", trainer.test(val_dl))
