"""The metrics a trainer's ``metrics=`` takes: ``accuracy``, ``precision``, ``recall``, ``fbeta``, ``f1`` of
``(preds, targets)``, or of a confusion matrix passed as ``conf_mat=`` (deepepochs 0.6's keyword).

Each counts a confusion matrix (:mod:`~deepepochs.metrics.counting`) and scores it
(:mod:`~deepepochs.metrics.scores`); ``accuracy`` compares class indices directly and never syncs.
"""

from __future__ import annotations

import torch

from deepepochs.errors import ConfigError
from deepepochs.metrics.counting import _class_indices, confusion_matrix
from deepepochs.metrics.scores import (
    _check_average,
    _check_beta,
    _check_confusion,
    accuracy_from_confusion,
    fbeta_from_confusion,
    precision_from_confusion,
    recall_from_confusion,
)

__all__ = ["accuracy", "f1", "fbeta", "precision", "recall"]


# The arguments the metrics share, described once: `_shares_arguments` writes them into each docstring in
# place of its `{inputs}` and `{options}` lines, so help() and the API pages show every argument.
_INPUTS = """preds: Class indices ``[N]``, scores ``[N, C]`` or binary probabilities ``[N]`` (see the module doc).
targets: Class indices ``[N]`` or one-hot labels ``[N, C]``."""
_OPTIONS = """average: None (the default, 0.6's: 'binary' for two classes, 'micro' for more), 'binary' (class 1),
    'micro', 'macro' or 'weighted'.
num_classes: The class count; None infers it (see :func:`confusion_matrix`).
threshold: The probability at or above which a 1-D float pred predicts class 1.
conf_mat: Instead of preds and targets, a ``[C, C]`` confusion matrix to score (0.6's keyword),
    e.g. ``f1(conf_mat=confusion_matrix(preds, targets, 10), average='macro')``."""


def _shares_arguments(fn):
    """Write :data:`_INPUTS` and :data:`_OPTIONS` into ``fn``'s docstring, indented as its Args section."""
    indent = "\n" + " " * 8
    fn.__doc__ = (fn.__doc__.replace("{inputs}", _INPUTS.replace("\n", indent))
                  .replace("{options}", _OPTIONS.replace("\n", indent)))
    return fn


def _given_matrix(preds, targets, conf_mat, name: str):
    """0.6's `conf_mat=` keyword: the matrix to score, or None when (preds, targets) are to be counted."""
    if conf_mat is None:
        if preds is None or targets is None:
            raise ConfigError(f"{name}() needs preds and targets, or a confusion matrix as conf_mat=")
        return None
    if preds is not None or targets is not None:
        raise ConfigError(f"{name}() takes either conf_mat= or (preds, targets), not both")
    _check_confusion(conf_mat)
    return conf_mat


def _matrix_to_score(name: str, preds, targets, conf_mat, num_classes, threshold, average) -> torch.Tensor:
    """The confusion matrix metric ``name`` scores: ``conf_mat`` as given, else counted from (preds, targets)
    (after ``average`` is checked, so a bad value fails before any counting)."""
    _check_average(average)
    cm = _given_matrix(preds, targets, conf_mat, name)
    return confusion_matrix(preds, targets, num_classes, threshold) if cm is None else cm


@_shares_arguments
def accuracy(preds=None, targets=None, threshold=0.5, *, conf_mat=None) -> torch.Tensor:
    """Fraction of samples whose predicted class equals the target class.

    Computed without a confusion matrix, so it never syncs with the host and ignores class counts.

    Args:
        {inputs}
        threshold: The probability at or above which a 1-D float pred predicts class 1.
        conf_mat: Instead of preds and targets, a ``[C, C]`` confusion matrix to score (0.6's keyword).

    Returns:
        A 0-d float tensor (0 for an empty input).

    Example:
        >>> accuracy(torch.tensor([[0.9, 0.1], [0.2, 0.8]]), torch.tensor([0, 0]))
        tensor(0.5000)
    """
    if _given_matrix(preds, targets, conf_mat, "accuracy") is not None:
        return accuracy_from_confusion(conf_mat)
    pred_idx, target_idx, _ = _class_indices(preds, targets, threshold)
    n = pred_idx.shape[0]
    if n == 0:
        return torch.zeros((), device=pred_idx.device)
    return (pred_idx == target_idx).sum().to(torch.get_default_dtype()) / n


@_shares_arguments
def precision(preds=None, targets=None, average=None, num_classes=None, threshold=0.5, *,
              conf_mat=None) -> torch.Tensor:
    """Precision tp / (tp + fp), scikit-learn's definition with ``zero_division=0``.

    Args:
        {inputs}
        {options}

    Returns:
        A 0-d float tensor.
    """
    cm = _matrix_to_score("precision", preds, targets, conf_mat, num_classes, threshold, average)
    return precision_from_confusion(cm, average)


@_shares_arguments
def recall(preds=None, targets=None, average=None, num_classes=None, threshold=0.5, *, conf_mat=None) -> torch.Tensor:
    """Recall tp / (tp + fn), scikit-learn's definition with ``zero_division=0``.

    Args:
        {inputs}
        {options}

    Returns:
        A 0-d float tensor.
    """
    cm = _matrix_to_score("recall", preds, targets, conf_mat, num_classes, threshold, average)
    return recall_from_confusion(cm, average)


@_shares_arguments
def fbeta(preds=None, targets=None, beta=1.0, average=None, num_classes=None, threshold=0.5, *,
          conf_mat=None) -> torch.Tensor:
    """F-beta score (1 + b²)·tp / ((1 + b²)·tp + b²·fn + fp), as scikit-learn with ``zero_division=0``.

    Args:
        {inputs}
        beta: Weight of recall relative to precision (>= 0; 1 gives F1).
        {options}

    Returns:
        A 0-d float tensor.
    """
    _check_beta(beta)
    cm = _matrix_to_score("fbeta", preds, targets, conf_mat, num_classes, threshold, average)
    return fbeta_from_confusion(cm, beta, average)


@_shares_arguments
def f1(preds=None, targets=None, average=None, num_classes=None, threshold=0.5, *, conf_mat=None) -> torch.Tensor:
    """F1 score, the harmonic mean of precision and recall (:func:`fbeta` with ``beta=1``).

    Args:
        {inputs}
        {options}

    Returns:
        A 0-d float tensor.
    """
    _given_matrix(preds, targets, conf_mat, "f1")  # so a mistake names f1, not fbeta
    return fbeta(preds, targets, 1.0, average, num_classes, threshold, conf_mat=conf_mat)
