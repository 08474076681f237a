"""deepepochs.metrics against scikit-learn and plain numpy, on binary and multiclass data."""

import numpy as np
import pytest
import torch

from deepepochs import metrics as dm
from deepepochs.errors import ConfigError

skm = pytest.importorskip("sklearn.metrics")

SEEDS = range(12)
MULTICLASS_AVERAGES = ("micro", "macro", "weighted")


def _random_case(seed, num_classes, n=None):
    """Random logits [N, C] and targets [N] whose predictions are right about half the time."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 60, (1,), generator=g)) if n is None else n
    targets = torch.randint(0, num_classes, (n,), generator=g)
    logits = torch.randn(n, num_classes, generator=g)
    logits[torch.arange(n), targets] += 0.8
    return logits, targets


def _sk(name, targets, preds, **kwargs):
    """The scikit-learn value of a metric on index arrays, with zero_division=0."""
    functions = {
        "precision": skm.precision_score,
        "recall": skm.recall_score,
        "f1": skm.f1_score,
        "fbeta": skm.fbeta_score,
    }
    return functions[name](np.asarray(targets), np.asarray(preds), zero_division=0, **kwargs)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("average", MULTICLASS_AVERAGES)
def test_multiclass_precision_recall_f1_equal_sklearn(seed, average):
    """Multiclass precision, recall, F1 and F-beta equal scikit-learn's for every average."""
    logits, targets = _random_case(seed, num_classes=5)
    preds = logits.argmax(1)
    assert float(dm.precision(logits, targets, average)) == pytest.approx(
        _sk("precision", targets, preds, average=average)
    )
    assert float(dm.recall(logits, targets, average)) == pytest.approx(
        _sk("recall", targets, preds, average=average)
    )
    assert float(dm.f1(logits, targets, average)) == pytest.approx(_sk("f1", targets, preds, average=average))
    expected = _sk("fbeta", targets, preds, beta=0.5, average=average)
    assert float(dm.fbeta(logits, targets, 0.5, average)) == pytest.approx(expected)


