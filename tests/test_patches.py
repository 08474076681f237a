"""Patches give whole-dataset metrics from uneven batches, merge without side effects, sync across ranks."""

import datetime
import functools
import math
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from processes import free_port, spawn_with_deadline  # noqa: E402  (tests/, on sys.path under pytest)

from deepepochs import metrics as dm
from deepepochs.errors import ConfigError
from deepepochs.patches import (
    MeanPatch,
    PatchBase,
    TensorPatch,
    ValuePatch,
    merge_patches,
)
from deepepochs.patches.confusion import ConfusionMetrics, ConfusionPatch


def _skm():
    """scikit-learn's metrics, imported on first use so the spawned sync workers need not load it."""
    return pytest.importorskip("sklearn.metrics")


NUM_SAMPLES, NUM_CLASSES = 103, 4
BATCH_SIZES = (1, 7, 30, 2, 50, 13)  # uneven, and the tiny batches lack most classes
SHARD = 40  # rank 0 takes the first 40 samples, rank 1 the other 63


def _dataset():
    """Logits [N, C] and targets [N]; class 3 never occurs (true or predicted) in the first SHARD samples."""
    g = torch.Generator().manual_seed(1234)
    targets = torch.randint(0, NUM_CLASSES, (NUM_SAMPLES,), generator=g)
    targets[:SHARD] %= NUM_CLASSES - 1
    logits = torch.randn(NUM_SAMPLES, NUM_CLASSES, generator=g)
    logits[torch.arange(NUM_SAMPLES), targets] += 1.0
    logits[:SHARD, NUM_CLASSES - 1] = -10.0
    return logits, targets


def _batches(*tensors, sizes=BATCH_SIZES):
    """Split tensors along dim 0 into batches of the given sizes, as tuples."""
    return list(zip(*(t.split(list(sizes)) for t in tensors)))


def _sk_scores(targets, preds, average="micro"):
    """Whole-dataset reference values from scikit-learn (zero_division=0); 'micro' is what deepepochs.metrics
    uses by default for these four classes (0.6's default)."""
    t, p, skm = np.asarray(targets), np.asarray(preds), _skm()
    return {
        "accuracy": skm.accuracy_score(t, p),
        "precision": skm.precision_score(t, p, average=average, zero_division=0),
        "recall": skm.recall_score(t, p, average=average, zero_division=0),
        "f1": skm.f1_score(t, p, average=average, zero_division=0),
    }


def _as_floats(result):
    return {key: float(value) for key, value in result.items()}


@pytest.mark.parametrize("average", ("micro", "macro", "weighted"))
def test_tensor_patch_over_uneven_batches_equals_the_whole_dataset(average):
    """Merged TensorPatches give the whole-dataset precision, recall and F1 of scikit-learn."""
    logits, targets = _dataset()
    expected = _sk_scores(targets, logits.argmax(1), average)
    for name, fn in (("precision", dm.precision), ("recall", dm.recall), ("f1", dm.f1)):
        metric = functools.partial(fn, average=average)
        merged = sum(TensorPatch(metric, p, t) for p, t in _batches(logits, targets))
        assert float(merged()) == pytest.approx(expected[name])


def test_batch_means_of_f1_differ_from_the_dataset_f1():
    """Averaging per-batch F1 is not the dataset F1: the reason TensorPatch and ConfusionPatch exist."""
    logits, targets = _dataset()
    # macro: a micro F1 is the accuracy, whose sample-weighted batch mean is exactly the dataset's
    macro_f1 = functools.partial(dm.f1, average="macro")
    batch_mean = merge_patches([MeanPatch(macro_f1, p, t) for p, t in _batches(logits, targets)])()
    assert float(batch_mean) != pytest.approx(_sk_scores(targets, logits.argmax(1), "macro")["f1"], abs=1e-3)


def test_mean_patch_accuracy_over_uneven_batches_equals_the_whole_dataset():
    """Sample-weighted MeanPatch accuracy equals the accuracy of the whole dataset."""
    logits, targets = _dataset()
    merged = merge_patches([MeanPatch(dm.accuracy, p, t) for p, t in _batches(logits, targets)])
    assert float(merged()) == pytest.approx(_skm().accuracy_score(targets, logits.argmax(1)))


