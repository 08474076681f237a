"""A training run for the preemption tests (run as a script; killed at random moments by the tests).

`python snapshot_target.py <ckpt_dir> <out.pt> [--every N] [--epochs E] [--workers W --context C
[--persistent]] [--accumulate K] [--slow-data S] [--samples M] [--requeue] [--run-lock MODE] [--replacement]
[--val-workers W --val-context C --val-slow S] [--async-write [--slow-fsync S]]`: fp32 on the CPU,
shuffle=True (`--replacement`: a RandomSampler drawing M samples with replacement from its own generator),
dropout, Adam, a step-wise StepLR, k=3 accumulation (`--accumulate`), M samples (600), DataLoader worker
processes (`--workers`, started by `--context`: fork, spawn or forkserver; each prints `worker <id> <pid>` when
it starts; `--slow-data`: each sample takes S seconds to load, the results are the same), a validation
DataLoader of 64 samples in 2 batches (with `--val-workers`, its own workers started by `--val-context`, each
printing `val-worker <id> <pid>`; `--val-slow`: S seconds per sample), `SnapshotCallback(every_n_updates=N)`
(with `--requeue`: requeue=True, a SLURM job requeues itself when preempted; `--async-write`:
async_write=True; `--slow-fsync`: every `os.fsync` of the process takes S seconds more, so that signals land
inside background writes), `resume=True` and `run_lock=MODE` ('error' unless given); prints `training` when the
fit starts and writes the final weights, optimizer and scheduler states (and the fit's records) to `out.pt` when
it ends. Exits with `Preempted`'s status on SIGTERM. Without `--every` no SnapshotCallback is attached (the
uninterrupted reference run).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import deepepochs as de


def worker_ready(worker_id: int) -> None:
    """Each DataLoader worker says it started (the tests signal the job once its workers run)."""
    print(f"worker {worker_id} {os.getpid()}", flush=True)


def val_worker_ready(worker_id: int) -> None:
    """Each validation DataLoader worker says it started (the tests signal the job during validation)."""
    print(f"val-worker {worker_id} {os.getpid()}", flush=True)


class SlowData(torch.utils.data.Dataset):
    """A dataset whose samples take `seconds` each to load (a job that runs into its time limit)."""

    def __init__(self, data, seconds: float):
        self.data, self.seconds = data, seconds

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        time.sleep(self.seconds)
        return self.data[index]


class Announce(de.Callback):
    def on_before_fit(self, trainer, epochs):
        print("training", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt_dir")
    parser.add_argument("out")
    parser.add_argument("--every", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--context", default=None)
    parser.add_argument("--persistent", action="store_true")
    parser.add_argument("--accumulate", type=int, default=3)
    parser.add_argument("--slow-data", type=float, default=0.0)
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--requeue", action="store_true")
    parser.add_argument("--run-lock", default="error")
    parser.add_argument("--val-workers", type=int, default=0)
    parser.add_argument("--val-context", default=None)
    parser.add_argument("--val-slow", type=float, default=0.0)
    parser.add_argument("--replacement", action="store_true")
    parser.add_argument("--async-write", action="store_true")
    parser.add_argument("--slow-fsync", type=float, default=0.0)
    args = parser.parse_args()
    if args.slow_fsync:
        fsync = os.fsync

        def slow_fsync(fd):
            time.sleep(args.slow_fsync)
            fsync(fd)

        os.fsync = slow_fsync
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.9)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.samples, 8, generator=g), torch.randint(0, 4, (args.samples,), generator=g)
    loader = {} if not args.workers else {"num_workers": args.workers, "multiprocessing_context": args.context,
                                          "persistent_workers": args.persistent, "worker_init_fn": worker_ready}
    dataset = TensorDataset(x, y) if not args.slow_data else SlowData(TensorDataset(x, y), args.slow_data)
    if args.replacement:  # a sampler drawing with replacement from its own generator, as many samples as the data
        sampler = torch.utils.data.RandomSampler(range(args.samples), replacement=True, num_samples=args.samples,
                                                 generator=torch.Generator().manual_seed(2))
        train = DataLoader(dataset, batch_size=4, sampler=sampler, **loader)
    else:
        train = DataLoader(dataset, batch_size=4, shuffle=True, **loader)
    val_loader = {} if not args.val_workers else {"num_workers": args.val_workers,
                                                  "multiprocessing_context": args.val_context,
                                                  "worker_init_fn": val_worker_ready}
    val_data = TensorDataset(x[:64], y[:64])
    val = DataLoader(val_data if not args.val_slow else SlowData(val_data, args.val_slow), batch_size=32,
                     **val_loader)
    callbacks = [Announce()]
    if args.every is not None:
        callbacks.append(de.SnapshotCallback(args.ckpt_dir, every_n_updates=args.every, keep=2,
                                             requeue=args.requeue, async_write=args.async_write))
    trainer = de.Trainer(model, nn.functional.cross_entropy, de.Optimizer(opt, sched, sched_on="step"),
                         epochs=args.epochs, callbacks=callbacks, resume=args.every is not None, running_id="run",
                         gradient_accumulation_steps=args.accumulate, log_batch=False, show_info=False,
                         run_lock=args.run_lock)
    records = trainer.fit(train, val)
    if trainer.dist.is_main:  # under DDP (srun --ntasks=2) rank 0 writes it
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "records": records}, args.out)


if __name__ == "__main__":
    sys.exit(main())
