"""Gradient accumulation across DataLoader batches: one update per 2 batches, with DDP when available.

`gradient_accumulation_steps=2` makes each pair of batches one window: gradients are normalised by the
window's real sample count (a short tail window at the end of an epoch still updates, each sample weighted
as in a full one), and under DDP gradients are all-reduced only on the window's last batch.

Run:
    python examples/23-grad_accumulate-2.py [--small]          # one process per GPU, or one CPU process
    torchrun --nproc-per-node=2 examples/23-grad_accumulate-2.py --small
"""

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Trainer, launch
from deepepochs.metrics import accuracy


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2, help="DataLoader batches per update")
    parser.add_argument("--small", action="store_true", help="2 epochs on less data")
    args = parser.parse_args()
    n, epochs = (500, 2) if args.small else (5000, 5)

    torch.manual_seed(0)  # the same data on every rank; the trainer shards plain DataLoaders
    x = torch.randn(n, 16)
    y = (x[:, :3].sum(dim=1) > 0).long()
    split = n * 4 // 5  # 400 or 4000 training samples: batches of 48 leave a ragged last batch
    train_dl = DataLoader(TensorDataset(x[:split], y[:split]), batch_size=48, shuffle=True)
    val_dl = DataLoader(TensorDataset(x[split:], y[split:]), batch_size=200)

    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with Trainer(model, F.cross_entropy, opt, epochs=epochs, metrics=[accuracy],
                 gradient_accumulation_steps=args.steps, log_batch=False) as trainer:
        trainer.fit(train_dl, val_dl)
        result = trainer.test(val_dl)
        if trainer.is_main_process:
            print(f"world size {trainer.world_size}, {args.steps} batches per update: test {result}")
        return result


if __name__ == "__main__":
    launch(main)