def test_value_patch_of_batch_mean_losses_equals_the_mean_over_all_samples():
    """ValuePatches of per-batch mean losses merge into the mean loss over all samples."""
    logits, targets = _dataset()
    patches = [ValuePatch(F.cross_entropy(p, t), len(t)) for p, t in _batches(logits, targets)]
    assert float(sum(patches)()) == pytest.approx(float(F.cross_entropy(logits, targets)))


@pytest.mark.parametrize("average", ("micro", "macro", "weighted"))
def test_confusion_patch_over_uneven_batches_equals_sklearn_on_the_whole_dataset(average):
    """ConfusionPatch metrics equal scikit-learn's on the whole set, though batch matrices differ in size."""
    logits, targets = _dataset()
    preds = logits.argmax(1)  # class indices: each batch's matrix is only as large as its largest class
    patches = [ConfusionPatch(p, t, average=average) for p, t in _batches(preds, targets)]
    assert {patch.state.matrix.shape[0] for patch in patches} != {NUM_CLASSES}
    merged = merge_patches(patches)
    assert _as_floats(merged()) == pytest.approx(_sk_scores(targets, preds, average))
    np.testing.assert_array_equal(merged.state.matrix.numpy(), _skm().confusion_matrix(targets, preds))


def test_confusion_patch_accepts_the_metric_functions_under_their_names():
    """metrics= may hold deepepochs.metrics functions (as the trainer passes them); keys are their names."""
    logits, targets = _dataset()
    result = ConfusionPatch(logits, targets, metrics=[dm.accuracy, dm.f1])()
    assert list(result) == ["accuracy", "f1"]
    assert float(result["f1"]) == pytest.approx(_sk_scores(targets, logits.argmax(1))["f1"])


def test_confusion_patch_recognises_a_renamed_metric_wrapper():
    """A functools.wraps wrapper of a known metric maps to it and keeps its own display name."""

    @functools.wraps(dm.recall)
    def wrapper(*args, **kwargs):
        return dm.recall(*args, **kwargs)

    wrapper.__name__ = "rec"
    logits, targets = _dataset()
    assert _as_floats(ConfusionPatch(logits, targets, metrics=wrapper)()) == pytest.approx(
        {"rec": _sk_scores(targets, logits.argmax(1))["recall"]}
    )


def test_confusion_patch_can_return_the_matrix_itself():
    """'confusion_matrix' in metrics= returns the accumulated [C, C] matrix."""
    preds, targets = torch.tensor([0, 1, 1]), torch.tensor([0, 0, 1])
    result = ConfusionPatch(preds, targets, metrics=("confusion_matrix",), num_classes=3)()
    assert torch.equal(result["confusion_matrix"], torch.tensor([[1, 1, 0], [0, 1, 0], [0, 0, 0]]))


def test_confusion_metrics_gives_several_metrics_from_one_patch():
    """ConfusionMetrics builds one ConfusionPatch per call whose dict holds every requested metric."""
    logits, targets = _dataset()
    cm = ConfusionMetrics(("precision", "recall", "f1"), average="weighted")
    merged = sum(cm(p, t) for p, t in _batches(logits, targets))
    assert isinstance(merged, ConfusionPatch)
    expected = _sk_scores(targets, logits.argmax(1), "weighted")
    assert _as_floats(merged()) == pytest.approx({k: expected[k] for k in ("precision", "recall", "f1")})


def _all_patches(logits, targets):
    """One patch of each built-in kind, loaded with the same batch."""
    return [
        TensorPatch(dm.f1, logits, targets),
        MeanPatch(dm.accuracy, logits, targets),
        ValuePatch(F.cross_entropy(logits, targets), len(targets)),
        ConfusionPatch(logits, targets),
    ]


def _values(patch):
    result = patch()
    return _as_floats(result) if isinstance(result, dict) else float(result)


def test_adding_patches_leaves_both_operands_unchanged():
    """a + b returns a merged new patch; a and b keep their own values afterwards."""
    (p1, t1), (p2, t2) = _batches(*_dataset(), sizes=(40, 63))
    for a, b in zip(_all_patches(p1, t1), _all_patches(p2, t2)):
        before = (_values(a), _values(b))
        merged = a + b
        assert merged is not a and merged is not b
        merged.add(b)  # writing into the result must not reach the operands either
        assert (_values(a), _values(b)) == before


