"""Scores of a confusion matrix: accuracy, precision, recall, F-beta, and how ``average`` turns per-class
scores into one number (scikit-learn's definitions with ``zero_division=0``; see :mod:`deepepochs.metrics`).

Also the notes the trainer prints once when ``average=None`` chose for the user: class 1 of a two-class
problem (deepepochs 0.6 scored class 0), and the micro average of more than two classes (0.6's default,
which equals the accuracy for single-label data, where scikit-learn's and torchmetrics' reports show macro).
"""

from __future__ import annotations

import math
import numbers

import torch

from deepepochs.errors import ConfigError

__all__ = [
    "AVERAGES",
    "BINARY_DEFAULT_NOTE",
    "CONFUSION_METRICS",
    "DEFAULT_AVERAGE_NOTES",
    "MICRO_DEFAULT_NOTE",
    "_check_average",
    "_check_beta",
    "_check_confusion",
    "accuracy_from_confusion",
    "default_average",
    "f1_from_confusion",
    "fbeta_from_confusion",
    "from_confusion",
    "precision_from_confusion",
    "recall_from_confusion",
    "take_default_averages",
]

AVERAGES = ("binary", "micro", "macro", "weighted")
"""The accepted values of ``average`` besides None (the default: 'binary' for two classes, else 'micro')."""

CONFUSION_METRICS = ("accuracy", "precision", "recall", "f1", "fbeta")
"""The metric names :func:`from_confusion` accepts."""


def _quoted(values) -> str:
    return ", ".join(repr(v) for v in values)


def _check_average(average) -> None:
    if average is not None and (not isinstance(average, str) or average not in AVERAGES):
        raise ConfigError(
            f"average must be None or one of {_quoted(AVERAGES)} (got {average!r}); "
            "'macro' weighs every class equally, 'binary' scores class 1 only, None is 0.6's default"
            " ('binary' for two classes, else 'micro')"
        )


def default_average(num_classes: int) -> str:
    """What ``average=None`` means for a ``num_classes`` x ``num_classes`` confusion matrix."""
    return "binary" if num_classes <= 2 else "micro"


# The averages average=None chose since the trainer last asked ('binary' for two classes, 'micro' for more):
# it reads them (take_default_averages) after computing a task's metrics and tells the user once per kind.
_defaults_taken: set[str] = set()

BINARY_DEFAULT_NOTE = (
    "Note: precision, recall and F1 of a two-class problem score class 1, the positive class, as"
    " scikit-learn does (deepepochs 0.6 scored class 0). To choose, pass average='macro' (the mean over both"
    " classes) or average='micro' (equal to the accuracy) to the metric, e.g. rename(functools.partial(f1,"
    " average='macro'), 'f1'); for class 0's score swap the labels (1 - targets, and the score columns)."
)


MICRO_DEFAULT_NOTE = (
    "Note: precision, recall and F1 of more than two classes without average= are micro averages, as in"
    " deepepochs 0.6; for single-label data they equal the accuracy. scikit-learn's and torchmetrics'"
    " reports show the mean over the classes: pass average='macro' for it, e.g."
    " rename(functools.partial(f1, average='macro'), 'f1'), or average='micro' to keep this value quietly."
)

#: The note the trainer prints once for each average that ``average=None`` chose.
DEFAULT_AVERAGE_NOTES = {"binary": BINARY_DEFAULT_NOTE, "micro": MICRO_DEFAULT_NOTE}


def take_default_averages() -> list[str]:
    """The averages (keys of `DEFAULT_AVERAGE_NOTES`) that ``average=None`` chose since the last call, in
    a fixed order; the record is then cleared."""
    taken = sorted(_defaults_taken)
    _defaults_taken.clear()
    return taken


def _check_beta(beta) -> None:
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not math.isfinite(beta) or beta < 0:
        raise ConfigError(f"beta must be a finite number >= 0 (got {beta!r}); beta=1 gives F1")


def _check_confusion(cm) -> None:
    if not isinstance(cm, torch.Tensor) or cm.dim() != 2 or cm.shape[0] != cm.shape[1]:
        got = list(cm.shape) if isinstance(cm, torch.Tensor) else type(cm).__name__
        raise ConfigError(f"cm must be a square [C, C] tensor of counts (got {got})")


def _ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """Elementwise numerator / denominator, with 0 where the denominator is 0 (zero_division=0)."""
    numerator = numerator.to(torch.get_default_dtype())
    denominator = denominator.to(torch.get_default_dtype())
    return torch.where(denominator > 0, numerator / denominator.clamp(min=1e-38), torch.zeros_like(numerator))


def _fbeta_counts(tp, fp, fn, beta: float) -> torch.Tensor:
    """F-beta from true positive, false positive and false negative counts (elementwise)."""
    b2 = beta * beta
    # The count form avoids the 0/0 of 2PR/(P+R) when precision and recall are both 0.
    return _ratio((1 + b2) * tp, (1 + b2) * tp + b2 * fn + fp)


def _binary_positive(cm: torch.Tensor) -> torch.Tensor:
    """The counts matrix with at least two classes, raising when 'binary' cannot apply."""
    c = cm.shape[0]
    if c > 2:
        raise ConfigError(
            f"average='binary' needs at most 2 classes (got a {c}x{c} confusion matrix); "
            "use 'macro', 'micro' or 'weighted' for multiclass data"
        )
    if c < 2:
        # Only class 0 (or nothing) was seen: class 1 simply has no samples.
        cm = torch.nn.functional.pad(cm, (0, 2 - c, 0, 2 - c))
    return cm