@pytest.mark.parametrize("seed", SEEDS)
def test_binary_average_scores_class_one_like_sklearn(seed):
    """average='binary' equals scikit-learn's default binary scores (positive class 1)."""
    logits, targets = _random_case(seed, num_classes=2)
    preds = logits.argmax(1)
    for name, fn in (("precision", dm.precision), ("recall", dm.recall), ("f1", dm.f1)):
        assert float(fn(logits, targets, average="binary")) == pytest.approx(_sk(name, targets, preds))
    assert float(dm.fbeta(logits, targets, 2.0, average="binary")) == pytest.approx(
        _sk("fbeta", targets, preds, beta=2.0)
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_accuracy_equals_sklearn(seed):
    """Accuracy equals scikit-learn's accuracy_score."""
    logits, targets = _random_case(seed, num_classes=4)
    assert float(dm.accuracy(logits, targets)) == pytest.approx(skm.accuracy_score(targets, logits.argmax(1)))


@pytest.mark.parametrize("seed", SEEDS)
def test_confusion_matrix_equals_sklearn_and_a_numpy_count(seed):
    """The confusion matrix equals scikit-learn's and a plain numpy count (rows true, columns predicted)."""
    logits, targets = _random_case(seed, num_classes=4)
    preds = logits.argmax(1)
    cm = dm.confusion_matrix(logits, targets)
    expected = np.zeros((4, 4), dtype=np.int64)
    np.add.at(expected, (targets.numpy(), preds.numpy()), 1)
    assert cm.dtype == torch.int64
    np.testing.assert_array_equal(cm.numpy(), expected)
    np.testing.assert_array_equal(cm.numpy(), skm.confusion_matrix(targets, preds, labels=range(4)))


def test_logits_indices_and_one_hot_inputs_give_the_same_scores():
    """Logits, class indices, [N, 1] indices and one-hot targets are interchangeable inputs."""
    logits, targets = _random_case(3, num_classes=3, n=40)
    indices = logits.argmax(1)
    one_hot = torch.nn.functional.one_hot(targets, 3).float()
    reference = dm.f1(indices, targets, "weighted")
    for preds, labels in ((logits, targets), (indices[:, None], targets[:, None]), (logits, one_hot)):
        assert torch.equal(dm.f1(preds, labels, "weighted"), reference)
        assert torch.equal(dm.confusion_matrix(preds, labels), dm.confusion_matrix(indices, targets))


def test_one_dimensional_float_preds_are_class_one_probabilities():
    """1-D (and [N, 1]) float preds are thresholded at 0.5 as probabilities of class 1; threshold moves it."""
    probs = torch.tensor([0.1, 0.5, 0.7, 0.49, 0.9])
    targets = torch.tensor([0, 1, 1, 1, 0])
    hard = np.array([0, 1, 1, 0, 1])
    assert float(dm.precision(probs, targets, "binary")) == pytest.approx(_sk("precision", targets, hard))
    assert float(dm.recall(probs[:, None], targets.float(), "binary")) == pytest.approx(
        _sk("recall", targets, hard)
    )
    logits = torch.logit(probs)
    assert torch.equal(
        dm.confusion_matrix(logits, targets, threshold=0.0), dm.confusion_matrix(probs, targets)
    )


def test_classes_absent_from_the_data_are_left_out_of_macro_like_sklearn():
    """Macro averages only classes present in targets or preds, whatever num_classes says, as sklearn does."""
    targets = torch.tensor([0, 0, 2, 2, 2])
    preds = torch.tensor([0, 2, 2, 2, 0])
    for average in MULTICLASS_AVERAGES:
        expected = _sk("f1", targets, preds, average=average)
        assert float(dm.f1(preds, targets, average)) == pytest.approx(expected)
        assert float(dm.f1(preds, targets, average, num_classes=6)) == pytest.approx(expected)
    assert dm.confusion_matrix(preds, targets, num_classes=6).shape == (6, 6)


def test_a_class_never_predicted_scores_zero_precision():
    """zero_division=0: a true class that is never predicted contributes 0 precision, as in sklearn."""
    targets = torch.tensor([0, 1, 2, 2])
    preds = torch.tensor([0, 0, 0, 2])
    assert float(dm.precision(preds, targets, "macro")) == pytest.approx(
        _sk("precision", targets, preds, average="macro")
    )


def test_binary_data_with_only_negatives_scores_zero():
    """Binary data without a class-1 sample scores 0 (no division error), like sklearn's zero_division=0."""
    zeros = torch.zeros(4, dtype=torch.long)
    assert float(dm.f1(zeros, zeros, "binary")) == _sk("f1", zeros, zeros) == 0.0
    assert float(dm.accuracy(zeros, zeros)) == 1.0


def test_empty_inputs_score_zero():
    """Empty preds and targets give 0 for every metric instead of NaN or an error."""
    empty = torch.zeros(0, dtype=torch.long)
    assert float(dm.accuracy(empty, empty)) == 0.0
    assert float(dm.f1(empty, empty)) == 0.0
    assert dm.confusion_matrix(torch.zeros(0, 3), empty).shape == (3, 3)


@pytest.mark.parametrize("seed", range(3))
def test_default_average_is_0_6_micro_for_multiclass_and_sklearn_binary_for_two_classes(seed):
    """Without average=, multiclass precision/recall/F1/F-beta are 'micro' (0.6's documented default), and
    two-class ones score class 1 like scikit-learn's default (0.6's class-0 score was wrong)."""
    logits, targets = _random_case(seed, num_classes=3)
    preds = logits.argmax(1)
    assert float(dm.precision(logits, targets)) == pytest.approx(_sk("precision", targets, preds, average="micro"))
    assert float(dm.recall(logits, targets)) == pytest.approx(_sk("recall", targets, preds, average="micro"))
    assert float(dm.f1(logits, targets)) == pytest.approx(_sk("f1", targets, preds, average="micro"))
    assert float(dm.fbeta(logits, targets, 2.0)) == pytest.approx(
        _sk("fbeta", targets, preds, beta=2.0, average="micro"))
    logits, targets = _random_case(seed, num_classes=2)
    preds = logits.argmax(1)
    for name, fn in (("precision", dm.precision), ("recall", dm.recall), ("f1", dm.f1)):
        assert float(fn(logits, targets)) == pytest.approx(_sk(name, targets, preds))  # sklearn's default
    cm = dm.confusion_matrix(logits, targets)
    assert float(dm.precision_from_confusion(cm)) == pytest.approx(_sk("precision", targets, preds))


@pytest.mark.parametrize("average", ("binary",) + MULTICLASS_AVERAGES)
def test_from_confusion_helpers_equal_the_direct_metrics(average):
    """Metrics computed from a confusion matrix equal those computed from preds and targets."""
    logits, targets = _random_case(11, num_classes=2, n=50)
    cm = dm.confusion_matrix(logits, targets)
    assert torch.equal(dm.precision_from_confusion(cm, average), dm.precision(logits, targets, average))
    assert torch.equal(dm.recall_from_confusion(cm, average), dm.recall(logits, targets, average))
    assert torch.equal(dm.f1_from_confusion(cm, average), dm.f1(logits, targets, average))
    assert torch.equal(dm.fbeta_from_confusion(cm, 0.3, average), dm.fbeta(logits, targets, 0.3, average))
    assert torch.equal(dm.accuracy_from_confusion(cm), dm.accuracy(logits, targets))
    assert torch.equal(dm.from_confusion(cm, "f1", average), dm.f1(logits, targets, average))


def test_metrics_return_zero_dim_float_tensors_without_grad():
    """Every metric returns a 0-d float tensor detached from the graph of its inputs."""
    logits, targets = _random_case(5, num_classes=3)
    logits.requires_grad_(True)
    for value in (dm.accuracy(logits, targets), dm.f1(logits, targets), dm.precision(logits, targets)):
        assert value.shape == () and value.is_floating_point() and not value.requires_grad


def test_bad_average_names_the_accepted_values():
    """An unknown average raises ConfigError listing the accepted values and the received one."""
    with pytest.raises(
        ConfigError, match=r"average must be None or one of 'binary', 'micro', 'macro', 'weighted' \(got 'mean'\)"
    ):
        dm.f1(torch.tensor([0, 1]), torch.tensor([0, 1]), average="mean")


def test_binary_average_on_multiclass_data_is_refused():
    """average='binary' on more than two classes raises ConfigError suggesting the multiclass averages."""
    with pytest.raises(ConfigError, match=r"average='binary' needs at most 2 classes .*3x3.*'macro'"):
        dm.precision(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 2]), average="binary")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: dm.f1(torch.tensor([0]), torch.tensor([0]), num_classes=0),
            r"num_classes must be None or a positive int \(got 0\)",
        ),
        (
            lambda: dm.fbeta(torch.tensor([0]), torch.tensor([0]), beta=-1),
            r"beta must be a finite number >= 0 \(got -1\)",
        ),
        (
            lambda: dm.f1(torch.zeros(2, 3, 4), torch.tensor([0, 1])),
            r"preds must have shape \[N\], \[N, 1\] or \[N, C\] \(got \[2, 3, 4\]\)",
        ),
        (
            lambda: dm.f1(torch.tensor([0, 1]), torch.tensor([0, 1, 1])),
            r"same number of samples \(got 2 and 3\)",
        ),
        (
            lambda: dm.f1([0, 1], torch.tensor([0, 1])),
            r"preds and targets must be tensors \(got list and Tensor\)",
        ),
        (
            lambda: dm.confusion_matrix(torch.tensor([0, 4]), torch.tensor([0, 1]), num_classes=3),
            r"must lie in \[0, 2\] for 3 classes \(got values in \[0, 4\]\)",
        ),
        (
            lambda: dm.confusion_matrix(torch.tensor([0, -1]), torch.tensor([0, 1])),
            r"class indices must be >= 0 \(got -1\)",
        ),
        (
            lambda: dm.from_confusion(torch.eye(2, dtype=torch.long), "auc"),
            r"name must be one of 'accuracy', .*'fbeta' \(got 'auc'\)",
        ),
        (
            lambda: dm.f1_from_confusion(torch.zeros(2, 3)),
            r"cm must be a square \[C, C\] tensor of counts \(got \[2, 3\]\)",
        ),
    ],
    ids=[
        "num_classes",
        "beta",
        "preds_shape",
        "sample_count",
        "not_tensors",
        "out_of_range",
        "negative_index",
        "confusion_name",
        "confusion_shape",
    ],
)
def test_bad_arguments_raise_config_error_naming_them(call, message):
    """Each bad argument raises ConfigError whose message names it, what is accepted and what came."""
    with pytest.raises(ConfigError, match=message):
        call()


