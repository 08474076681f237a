"""Dict inputs and outputs: every field of a dict batch is a keyword argument of the model, and a model
without a separate loss function (`loss=None`) returns its own loss, here in a dict with other outputs.

The dataset yields dicts (`features`, `mask`, `labels`); the default collate stacks them field by field.
Metrics receive the model's output dict (and no label, since a dict batch is not split); the model puts
what they need in it.

Run: `python examples/15-dict_io.py` (or `--small` for a few seconds' run).
"""

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from deepepochs import Trainer, rename, set_seed
from deepepochs.metrics import accuracy, f1


class Records(Dataset):
    """Variable-length sequences padded to 12 steps; the label says whether the sum is positive."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.features = torch.randn(n, 12, 4, generator=g)
        lengths = torch.randint(3, 13, (n,), generator=g)
        self.mask = torch.arange(12)[None, :] < lengths[:, None]
        self.features[~self.mask] = 0.0
        self.labels = (self.features[..., 0].sum(dim=1) > 0).long()

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"features": self.features[i], "mask": self.mask[i], "labels": self.labels[i]}


class MaskedClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.encode = nn.Sequential(nn.Linear(4, 16), nn.Tanh())
        self.head = nn.Linear(16, 2)

    def forward(self, features, mask, labels=None):
        hidden = self.encode(features) * mask[..., None]
        logits = self.head(hidden.sum(dim=1) / mask.sum(dim=1, keepdim=True))
        out = {"logits": logits, "labels": labels}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def from_output(metric):
    """Adapt a (preds, targets) metric to the model's output dict."""
    return rename(lambda out, _batch_y: metric(out["logits"], out["labels"]), metric.__name__)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="fewer samples and epochs")
    args = parser.parse_args()
    n, epochs = (256, 2) if args.small else (4096, 8)
    set_seed(0)
    train_dl = DataLoader(Records(n, 1), batch_size=32, shuffle=True)
    val_dl = DataLoader(Records(n // 4, 2), batch_size=64)
    model = MaskedClassifier()
    with Trainer(model, None, torch.optim.Adam(model.parameters(), lr=1e-2), epochs=epochs,
                 metrics=[from_output(accuracy), from_output(f1)], log_batch=False) as trainer:
        trainer.fit(train_dl, val_dl)
        results = trainer.test(val_dl)
    print("test:", {k: round(v, 4) for k, v in results.items()})
    batch = next(iter(val_dl))
    out = model(**batch)
    print("one batch through the model:", {k: tuple(v.shape) for k, v in out.items()})


if __name__ == "__main__":
    main()
