"""A fit by updates over a stream, for the preemption tests (run as a script, signalled by the tests).

`python updates_target.py <ckpt_dir> <out.pt> [--accumulate K] [--workers W] [--stateful] [--ddp]
[--snapshots] [--signal-at B] [--signal-in-val P] [--plain]`:
`Trainer(max_updates=UPDATES)` and `fit(val_every_n_updates=EVERY)` over a DataLoader whose
`RandomSampler(replacement=True, generator=g)` draws an endless stream in practice (`--stateful`: torchdata's
`StatefulDataLoader` over it; `--workers`: W fork workers; `--ddp`: two gloo processes through `launch`, each
with its own sampler seeded by its rank). The model has dropout and BatchNorm; the training step adds noise
drawn from torch's, NumPy's and Python's global generators; Adam and a step-wise StepLR; windows of K batches.

- `--snapshots`: a `SnapshotCallback` (signals only) and `resume=True`: a job stopped by SIGTERM resumes from
  its snapshot when started again.
- `--signal-at B`: after its B-th training batch (1-based, counted in this process) the process (under DDP:
  rank 1) prints `at <B> <pid>` and waits until the SIGTERM the test sends it has reached the
  `SnapshotCallback`'s handler. `--signal-in-val P`: the same during the
  first validation batch of the validation point after update P.
- `--plain`: no deepepochs at all: the plain PyTorch loop a user writes for the same program (with `--ddp`:
  in `DistributedDataParallel`, started by `launch`).

Writes the final weights and buffers, optimizer and scheduler states, the fit's records and the update count
to `out.pt` (rank 0 under DDP). Exits with `Preempted`'s status (143) when a signal stopped it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import sys
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import deepepochs as de

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for state_compare
from state_compare import plain_val_loss  # noqa: E402  (the plain loop's evaluation)

N, BATCH, VAL_N, UPDATES, EVERY = 40, 4, 16, 30, 7


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("ckpt_dir")
    parser.add_argument("out")
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--stateful", action="store_true")
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--snapshots", action="store_true")
    parser.add_argument("--signal-at", type=int, default=None)
    parser.add_argument("--signal-in-val", type=int, default=None)
    parser.add_argument("--plain", action="store_true")
    return parser.parse_args(argv)


def data(args, rank: int = 0):
    """The training stream (this rank's) and the validation DataLoader."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(N, 6, generator=g), torch.randint(0, 3, (N,), generator=g)
    sampler = RandomSampler(range(N), replacement=True, num_samples=10**6,
                            generator=torch.Generator().manual_seed(3 + 100 * rank))
    loader = {} if not args.workers else {"num_workers": args.workers, "multiprocessing_context": "fork"}
    if args.stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: PLC0415  (only this variant needs it)

        train = StatefulDataLoader(TensorDataset(x, y), batch_size=BATCH, sampler=sampler, **loader)
    else:
        train = DataLoader(TensorDataset(x, y), batch_size=BATCH, sampler=sampler, **loader)
    return train, DataLoader(TensorDataset(x[:VAL_N], y[:VAL_N]), batch_size=8)


def parts():
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.9)
    return model, opt, sched


def noisy(x):
    """The step's augmentation: noise from torch's, NumPy's and Python's global generators."""
    noise = torch.from_numpy(np.random.uniform(-0.05, 0.05, tuple(x.shape))).float()
    return x * (1 + 0.1 * random.random()) + noise + 0.05 * torch.randn_like(x)


class Noisy(de.TrainerBase):
    def train_step(self, batch_x, batch_y, **step_args):
        self.loss(self.model(noisy(batch_x)), batch_y)


def wait_for_sigterm(label: str) -> None:
    """Say where this process stands and wait until the test's SIGTERM arrived: the handler in place (the
    `SnapshotCallback`'s) gets it through a relay that notes its arrival, set before the line is printed so
    that the signal cannot come before this process waits for it."""
    handler, arrived = signal.getsignal(signal.SIGTERM), []

    def relay(signum, frame):
        arrived.append(signum)
        handler(signum, frame)

    signal.signal(signal.SIGTERM, relay)
    print(f"{label} {os.getpid()}", flush=True)
    deadline = time.monotonic() + 120
    while not arrived and time.monotonic() < deadline:
        time.sleep(0.002)
    signal.signal(signal.SIGTERM, handler)


class SignalPoint(de.Callback):
    """Waits for the test's SIGTERM after training batch `at` or in the validation point after update
    `in_val`."""

    def __init__(self, at, in_val):
        self.at, self.in_val, self.seen = at, in_val, 0

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        self.seen += 1
        if self.seen == self.at:
            wait_for_sigterm(f"at {self.at}")

    def on_after_val_batch(self, trainer, metrics, batch_idx):
        if trainer.loop.run.updates == self.in_val and batch_idx == 0:
            wait_for_sigterm(f"in-val {self.in_val}")


