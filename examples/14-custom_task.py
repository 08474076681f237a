"""Custom step methods on `EpochTask` subclasses: a two-head model trained on two tasks.

A task's step methods take precedence over the trainer's. Inside them `self.model`, `self.loss`,
`self.optimize` and the other trainer attributes are reachable through the task. The trainer has no loss
function (`loss=None`), so every batch item is a model input and each task computes its own loss and
hands the scalar to `self.loss(...)`, which runs backward and the update in training.

Run: `python examples/14-custom_task.py` (or `--small` for a few seconds' run).
"""

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import EpochTask, MeanPatch, Trainer, ValuePatch, set_seed
from deepepochs.metrics import accuracy


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.classify = nn.Linear(32, 2)
        self.regress = nn.Linear(32, 1)

    def forward(self, x, head):
        return getattr(self, head)(self.body(x))


class ClassifyTask(EpochTask):
    def step(self, batch_x, batch_y, **step_args):  # `step`: used in training and evaluation
        x, y = batch_x  # loss=None: the whole (x, y) batch is the input
        logits = self.model(x, "classify")
        self.loss(F.cross_entropy(logits, y))  # recorded as the task's 'loss'
        return {"accuracy": MeanPatch(accuracy, logits, y)}


class RegressTask(EpochTask):
    def step(self, batch_x, batch_y, weight=1.0):
        x, target = batch_x
        pred = self.model(x, "regress")
        self.loss(weight * F.mse_loss(pred, target))  # a later task's loss column is 'loss_1'
        return {"mae": ValuePatch((pred - target).abs().mean(), len(x))}


def loaders(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    classes = (x[:, 0] + x[:, 1] > 0).long()
    values = (x[:, 2:4].sum(dim=1, keepdim=True) * 2).float()
    return (DataLoader(TensorDataset(x, classes), batch_size=32, shuffle=True),
            DataLoader(TensorDataset(x, values), batch_size=32, shuffle=True))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="fewer samples and epochs")
    args = parser.parse_args()
    n, epochs = (256, 2) if args.small else (2048, 8)
    set_seed(0)
    cls_train, reg_train = loaders(n, 1)
    cls_val, reg_val = loaders(n // 4, 2)
    model = TwoHeads()
    with Trainer(model, None, torch.optim.Adam(model.parameters(), lr=1e-2), epochs=epochs,
                 log_batch=False) as trainer:
        trainer.fit(train_tasks=[ClassifyTask(cls_train), RegressTask(reg_train, weight=0.5)],
                    val_tasks=[ClassifyTask(cls_val), RegressTask(reg_val)])
        results = trainer.test(tasks=[ClassifyTask(cls_val), RegressTask(reg_val)])
    print("test:", {k: round(v, 4) for k, v in results.items()})


if __name__ == "__main__":
    main()