def _averaged(cm: torch.Tensor, average: str, per_class) -> torch.Tensor:
    """Apply ``average`` to a per-class score computed by ``per_class(tp, fp, fn)``."""
    _check_average(average)
    _check_confusion(cm)
    if average is None:
        average = default_average(cm.shape[0])
        if cm.shape[0] >= 2:
            _defaults_taken.add(average)
    if average == "binary":
        cm = _binary_positive(cm)
    tp = cm.diagonal()
    true_count = cm.sum(dim=1)
    pred_count = cm.sum(dim=0)
    fp = pred_count - tp
    fn = true_count - tp
    if average == "binary":
        return per_class(tp, fp, fn)[1]
    if average == "micro":
        return per_class(tp.sum(), fp.sum(), fn.sum())
    scores = per_class(tp, fp, fn)
    if average == "weighted":
        return _ratio((scores * true_count).sum(), true_count.sum())
    present = ((true_count + pred_count) > 0).to(scores.dtype)
    return _ratio((scores * present).sum(), present.sum())


def accuracy_from_confusion(cm: torch.Tensor) -> torch.Tensor:
    """Fraction of samples on the diagonal of a confusion matrix (0 for an empty matrix).

    Args:
        cm: A ``[C, C]`` count matrix, rows = true class, columns = predicted class.

    Returns:
        A 0-d float tensor.
    """
    _check_confusion(cm)
    return _ratio(cm.diagonal().sum(), cm.sum())


def precision_from_confusion(cm: torch.Tensor, average: str | None = None) -> torch.Tensor:
    """Precision tp / (tp + fp) of a confusion matrix, averaged as ``average`` says (see the module doc).

    Args:
        cm: A ``[C, C]`` count matrix, rows = true class, columns = predicted class.
        average: None (two classes: 'binary', more: 'micro'), 'binary', 'micro', 'macro' or 'weighted'.

    Returns:
        A 0-d float tensor.
    """
    per_class = lambda tp, fp, fn: _ratio(tp, tp + fp)
    return _averaged(cm, average, per_class)


def recall_from_confusion(cm: torch.Tensor, average: str | None = None) -> torch.Tensor:
    """Recall tp / (tp + fn) of a confusion matrix, averaged as ``average`` says (see the module doc).

    Args:
        cm: A ``[C, C]`` count matrix, rows = true class, columns = predicted class.
        average: None (two classes: 'binary', more: 'micro'), 'binary', 'micro', 'macro' or 'weighted'.

    Returns:
        A 0-d float tensor.
    """
    per_class = lambda tp, fp, fn: _ratio(tp, tp + fn)
    return _averaged(cm, average, per_class)


def fbeta_from_confusion(cm: torch.Tensor, beta: float, average: str | None = None) -> torch.Tensor:
    """F-beta score of a confusion matrix, averaged as ``average`` says (see the module doc).

    Args:
        cm: A ``[C, C]`` count matrix, rows = true class, columns = predicted class.
        beta: Weight of recall relative to precision (1 gives F1, 0 gives precision).
        average: None (two classes: 'binary', more: 'micro'), 'binary', 'micro', 'macro' or 'weighted'.

    Returns:
        A 0-d float tensor.
    """
    _check_beta(beta)
    per_class = lambda tp, fp, fn: _fbeta_counts(tp, fp, fn, beta)
    return _averaged(cm, average, per_class)


def f1_from_confusion(cm: torch.Tensor, average: str | None = None) -> torch.Tensor:
    """F1 score of a confusion matrix, averaged as ``average`` says (see the module doc).

    Args:
        cm: A ``[C, C]`` count matrix, rows = true class, columns = predicted class.
        average: None (two classes: 'binary', more: 'micro'), 'binary', 'micro', 'macro' or 'weighted'.

    Returns:
        A 0-d float tensor.
    """
    return fbeta_from_confusion(cm, 1.0, average)


def from_confusion(cm: torch.Tensor, name: str, average: str | None = None, beta: float = 1.0) -> torch.Tensor:
    """Compute the metric called ``name`` from a confusion matrix.

    Args:
        cm: A ``[C, C]`` count matrix, rows = true class, columns = predicted class.
        name: One of 'accuracy', 'precision', 'recall', 'f1', 'fbeta'.
        average: None (two classes: 'binary', more: 'micro'), 'binary', 'micro', 'macro' or 'weighted'
            (ignored by 'accuracy').
        beta: Used by 'fbeta' only.

    Returns:
        A 0-d float tensor.

    Raises:
        ConfigError: On an unknown name or average.
    """
    if name == "accuracy":
        return accuracy_from_confusion(cm)
    if name == "precision":
        return precision_from_confusion(cm, average)
    if name == "recall":
        return recall_from_confusion(cm, average)
    if name == "f1":
        return f1_from_confusion(cm, average)
    if name == "fbeta":
        return fbeta_from_confusion(cm, beta, average)
    raise ConfigError(f"name must be one of {_quoted(CONFUSION_METRICS)} (got {name!r})")
