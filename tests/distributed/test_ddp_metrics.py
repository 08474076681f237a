"""Dataset-level metrics under DDP (two gloo processes): a torchmetrics object streamed per rank and merged
once, deepepochs' counted metrics and a function keeping every prediction all give every rank the value
computed here on the whole data at once, with uneven and empty evaluation shards."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchmetrics")

TARGETS_DIR = Path(__file__).resolve().parent
if str(TARGETS_DIR) not in sys.path:
    sys.path.insert(0, str(TARGETS_DIR))

import stream_targets as S  # noqa: E402  (needs the sys.path entry above)
from deadline import launch_scenarios  # noqa: E402

from deepepochs.metrics import accuracy, f1  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_metrics")
    launch_scenarios(S.main, S.OUT_ENV, out, seconds=240)
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def _whole_data(state, x, y):
    model = S.make_model()
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        preds = model(x)
    return {"MulticlassAUROC": float(S.auroc_fn(preds, y)), "auroc_fn": float(S.auroc_fn(preds, y)),
            "accuracy": float(accuracy(preds, y)), "f1": float(f1(preds, y))}


@pytest.mark.distributed
def test_metric_objects_and_counted_metrics_under_ddp_equal_the_whole_data_on_every_rank(ranks):
    """Test metrics of the final weights over all 37 samples (shards of 19 and 18), and over one sample
    (rank 1 has no batch), equal the computation on the whole data here; training metrics of the object
    equal its functional form on the same epoch's predictions."""
    x, y = S.make_data(37, 2).tensors
    for rank in ranks:
        expected = _whole_data(rank["state"], x, y)
        assert {k: rank["test"][k] for k in expected} == pytest.approx(expected, abs=1e-6)
        assert rank["tiny"]["accuracy"] == pytest.approx(_whole_data(rank["state"], x[:1], y[:1])["accuracy"])
        train = rank["records"]["train"]
        assert train["MulticlassAUROC"] == pytest.approx(train["auroc_fn"], abs=1e-6)
    assert ranks[0]["records"] == ranks[1]["records"] and ranks[0]["test"] == ranks[1]["test"]


@pytest.mark.distributed
def test_a_function_keeping_predictions_is_computed_on_rank_0_only(ranks):
    """Its predictions travel to rank 0, which computes the value over all samples (48 training, 37
    validation and test) and sends it to rank 1; rank 1 only ever computes on its own first batches."""
    assert ranks[0]["records"]["train"]["sample_count"] == [48.0, 48.0]
    assert ranks[1]["records"]["val"]["sample_count"] == [37.0, 37.0] and ranks[1]["test"]["sample_count"] == 37.0
    assert {48, 37} <= set(ranks[0]["seen"])
    assert max(ranks[1]["seen"]) <= 5  # its first batch per task (checked there), never the merged data


def _sklearn_counted(state: dict, classes: int, n: int) -> dict:
    """scikit-learn's accuracy, precision, recall and F1 of the weights `state` on the
    whole evaluation set of `n` samples (deepepochs' default average: binary for two classes, else micro)."""
    from sklearn import metrics as skm

    x, y = S.make_data(n, 4, classes).tensors
    model = S.make_model(classes)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        pred = model(x).argmax(1).numpy()
    average = "binary" if classes == 2 else "micro"
    return {"accuracy": skm.accuracy_score(y, pred),
            "precision": skm.precision_score(y, pred, average=average, zero_division=0),
            "recall": skm.recall_score(y, pred, average=average, zero_division=0),
            "f1": skm.f1_score(y, pred, average=average, zero_division=0)}


@pytest.mark.distributed
@pytest.mark.parametrize("classes", [2, S.CLASSES])
def test_counted_metrics_under_ddp_equal_scikit_learn_on_uneven_single_batch_and_empty_shards(ranks, classes):
    """Accuracy, precision, recall and F1 (one confusion matrix per batch, shared by the metrics) equal
    scikit-learn on the whole set on every rank: shards of 2 batches and 1 batch, an empty shard, and in the
    validation records; each later metric does not count a merged matrix again."""
    for rank in ranks:
        counted = rank["counted"][classes]
        sets = [("val", S.COUNTED_SETS[0][0], counted["val"])]
        sets += [(f"test of {n} by {batch}", n, values) for (n, batch), values in zip(S.COUNTED_SETS, counted["tests"])]
        for where, n, values in sets:
            expected = _sklearn_counted(counted["state"], classes, n)
            assert {k: float(values[k]) for k in expected} == pytest.approx(expected, abs=1e-6), where
