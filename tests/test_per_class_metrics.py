"""Per-class (vector-valued) metrics: a metric returning one value per class
is reported as `<name>.<class>` on the console, in the records and in TensorBoard, checked against
scikit-learn on the whole dataset and against the event file read back."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.metrics import recall_score
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import LogCallback, Trainer

CLASSES = 3


def recall(preds, targets):
    """Per-class recall tp / (tp + fn): a vector of CLASSES values."""
    predicted = preds.argmax(1)
    hits = torch.bincount(targets[predicted == targets], minlength=CLASSES).float()
    return hits / torch.bincount(targets, minlength=CLASSES).float()


def class_share(preds, targets):
    """Per-class share of the samples: a mean over samples, so exact under metric_patch='mean'."""
    return F.one_hot(targets, CLASSES).float().mean(0)


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    y = (x[:, :CLASSES] + 0.5 * torch.randn(n, CLASSES, generator=g)).argmax(1)
    return x, y


def test_per_class_recall_is_reported_per_class_and_equals_sklearn_on_the_whole_set(tmp_path, capsys):
    """fit with a per-class metric: the val records hold recall.0..2 equal to sklearn's per-class recall
    of the final model on the whole validation set; the console shows them; TensorBoard holds one
    `recall.<c>/val` curve per class with the recorded values."""
    xt, yt = _data(120, 0)
    xv, yv = _data(45, 1)
    torch.manual_seed(0)
    model = nn.Linear(5, CLASSES)
    log = LogCallback(log_dir=tmp_path / "logs")
    with Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.5), epochs=2, device="cpu",
                 metrics=[recall], callbacks=[log], running_id="run", log_batch=False) as trainer:
        records = trainer.fit(DataLoader(TensorDataset(xt, yt), batch_size=16),
                              DataLoader(TensorDataset(xv, yv), batch_size=7))
    with torch.no_grad():
        predicted = model(xv).argmax(1).numpy()
    expected = recall_score(yv.numpy(), predicted, average=None, labels=list(range(CLASSES)))
    got = [records["val"][f"recall.{c}"][-1] for c in range(CLASSES)]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert "recall" not in records["val"]
    out = capsys.readouterr().out
    assert "VAL> loss:" in out and all(f"recall.{c}:" in out for c in range(CLASSES))
    events = EventAccumulator(str(tmp_path / "logs" / "run"), size_guidance={"scalars": 0})
    events.Reload()
    for c in range(CLASSES):
        logged = [e.value for e in events.Scalars(f"recall.{c}/val")]
        np.testing.assert_allclose(logged, records["val"][f"recall.{c}"], rtol=1e-6)


def test_per_class_values_under_metric_patch_mean_are_sample_weighted_per_class():
    """metric_patch='mean' accepts a vector metric and averages each class's value over the batches by
    sample count: for the per-class share of samples that is the dataset's class frequencies exactly."""
    x, y = _data(50, 2)
    torch.manual_seed(0)
    with Trainer(nn.Linear(5, CLASSES), F.cross_entropy, epochs=1, device="cpu", metric_patch="mean",
                 log_batch=False, show_info=False) as trainer:
        metrics = trainer.test(DataLoader(TensorDataset(x, y), batch_size=8), metrics=[class_share])
    expected = (torch.bincount(y, minlength=CLASSES).double() / len(y)).tolist()
    np.testing.assert_allclose([metrics[f"class_share.{c}"] for c in range(CLASSES)], expected, rtol=1e-6)
