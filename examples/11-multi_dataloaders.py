"""Several DataLoaders per stage with `EpochTask`: each task has its own data, metrics and step arguments.

Training alternates over two tasks (a clean source and an augmented one whose step adds input noise);
validation combines `val_dl` with a second task; `test` runs a list of tasks. Metrics of a stage's later
tasks get a suffix with the task index (`loss_1`, ...).

Run: `python examples/11-multi_dataloaders.py` (or `--small` for a few seconds' run).
"""

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import EpochTask, Trainer, set_seed
from deepepochs.metrics import accuracy, f1


def make_data(n, seed, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 10, generator=g) + (y[:, None] * 2 - 1) * 0.5 + shift
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=seed == 1)


class NoisyTrainer(Trainer):
    """Step arguments given to an EpochTask arrive as keyword arguments of the step methods."""

    def train_step(self, batch_x, batch_y, noise=0.0):
        if noise:
            batch_x = batch_x + noise * torch.randn_like(batch_x)
        preds = self.model(batch_x)
        self.loss(preds, batch_y)
        return self.batch_patches(preds, batch_y)  # the task's metrics, under the trainer's metric_patch


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="fewer samples and epochs")
    args = parser.parse_args()
    n, epochs = (256, 2) if args.small else (2048, 5)
    set_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 2))
    train_tasks = [
        EpochTask(make_data(n, 1), metrics=[accuracy]),             # clean data
        EpochTask(make_data(n // 2, 1), metrics=[f1], noise=0.8),   # noisy copy: its step adds noise
    ]
    shifted = EpochTask(make_data(n // 4, 3, shift=0.3), metrics=[f1])  # a shifted domain
    with NoisyTrainer(model, F.cross_entropy, torch.optim.Adam(model.parameters(), lr=1e-2), epochs=epochs,
                      log_batch=False) as trainer:
        records = trainer.fit(train_tasks=train_tasks, val_dl=make_data(n // 4, 2), val_tasks=[shifted],
                              val_metrics=[accuracy])
        print("train columns:", sorted(records["train"]), "| val columns:", sorted(records["val"]))
        results = trainer.test(tasks=[EpochTask(make_data(n // 4, 4), metrics=[accuracy]),
                                      EpochTask(make_data(n // 4, 5, shift=0.3), metrics=[accuracy])])
        print("test:", {k: round(v, 4) for k, v in results.items()})


if __name__ == "__main__":
    main()