def test_add_merges_in_place_and_returns_self():
    """add merges the other patch into self and returns self, equal to the + result."""
    (p1, t1), (p2, t2) = _batches(*_dataset(), sizes=(40, 63))
    for a, b in zip(_all_patches(p1, t1), _all_patches(p2, t2)):
        expected = _values(a + b)
        assert a.add(b) is a
        assert _values(a) == pytest.approx(expected)


def test_empty_patches_merge_as_identity():
    """A patch built without a batch adds nothing; empty Value and Mean patches compute NaN."""
    logits, targets = _dataset()
    empties = [TensorPatch(dm.f1), MeanPatch(dm.accuracy), ValuePatch(), ConfusionPatch()]
    for empty, full in zip(empties, _all_patches(logits, targets)):
        assert _values(empty.copy() + full) == pytest.approx(_values(full))
        assert _values(full + empty) == pytest.approx(_values(full))
    assert math.isnan(ValuePatch()()) and math.isnan(MeanPatch(dm.accuracy)())
    with pytest.raises(ValueError, match="is empty"):
        TensorPatch(dm.f1)()


def test_patches_of_different_classes_refuse_to_merge():
    """Adding a patch of another class raises TypeError naming both classes."""
    with pytest.raises(TypeError, match="cannot add a ValuePatch to a MeanPatch"):
        MeanPatch(dm.accuracy, torch.tensor([1]), torch.tensor([1])).add(ValuePatch(1.0, 1))


def test_tensor_patch_concatenates_nested_preds_and_targets_leafwise():
    """Nested tuple/dict preds and targets are concatenated leaf by leaf before the metric runs once."""
    logits, targets = _dataset()
    weights = torch.rand(NUM_SAMPLES)
    calls = []

    def metric(preds, labels):
        calls.append(1)
        scores, aux = preds
        assert aux["w"].shape == (NUM_SAMPLES,) and labels["names"] == [f"s{i}" for i in range(NUM_SAMPLES)]
        return dm.f1(scores, labels["y"])

    names = [f"s{i}" for i in range(NUM_SAMPLES)]
    patches = []
    start = 0
    for size in BATCH_SIZES:
        batch = slice(start, start + size)
        preds = (logits[batch], {"w": weights[batch]})
        patches.append(TensorPatch(metric, preds, {"y": targets[batch], "names": names[batch]}))
        start += size
    assert float(merge_patches(patches)()) == pytest.approx(_sk_scores(targets, logits.argmax(1))["f1"])
    assert calls == [1]


def test_tensor_patch_forward_twice_gives_the_same_value_from_compacted_state():
    """After forward the patch keeps one concatenated batch, and computing again gives the same value."""
    logits, targets = _dataset()
    merged = sum(TensorPatch(dm.f1, p, t) for p, t in _batches(logits, targets))
    first = merged()
    assert len(merged.state.preds) == 1 and torch.equal(merged(), first)


def test_mean_patch_weights_each_key_of_a_dict_valued_metric():
    """A dict-valued metric is averaged key by key, each weighted by the batch sizes."""
    logits, targets = _dataset()

    def metric(preds, labels):
        correct = (preds.argmax(1) == labels).float()
        return {"acc": correct.mean(), "err": 1 - correct.mean()}

    merged = sum(MeanPatch(metric, p, t) for p, t in _batches(logits, targets))
    accuracy = _skm().accuracy_score(targets, logits.argmax(1))
    assert _as_floats(merged()) == pytest.approx({"acc": accuracy, "err": 1 - accuracy})


def test_an_empty_batch_adds_nothing_to_a_mean_patch_even_when_its_metric_is_nan():
    """A batch of 0 samples weighs 0, so the NaN mean of an empty batch does not poison the dataset mean."""
    mean_of_preds = lambda preds, targets: preds.float().mean()
    full = MeanPatch(mean_of_preds, torch.tensor([1.0, 3.0]), torch.tensor([0, 0]))
    empty = MeanPatch(mean_of_preds, torch.zeros(0), torch.zeros(0))
    assert math.isnan(empty.metric(torch.zeros(0), None)) and float((full + empty)()) == 2.0


