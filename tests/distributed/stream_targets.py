"""What ``tests/distributed/test_ddp_metrics.py`` runs in two processes through ``launch``: a fit and tests
with a torchmetrics object, the function computing it on all predictions at once, and deepepochs'
confusion-matrix metrics, on uneven evaluation shards; then deepepochs' built-in counted metrics (binary
and four classes) on evaluation sets whose shards are uneven, a single batch on one rank and several on
the other, or empty on one rank. Each rank saves what it saw to ``$DEEPEPOCHS_TEST_OUT/rank<r>.pt``."""

import os
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Trainer
from deepepochs.metrics import accuracy, f1, precision, recall

__all__ = ["CLASSES", "COUNTED_SETS", "OUT_ENV", "auroc_fn", "main", "make_data", "make_model", "sample_count"]

OUT_ENV = "DEEPEPOCHS_TEST_OUT"
CLASSES = 4


#: The evaluation sets of the counted metrics: (samples, batch size). Two ranks take strided shards: 7 by 3
#: gives rank 0 two batches (4 samples) and rank 1 one (3 samples); 1 sample leaves rank 1 no batch.
COUNTED_SETS = ((7, 3), (37, 5), (1, 3), (2, 3))


def make_data(n: int, seed: int, classes: int = CLASSES) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 6, generator=g), torch.randint(0, classes, (n,), generator=g)
    x[torch.arange(n), y] += 1.0
    return TensorDataset(x, y)


def make_model(classes: int = CLASSES) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, classes))


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
    out = {"records": records, "test": test, "tiny": tiny, "state": state, "seen": list(SEEN),
           "counted": {classes: _counted_metrics(classes) for classes in (2, CLASSES)}}
    torch.save(out, Path(os.environ[OUT_ENV]) / f"rank{os.environ['RANK']}.pt")


def _counted_metrics(classes: int) -> dict:
    """deepepochs' built-in counted metrics (one confusion matrix per batch, shared by the metrics) in the
    validation records of a one-epoch fit and in the tests of each of `COUNTED_SETS`, with the weights."""
    model = make_model(classes)
    metrics = [accuracy, precision, recall, f1]
    with Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), epochs=1, device="cpu",
                 metrics=metrics, log_batch=False, show_info=False) as trainer:
        n, batch = COUNTED_SETS[0]
        records = trainer.fit(DataLoader(make_data(16, 3, classes), batch_size=4),
                              DataLoader(make_data(n, 4, classes), batch_size=batch))
        tests = [trainer.test(DataLoader(make_data(n, 4, classes), batch_size=batch)) for n, batch in COUNTED_SETS]
        state = {k: v.clone() for k, v in trainer.raw_model.state_dict().items()}
    return {"val": {k: v[-1] for k, v in records["val"].items()}, "tests": tests, "state": state}