def test_config_error_is_a_value_error():
    """ConfigError subclasses ValueError, so generic handlers still catch bad metric arguments."""
    with pytest.raises(ValueError):
        dm.recall(torch.tensor([0]), torch.tensor([0]), average="samples")


def test_conf_mat_keyword_of_0_6_scores_a_given_confusion_matrix_like_sklearn():
    """0.6 code calls accuracy(conf_mat=cm) and f1(conf_mat=cm, average='macro'): the values equal
    scikit-learn's on the data the matrix counts; mixing conf_mat with preds is refused."""
    logits, targets = _random_case(4, num_classes=4, n=80)
    preds = logits.argmax(1)
    cm = dm.confusion_matrix(logits, targets, 4)
    assert float(dm.accuracy(conf_mat=cm)) == pytest.approx(skm.accuracy_score(targets.numpy(), preds.numpy()))
    for average in MULTICLASS_AVERAGES:
        assert float(dm.f1(conf_mat=cm, average=average)) == pytest.approx(_sk("f1", targets, preds, average=average))
        assert float(dm.precision(conf_mat=cm, average=average)) == pytest.approx(
            _sk("precision", targets, preds, average=average))
        assert float(dm.recall(conf_mat=cm, average=average)) == pytest.approx(
            _sk("recall", targets, preds, average=average))
        assert float(dm.fbeta(conf_mat=cm, beta=0.5, average=average)) == pytest.approx(
            _sk("fbeta", targets, preds, beta=0.5, average=average))
    with pytest.raises(ConfigError, match=r"f1\(\) takes either conf_mat= or \(preds, targets\), not both"):
        dm.f1(logits, targets, conf_mat=cm)
    with pytest.raises(ConfigError, match=r"recall\(\) needs preds and targets, or a confusion matrix"):
        dm.recall(logits)


