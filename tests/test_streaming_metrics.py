"""Metrics whose memory does not grow with the data: torchmetrics objects streamed (`StreamPatch`) and the
bounded default `metric_patch='auto'`. Every value is checked against the same metric computed once on the
whole data (a torchmetrics functional, deepepochs' functions, or the trainer's 'tensor' setting, which keeps
every prediction)."""

import datetime
import os
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, ConfusionPatch, SnapshotCallback, TensorPatch, Trainer, rename
from deepepochs.errors import DeepEpochsWarning
from deepepochs.metrics import accuracy, f1, precision, recall
from deepepochs.patches import merge_patches
from deepepochs.patches import tensor as tensor_patch_module
from deepepochs.patches.streaming import StreamPatch

tm = pytest.importorskip("torchmetrics")
from processes import free_port, spawn_with_deadline  # noqa: E402  (tests/, on sys.path under pytest)
from torchmetrics.classification import MulticlassAUROC, MulticlassF1Score  # noqa: E402
from torchmetrics.functional.classification import multiclass_auroc, multiclass_f1_score  # noqa: E402

CLASSES = 4


def auroc_fn(preds, targets):
    """The whole-data reference for MulticlassAUROC: its functional form on all predictions at once."""
    return multiclass_auroc(preds, targets, num_classes=CLASSES)


def f1_macro_fn(preds, targets):
    """The whole-data reference for MulticlassF1Score(average='macro')."""
    return multiclass_f1_score(preds, targets, num_classes=CLASSES, average="macro")


def _data(n=103, seed=3):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 6, generator=g), torch.randint(0, CLASSES, (n,), generator=g)
    x[torch.arange(n), y] += 1.0  # learnable, so the metrics move between epochs
    return x, y


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, CLASSES))


def _loaders(batch_size=8):
    x, y = _data()
    train = DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True,
                       generator=torch.Generator().manual_seed(5))
    xv, yv = _data(37, seed=4)
    return train, DataLoader(TensorDataset(xv, yv), batch_size=5)


def _quiet(model, **kw):
    return Trainer(model, F.cross_entropy, device="cpu", log_batch=False, show_info=False, **kw)


# ---- the patch on its own --------------------------------------------------------------------------------
@pytest.mark.parametrize("make, reference", [
    (lambda: MulticlassAUROC(num_classes=CLASSES), auroc_fn),  # list states ('cat')
    (lambda: MulticlassF1Score(num_classes=CLASSES, average="macro"), f1_macro_fn),  # count states ('sum')
])
def test_a_stream_patch_over_uneven_batches_equals_the_metric_on_the_whole_data(make, reference):
    """Streamed batch by batch (uneven sizes, some lacking classes), the value is the whole-data value, and
    the user's object is never updated itself."""
    g = torch.Generator().manual_seed(7)
    preds = torch.randn(90, CLASSES, generator=g).softmax(1)
    targets = torch.randint(0, CLASSES, (90,), generator=g)
    metric = make()
    parts = [StreamPatch(metric, p, t) for p, t in zip(preds.split([1, 30, 2, 44, 13]),
                                                        targets.split([1, 30, 2, 44, 13]))]
    total = merge_patches(parts)
    assert torch.allclose(total(), reference(preds, targets), atol=1e-6)
    assert torch.allclose(total(), reference(preds, targets), atol=1e-6)  # forward leaves the state as it is
    assert metric._update_count == 0 and not any(
        (v.numel() and v.any()) if isinstance(v, torch.Tensor) else v for v in metric.metric_state.values())
    # `a + b` leaves both operands unchanged
    a, b = merge_patches(parts[:2]), merge_patches(parts[2:])
    a_before = float(a())
    assert torch.allclose((a + b)(), reference(preds, targets), atol=1e-6)
    assert float(a()) == a_before


def test_a_stream_patch_keeps_the_state_not_the_predictions():
    """Only the metric's own state stays once batches are folded in: no batch tensor is kept."""
    metric = MulticlassF1Score(num_classes=CLASSES)
    total = StreamPatch(metric, torch.randn(5, CLASSES), torch.randint(0, CLASSES, (5,))).copy()
    for _ in range(20):
        total.add(StreamPatch(metric, torch.randn(50, CLASSES), torch.randint(0, CLASSES, (50,))))
    assert total.state.pending == []
    assert sum(v.numel() for v in total.state.values.values()) == 4 * CLASSES  # tp, fp, tn, fn per class


