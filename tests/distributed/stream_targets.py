"""What ``tests/distributed/test_ddp_metrics.py`` runs in two processes through ``launch``: a fit and tests
with a torchmetrics object, the function computing it on all predictions at once, and deepepochs'
confusion-matrix metrics, on uneven evaluation shards. Each rank saves what it saw to
``$DEEPEPOCHS_TEST_OUT/rank<r>.pt``."""

import os
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Trainer
from deepepochs.metrics import accuracy, f1

__all__ = ["CLASSES", "OUT_ENV", "auroc_fn", "main", "make_data", "make_model", "sample_count"]

OUT_ENV = "DEEPEPOCHS_TEST_OUT"
CLASSES = 4


def make_data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 6, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    x[torch.arange(n), y] += 1.0
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, CLASSES))


def auroc_fn(preds, targets):
    """MulticlassAUROC's functional form: the metric on all predictions at once."""
    from torchmetrics.functional.classification import multiclass_auroc

    return multiclass_auroc(preds, targets, num_classes=CLASSES)


SEEN: list = []


def sample_count(preds, targets):
    """Records how many samples it is computed on, in this process."""
    SEEN.append(len(targets))
    return torch.tensor(float(len(targets)))


def main():
    from torchmetrics.classification import MulticlassAUROC

    model = make_model()
    metrics = [MulticlassAUROC(num_classes=CLASSES), auroc_fn, accuracy, f1, sample_count]
    with Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), epochs=2, device="cpu",
                 metrics=metrics, log_batch=False, show_info=False) as trainer:
        records = trainer.fit(DataLoader(make_data(48, 1), batch_size=4, shuffle=True),
                              DataLoader(make_data(37, 2), batch_size=5))  # shards of 19 and 18 samples
        test = trainer.test(DataLoader(make_data(37, 2), batch_size=5))
        tiny = trainer.test(DataLoader(TensorDataset(*make_data(37, 2)[:1]), batch_size=5))  # rank 1: no batch
        state = {k: v.clone() for k, v in trainer.raw_model.state_dict().items()}
    out = {"records": records, "test": test, "tiny": tiny, "state": state, "seen": list(SEEN)}
    torch.save(out, Path(os.environ[OUT_ENV]) / f"rank{os.environ['RANK']}.pt")