def train(args) -> dict | None:
    """The fit on this process (a rank under DDP); rank 0's final states and records."""
    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    model, opt, sched = parts()
    callbacks = []
    if args.snapshots:
        callbacks.append(de.SnapshotCallback(args.ckpt_dir, every_n_updates=None))
    if (args.signal_at or args.signal_in_val) and rank == (1 if args.ddp else 0):
        callbacks.append(SignalPoint(args.signal_at, args.signal_in_val))
    trainer = Noisy(model, F.cross_entropy, de.Optimizer(opt, sched, sched_on="step"), max_updates=UPDATES,
                    callbacks=callbacks, resume=args.snapshots, running_id="run", device="cpu",
                    gradient_accumulation_steps=args.accumulate, log_batch=False, show_info=False)
    try:
        records = trainer.fit(*data(args, rank), val_every_n_updates=EVERY)
    finally:
        trainer.close()
    if rank:
        return None
    return {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "records": records,
            "updates": trainer.loop.run.updates}


def plain(args) -> dict:
    """The user's loop: UPDATES updates of `accumulate` batches each (each batch's loss divided by it), the
    validation loss after every EVERY-th update and the last; the training loss of the run's one epoch."""
    torch.set_num_threads(1)
    model, opt, sched = parts()
    train_dl, val_dl = data(args)
    batches = iter(train_dl)
    points, losses, train_sum, train_n = [], [], 0.0, 0
    model.train()
    for update in range(1, UPDATES + 1):
        for _ in range(args.accumulate):
            x, y = next(batches)
            loss = F.cross_entropy(model(noisy(x)), y)
            (loss * (1 / args.accumulate)).backward()
            train_sum, train_n = train_sum + float(loss.detach()) * len(y), train_n + len(y)
        opt.step()
        sched.step()
        opt.zero_grad()
        if update % EVERY == 0 or update == UPDATES:
            points.append(update)
            losses.append(plain_val_loss(model, val_dl))
    records = {"train": {"loss": [train_sum / train_n]}, "val": {"updates": points, "loss": losses}}
    return {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "records": records,
            "updates": UPDATES}


def plain_ddp(args) -> dict | None:
    """The user's loop on this rank of 2 (gloo): the model in `DistributedDataParallel`, gradients not
    synchronised on a window's first batch (`no_sync`), each rank's own sampler, validation through the
    wrapper (its first evaluation forward broadcasts rank 0's BatchNorm statistics, which training left
    different on each rank: every rank evaluates the model rank 0 saves) on the rank's share of the samples
    (every other one), the losses summed over the ranks."""
    import torch.distributed as dist  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt, sched = parts()
    ddp = DistributedDataParallel(model)
    train_dl, val_dl = data(args, rank)
    val_dl = DataLoader(torch.utils.data.Subset(val_dl.dataset, range(rank, VAL_N, 2)), batch_size=8)
    batches = iter(train_dl)
    points, losses, train = [], [], torch.zeros(2, dtype=torch.float64)
    ddp.train()
    for update in range(1, UPDATES + 1):
        for micro in range(args.accumulate):
            x, y = next(batches)
            sync = micro == args.accumulate - 1
            with contextlib.nullcontext() if sync else ddp.no_sync():
                loss = F.cross_entropy(ddp(noisy(x)), y)
                (loss * (1 / args.accumulate)).backward()
            train += torch.tensor([float(loss.detach()) * len(y), len(y)], dtype=torch.float64)
        opt.step()
        sched.step()
        opt.zero_grad()
        if update % EVERY == 0 or update == UPDATES:
            ddp.eval()
            total = torch.zeros(2, dtype=torch.float64)
            with torch.no_grad():
                for vx, vy in val_dl:
                    total += torch.tensor([float(F.cross_entropy(ddp(vx), vy)) * len(vy), len(vy)],
                                          dtype=torch.float64)
            dist.all_reduce(total)
            ddp.train()
            points.append(update)
            losses.append(float(total[0] / total[1]))
    dist.all_reduce(train)
    records = {"train": {"loss": [float(train[0] / train[1])]}, "val": {"updates": points, "loss": losses}}
    dist.destroy_process_group()
    if rank:
        return None
    return {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "records": records,
            "updates": UPDATES}


def plain_rank_main():
    """What each rank of `--plain --ddp` runs."""
    return plain_ddp(parse(sys.argv[1:]))


def rank_main():
    """What each rank of `--ddp` runs (`launch` imports it in fresh processes): the arguments are this
    script's own."""
    return train(parse(sys.argv[1:]))


def main() -> None:
    args = parse()
    if args.ddp:
        from deepepochs.launch import launch  # noqa: PLC0415

        result = launch(plain_rank_main if args.plain else rank_main, num_processes=2)
    elif args.plain:
        result = plain(args)
    else:
        result = train(args)
    torch.save(result, args.out)


if __name__ == "__main__":
    main()