# ---- in the trainer ----------------------------------------------------------------------------------
def test_a_torchmetrics_object_in_fit_and_test_equals_the_whole_epoch_computation():
    """Each stage's and each epoch's value of a metric object equals its functional form on the same
    epoch's predictions all at once (kept by the 'tensor' patch of a function in the same run): fresh state
    per task and per epoch, with dropout and shuffling; the user's object stays untouched."""
    auroc, f1m = MulticlassAUROC(num_classes=CLASSES), MulticlassF1Score(num_classes=CLASSES, average="macro")
    trainer = _quiet(_model(), epochs=3, metrics=[auroc, auroc_fn, f1m, f1_macro_fn])
    train, val = _loaders()
    records = trainer.fit(train, val)
    for stage in ("train", "val"):
        assert records[stage]["MulticlassAUROC"] == pytest.approx(records[stage]["auroc_fn"], abs=1e-6)
        assert records[stage]["MulticlassF1Score"] == pytest.approx(records[stage]["f1_macro_fn"], abs=1e-6)
    assert len(set(records["train"]["MulticlassAUROC"])) == 3  # not one state carried across epochs
    result = trainer.test(val)
    assert result["MulticlassAUROC"] == pytest.approx(result["auroc_fn"], abs=1e-6)
    # and against the test data computed here, with the trained model
    trainer.model.eval()
    with torch.no_grad():
        xv, yv = val.dataset.tensors
        preds = trainer.model(xv)
    assert result["MulticlassAUROC"] == pytest.approx(float(auroc_fn(preds, yv)), abs=1e-6)
    assert auroc._update_count == 0 and f1m._update_count == 0
    trainer.close()


def test_a_metric_object_is_never_called_through_forward(monkeypatch):
    """Only update and compute run: forward would update and compute a batch value, and sync on some
    settings."""
    metric = MulticlassF1Score(num_classes=CLASSES)

    def refuse(*args, **kwargs):
        raise AssertionError("forward called")

    monkeypatch.setattr(type(metric), "forward", refuse)
    trainer = _quiet(_model(), epochs=1, metrics=[metric])
    train, val = _loaders()
    records = trainer.fit(train, val)
    assert len(records["val"]["MulticlassF1Score"]) == 1
    trainer.close()


class FailAt(Callback):
    """Raises once, after the backward of batch `batch` of epoch `epoch` (both 1-based)."""

    def __init__(self, epoch, batch):
        self.at, self.done = (epoch, batch), False

    def on_after_backward(self, trainer, loss):
        if not self.done and (trainer.loop.epoch, trainer.loop.batch_idx) == self.at:
            self.done = True
            raise RuntimeError("injected")


def test_rollback_restores_a_metric_objects_state_to_the_last_committed_update():
    """An exception mid-window drops that window's batches from the metric object's state as from the
    loss; the second fit finishes the epoch with the uninterrupted run's values."""
    def run(callbacks):
        trainer = _quiet(_model(), epochs=2, callbacks=callbacks, gradient_accumulation_steps=3,
                         metrics=[MulticlassAUROC(num_classes=CLASSES), auroc_fn])
        train, val = _loaders()
        try:
            return trainer.fit(train, val)
        except RuntimeError:
            return trainer.fit(train, val)

    reference = run([])
    records = run([FailAt(2, 8)])  # inside the second epoch's third window; the refit runs epoch 2
    last = lambda r: {stage: {k: v[-1] for k, v in values.items()} for stage, values in r.items()}
    assert last(records) == last(reference)
    assert records["train"]["MulticlassAUROC"] == pytest.approx(records["train"]["auroc_fn"], abs=1e-6)


def test_a_snapshot_resume_keeps_the_metric_objects_partial_epoch_state(tmp_path):
    """A run resumed from a mid-epoch snapshot reports the epoch's metric over all its batches, those
    before the snapshot included (the object's state travels in the file, no predictions)."""
    def run(folder, resume=False):
        trainer = _quiet(_model(), epochs=1, running_id="run", resume=resume, gradient_accumulation_steps=2,
                         callbacks=[SnapshotCallback(folder, every_n_updates=1, keep=100)])
        return trainer.fit(_loaders()[0], metrics=[MulticlassAUROC(num_classes=CLASSES), auroc_fn])

    full = run(tmp_path / "a")
    (tmp_path / "b" / "run").mkdir(parents=True)
    shutil.copy(tmp_path / "a" / "run" / "snapshot-u000000003.ckpt", tmp_path / "b" / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeepEpochsWarning)  # the object's state is storable: no warning
        resumed = run(tmp_path / "b", resume=True)
    assert resumed == full
    assert full["train"]["MulticlassAUROC"] == pytest.approx(full["train"]["auroc_fn"], abs=1e-6)


# ---- the bounded default -----------------------------------------------------------------------------
def test_auto_keeps_counts_for_the_librarys_metrics_and_equals_the_tensor_setting():
    """Under 'auto' deepepochs' confusion-matrix metrics (renamed ones too) keep a matrix, not predictions,
    and every value equals the 'tensor' setting's (all predictions, computed once)."""
    metrics = [accuracy, precision, recall, f1, rename(f1, "f1_renamed"), auroc_fn]

    def run(kind):
        trainer = _quiet(_model(), epochs=2, metric_patch=kind, metrics=metrics)
        train, val = _loaders()
        records = trainer.fit(train, val)
        return trainer, records, trainer.test(val)

    auto, auto_records, auto_test = run("auto")
    _, tensor_records, tensor_test = run("tensor")
    assert auto_records == tensor_records and auto_test == tensor_test
    made = auto.batch_patches(torch.randn(3, CLASSES), torch.tensor([0, 1, 2]), metrics)
    kinds = {name: type(patch) for name, patch in made.items()}
    assert kinds == {"accuracy": ConfusionPatch, "precision": ConfusionPatch, "recall": ConfusionPatch,
                     "f1": ConfusionPatch, "f1_renamed": ConfusionPatch, "auroc_fn": TensorPatch}
    assert Trainer(_model(), F.cross_entropy, device="cpu").config.metric_patch == "auto"