def test_a_trainers_default_average_of_ten_classes_is_micro_equal_to_accuracy_and_says_so_once(capsys):
    """precision, recall and F1 without average= on 10 classes keep 0.6's micro average: equal to
    scikit-learn's micro and to the accuracy; the run prints once how to ask for macro, whose value then
    equals scikit-learn's macro; naming the average prints no note."""
    import functools

    from torch.nn import functional as F

    from deepepochs import Trainer, rename

    logits, targets = _random_case(0, 10, n=200)
    batches = [(logits[i:i + 40], targets[i:i + 40]) for i in range(0, 200, 40)]
    model = torch.nn.Identity()
    macro = rename(functools.partial(dm.f1, average="macro"), "macro_f1")
    with Trainer(model, F.cross_entropy, epochs=2, device="cpu", log_batch=False,
                 metrics=[dm.accuracy, dm.precision, dm.recall, dm.f1, macro]) as trainer:
        trainer.test(batches)
        got = trainer.test(batches)
    preds = logits.argmax(1).numpy()
    for name in ("precision", "recall", "f1"):
        assert got[name] == pytest.approx(_sk(name, targets, preds, average="micro"), abs=1e-6)
        assert got[name] == pytest.approx(got["accuracy"], abs=1e-6)
    assert got["macro_f1"] == pytest.approx(_sk("f1", targets, preds, average="macro"), abs=1e-6)
    assert got["macro_f1"] != pytest.approx(got["f1"], abs=1e-4)
    out = capsys.readouterr().out
    assert out.count(dm.MICRO_DEFAULT_NOTE) == 1
    assert dm.BINARY_DEFAULT_NOTE not in out
    micro = rename(functools.partial(dm.f1, average="micro"), "f1")
    with Trainer(model, F.cross_entropy, device="cpu", log_batch=False, metrics=[micro, macro]) as trainer:
        assert trainer.test(batches)["f1"] == pytest.approx(got["f1"], abs=1e-6)
    assert dm.MICRO_DEFAULT_NOTE not in capsys.readouterr().out
