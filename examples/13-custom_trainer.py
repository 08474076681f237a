"""Custom step methods on a `TrainerBase` subclass.

Step methods take `(batch_x, batch_y, **step_args)` and return None or `{name: Patch}`. Lookup order per
stage: `step` (all stages) first, then the stage's own (`train_step`, `val_step`, `test_step`), then
`evaluate_step` for validation and test. Inside a step, `self.model` is the model to call, `self.loss`
computes the loss (and in training runs backward and the update), `self.batch_patches` builds the
trainer's metric patches.

Here training uses label smoothing and input dropout, validation uses the shared `evaluate_step`, and
testing has its own `test_step` averaging predictions over noisy copies (test-time augmentation).

Run: `python examples/13-custom_trainer.py` (or `--small` for a few seconds' run).
"""

import argparse
from collections import Counter

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import TrainerBase, ValuePatch, set_seed
from deepepochs.metrics import accuracy


class MyTrainer(TrainerBase):
    calls = Counter()

    def train_step(self, batch_x, batch_y, **step_args):
        self.calls["train_step"] += 1
        preds = self.model(F.dropout(batch_x, 0.1))
        self.loss(preds, batch_y)  # loss_fn(preds, batch_y) (smoothed), backward, update -> 'loss'
        clean = F.cross_entropy(preds.detach(), batch_y)  # the unsmoothed loss, as an extra column
        return {**self.batch_patches(preds, batch_y), "ce": ValuePatch(clean, batch_y.shape[0])}

    def evaluate_step(self, batch_x, batch_y, **step_args):
        self.calls["evaluate_step"] += 1
        preds = self.model(batch_x)
        self.loss(preds, batch_y)  # no gradients here: just the value, recorded as 'loss'
        return self.batch_patches(preds, batch_y)

    def test_step(self, batch_x, batch_y, **step_args):
        self.calls["test_step"] += 1
        copies = torch.stack([batch_x + 0.1 * torch.randn_like(batch_x) for _ in range(4)])
        probs = self.model(copies.flatten(0, 1)).softmax(-1).view(4, batch_x.shape[0], -1).mean(0)
        self.loss(probs.log(), batch_y)
        return self.batch_patches(probs, batch_y)


def smoothed_ce(preds, targets):
    return F.cross_entropy(preds, targets, label_smoothing=0.1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="fewer samples and epochs")
    args = parser.parse_args()
    n, epochs = (300, 2) if args.small else (3000, 6)
    set_seed(0)
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 3, (n,), generator=g)
    x = torch.randn(n, 6, generator=g) + F.one_hot(y, 6).float() * 1.5
    split = n * 2 // 3
    train_dl = DataLoader(TensorDataset(x[:split], y[:split]), batch_size=32, shuffle=True)
    val_dl = DataLoader(TensorDataset(x[split:], y[split:]), batch_size=64)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))
    with MyTrainer(model, smoothed_ce, torch.optim.Adam(model.parameters(), lr=1e-2), epochs=epochs,
                   metrics=[accuracy], log_batch=False) as trainer:
        trainer.fit(train_dl, val_dl)
        results = trainer.test(val_dl)
    print("test (averaged over 4 noisy copies):", {k: round(v, 4) for k, v in results.items()})
    print("step methods called:", dict(MyTrainer.calls))


if __name__ == "__main__":
    main()