class PassThrough(nn.Module):
    """Returns its input: the batches are (predictions, targets)."""

    def __init__(self):
        super().__init__()
        self.unused = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return x


def test_auto_equals_the_whole_data_computation_with_class_index_and_binary_predictions():
    """Class-index predictions (the class count inferred per batch) and two-class probabilities."""
    g = torch.Generator().manual_seed(11)
    labels = torch.randint(0, 3, (50,), generator=g)
    guesses = torch.where(torch.rand(50, generator=g) < 0.6, labels, torch.randint(0, 3, (50,), generator=g))
    batches = list(zip(guesses.split(7), labels.split(7)))
    identity = _quiet(PassThrough(), epochs=1, metrics=[accuracy, precision, recall, f1])
    result = identity.test(batches, do_loss=False)
    for fn in (accuracy, precision, recall, f1):
        assert result[fn.__name__] == pytest.approx(float(fn(guesses, labels)), abs=0)
    probs, truth = torch.rand(40, generator=g), torch.randint(0, 2, (40,), generator=g)
    result = identity.test(list(zip(probs.split(6), truth.split(6))), do_loss=False)
    for fn in (accuracy, precision, recall, f1):
        assert result[fn.__name__] == pytest.approx(float(fn(probs, truth)), abs=0)


def test_stored_predictions_past_the_documented_size_warn_once_naming_the_metric_and_the_ways_out(monkeypatch):
    """A function that keeps predictions warns once when they pass the size, with the alternatives; the
    library's counted metrics never warn."""
    monkeypatch.setattr(tensor_patch_module, "TENSOR_PATCH_WARN_BYTES", 2000)
    monkeypatch.setattr(tensor_patch_module, "_warned_growth", set())
    trainer = _quiet(_model(), epochs=2, metrics=[accuracy, auroc_fn])
    train, val = _loaders()
    with pytest.warns(DeepEpochsWarning) as caught:
        trainer.fit(train, val)
    messages = [str(w.message) for w in caught if issubclass(w.category, DeepEpochsWarning)]
    assert len(messages) == 1
    assert "'auroc_fn'" in messages[0] and "GiB" in messages[0]
    for way_out in ("torchmetrics", "metric_patch='mean'", "metric_patch='confusion'"):
        assert way_out in messages[0]


# ---- two processes -------------------------------------------------------------------------------------
def _sync_worker(rank, world_size, init_method, out_dir):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    try:
        g = torch.Generator().manual_seed(21)
        preds, targets = torch.randn(70, CLASSES, generator=g).softmax(1), torch.randint(0, CLASSES, (70,), generator=g)
        shard = slice(0, 25) if rank == 0 else slice(25, 70)
        sizes = (4, 21) if rank == 0 else (30, 1, 14)
        results = {}
        for name, metric in (("auroc", MulticlassAUROC(num_classes=CLASSES)),
                             ("f1", MulticlassF1Score(num_classes=CLASSES, average="macro"))):
            parts = [StreamPatch(metric, p, t) for p, t in zip(preds[shard].split(sizes), targets[shard].split(sizes))]
            results[name] = float(merge_patches(parts).sync()())
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.distributed
def test_stream_patches_merge_across_two_ranks_into_the_whole_data_value(tmp_path):
    """Two gloo ranks with unequal shards: after one sync, every rank holds the whole-data value."""
    spawn_with_deadline(_sync_worker, (2, f"tcp://127.0.0.1:{free_port()}", str(tmp_path)))
    g = torch.Generator().manual_seed(21)
    preds, targets = torch.randn(70, CLASSES, generator=g).softmax(1), torch.randint(0, CLASSES, (70,), generator=g)
    expected = {"auroc": float(auroc_fn(preds, targets)), "f1": float(f1_macro_fn(preds, targets))}
    for rank in range(2):
        assert torch.load(tmp_path / f"rank{rank}.pt") == pytest.approx(expected, abs=1e-6), f"rank {rank}"


def test_a_stream_patch_of_something_that_is_not_a_metric_object_is_refused_naming_what_it_lacks():
    """The error names the argument, what is accepted and what was given."""
    from deepepochs.errors import ConfigError

    with pytest.raises(ConfigError, match=r"metric must be a metric object with update\(\), compute\(\) and reset\(\)"
                                          r" methods, such as a torchmetrics.Metric \(got function, lacking"):
        StreamPatch(auroc_fn, torch.randn(2, CLASSES), torch.tensor([0, 1]))