def test_mean_patch_infers_batch_size_from_targets_then_preds():
    """The sample count is dim 0 of the first tensor in targets, else preds, unless batch_size is given."""
    count = lambda patch: patch.state.count
    assert count(MeanPatch(lambda p, t: 1.0, torch.zeros(5, 2), (None, torch.zeros(3)))) == 3
    assert count(MeanPatch(lambda p, t: 1.0, {"a": torch.zeros(4)}, None)) == 4
    assert count(MeanPatch(lambda p, t: 1.0, torch.zeros(4), torch.zeros(4), batch_size=9)) == 9
    with pytest.raises(ConfigError, match="batch_size cannot be inferred.*pass batch_size="):
        MeanPatch(lambda p, t: 1.0, [1, 2], None)


def test_mean_and_value_patches_hold_values_detached_from_the_graph():
    """Mean/Value patch states and results neither require grad nor have a grad_fn."""
    weights = torch.randn(4, 3, requires_grad=True)
    preds = torch.randn(6, 4) @ weights
    targets = torch.tensor([0, 1, 2, 0, 1, 2])
    loss = F.cross_entropy(preds, targets)
    patches = [
        ValuePatch(loss, 6),
        MeanPatch(lambda p, t: F.cross_entropy(p, t), preds, targets),
        MeanPatch(lambda p, t: {"l": F.cross_entropy(p, t)}, preds, targets),
    ]
    for patch in patches:
        for value in (patch.state.total, patch()):
            for tensor in value.values() if isinstance(value, dict) else [value]:
                assert not tensor.requires_grad and tensor.grad_fn is None
    stored = TensorPatch(dm.f1, preds, targets).state.preds[0]
    assert not stored.requires_grad and stored.grad_fn is None


def test_mean_patch_keeps_tensors_without_reading_them_on_the_host():
    """Per-batch bookkeeping keeps tensor sums (no .item()): the total stays a tensor on the input device."""
    patch = ValuePatch(torch.tensor(2.0), 3) + ValuePatch(torch.tensor(4.0), 1)
    assert isinstance(patch.state.total, torch.Tensor) and patch.state.count == 4
    assert float(patch()) == pytest.approx(2.5)


def test_sync_without_a_process_group_returns_the_patch_unchanged():
    """Outside torch.distributed, sync returns self with its state untouched."""
    for patch in _all_patches(*_dataset()):
        before = _values(patch)
        assert patch.sync() is patch and _values(patch) == before


def _mean_of_preds_and_targets(preds, targets):
    return (preds == targets).float().mean()


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: ConfusionPatch(metrics=("accuracy", "auc")),
            r"must be among 'accuracy', .*'confusion_matrix' \(got 'auc'\)",
        ),
        (
            lambda: ConfusionPatch(metrics=[dm.accuracy, _mean_of_preds_and_targets]),
            r"metric_patch='confusion' supports only .*\(got '_mean_of_preds_and_targets'\); use"
            r" metric_patch='tensor'",
        ),
        (
            lambda: ConfusionPatch(metrics=functools.partial(dm.f1, average="micro")),
            r"use metric_patch='tensor'",
        ),
        (lambda: ConfusionPatch(metrics=()), r"metrics must name at least one of"),
        (lambda: ConfusionPatch(metrics=("f1", dm.f1)), r"distinct names \(got \['f1', 'f1'\]\)"),
        (
            lambda: ConfusionMetrics(average="mean"),
            r"average must be None or one of 'binary', 'micro', 'macro', 'weighted' \(got 'mean'\)",
        ),
        (lambda: ConfusionMetrics(num_classes=-2), r"num_classes must be None or a positive int \(got -2\)"),
        (
            lambda: MeanPatch(lambda p, t: torch.ones(3, 2), torch.zeros(3)),
            r"metric '<lambda>' must be a number, a one-element tensor or a 1-D tensor of per-class values"
            r" \(got shape \[3, 2\]\)",
        ),
        (lambda: MeanPatch("accuracy"), r"metric must be a callable taking \(preds, targets\) \(got str\)"),
        (lambda: ValuePatch().load(1.0), r"batch_size is required: ValuePatch\(batch_mean_value, batch_size\)"),
        (lambda: ValuePatch(1.0, -1), r"batch_size must be a number >= 0 .*\(got -1\)"),
        (lambda: merge_patches([]), r"patches must hold at least one patch"),
    ],
    ids=[
        "unknown_name",
        "unknown_function",
        "partial",
        "no_metrics",
        "duplicate",
        "average",
        "num_classes",
        "non_scalar",
        "not_callable",
        "no_batch_size",
        "negative_batch_size",
        "merge_nothing",
    ],
)
def test_bad_patch_arguments_raise_config_error_naming_them(build, message):
    """Each bad argument raises ConfigError naming it, the accepted values and what was received."""
    with pytest.raises(ConfigError, match=message):
        build()


