"""A training run for the preemption tests (run as a script; killed at random moments by the tests).

`python snapshot_target.py <ckpt_dir> <out.pt> [--every N] [--epochs E]`: fp32 on the CPU, shuffle=True,
dropout, Adam, a step-wise StepLR, k=3 accumulation, `SnapshotCallback(every_n_updates=N)` and
`resume=True`; prints `training` when the fit starts and writes the final weights, optimizer and
scheduler states (and the fit's records) to `out.pt` when it ends. Exits with `Preempted`'s status on
SIGTERM. Without `--every` no SnapshotCallback is attached (the uninterrupted reference run).
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import deepepochs as de


class Announce(de.Callback):
    def on_before_fit(self, trainer, epochs):
        print("training", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt_dir")
    parser.add_argument("out")
    parser.add_argument("--every", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.9)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(600, 8, generator=g), torch.randint(0, 4, (600,), generator=g)
    train = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    val = DataLoader(TensorDataset(x[:64], y[:64]), batch_size=32)
    callbacks = [Announce()]
    if args.every is not None:
        callbacks.append(de.SnapshotCallback(args.ckpt_dir, every_n_updates=args.every, keep=2))
    trainer = de.Trainer(model, nn.functional.cross_entropy, de.Optimizer(opt, sched, sched_on="step"),
                         epochs=args.epochs, callbacks=callbacks, resume=args.every is not None, running_id="run",
                         gradient_accumulation_steps=3, log_batch=False, show_info=False)
    records = trainer.fit(train, val)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "records": records}, args.out)


if __name__ == "__main__":
    sys.exit(main())