# --- two processes over gloo ------------------------------------------------------------------------------


class _MaxAbsPatch(PatchBase):
    """A user-defined patch with no sync code of its own; its lambda attribute cannot be pickled."""

    def __init__(self, values=None, name=None):
        super().__init__(name)
        self.transform = lambda t: t.abs()
        self.value = None if values is None else self.transform(values).max()

    def load(self, values):
        self.value = self.transform(values).max()
        return self

    def add(self, other):
        self.value = other.value if self.value is None else torch.maximum(self.value, other.value)
        return self

    def forward(self):
        return self.value


def _sync_worker(rank, world_size, init_method, out_dir):
    """Build patches from this rank's shard, sync them, and save the results for the parent to check."""
    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        logits, targets = _dataset()
        shard = slice(0, SHARD) if rank == 0 else slice(SHARD, NUM_SAMPLES)
        logits, targets = logits[shard], targets[shard]
        sizes = (3, 37) if rank == 0 else (20, 1, 42)
        batches = _batches(logits, targets, sizes=sizes)
        merge = lambda patches: merge_patches(patches).sync()
        results = {
            "tensor": merge([TensorPatch(dm.f1, p, t) for p, t in batches])(),
            "mean": merge([MeanPatch(dm.accuracy, p, t) for p, t in batches])(),
            "value": merge([ValuePatch(F.cross_entropy(p, t), len(t)) for p, t in batches])(),
            # Class indices: rank 0 never sees class 3, so its matrix is 3x3 against rank 1's 4x4.
            "confusion": merge([ConfusionPatch(p.argmax(1), t) for p, t in batches])(),
            "custom": merge([_MaxAbsPatch(p) for p, _ in batches])(),
            # A rank that saw no batch takes part with an empty patch.
            "empty_rank_value": (ValuePatch() if rank else ValuePatch(2.0, 4)).sync()(),
            "empty_rank_tensor": (
                TensorPatch(dm.accuracy) if rank else TensorPatch(dm.accuracy, *batches[-1])
            ).sync()(),
            "empty_rank_confusion": (ConfusionPatch() if rank else ConfusionPatch(*batches[-1])).sync()(),
        }
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _flat(results):
    """{'a': {'b': x}} -> {'a.b': float(x)}, since pytest.approx compares flat dicts only."""
    flat = {}
    for key, value in results.items():
        for sub, item in value.items() if isinstance(value, dict) else [(None, value)]:
            flat[key if sub is None else f"{key}.{sub}"] = float(item)
    return flat


@pytest.mark.distributed
def test_sync_gives_every_rank_the_whole_dataset_metrics(tmp_path):
    """Two gloo processes with unequal shards: after sync every rank gets the whole-dataset values."""
    world_size = 2
    spawn_with_deadline(_sync_worker, (world_size, f"tcp://127.0.0.1:{free_port()}", str(tmp_path)), world_size)

    logits, targets = _dataset()
    preds = logits.argmax(1)
    last = _batches(logits[:SHARD], targets[:SHARD], sizes=(3, 37))[-1]
    expected = {
        "tensor": _sk_scores(targets, preds)["f1"],
        "mean": _skm().accuracy_score(targets, preds),
        "value": float(F.cross_entropy(logits, targets)),
        "confusion": _sk_scores(targets, preds),
        "custom": float(logits.abs().max()),
        "empty_rank_value": 2.0,
        "empty_rank_tensor": float(dm.accuracy(*last)),
        "empty_rank_confusion": _sk_scores(last[1], last[0].argmax(1)),
    }
    for rank in range(world_size):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        assert _flat(results) == pytest.approx(_flat(expected)), f"rank {rank}"
