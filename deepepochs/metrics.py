"""Classification metrics on tensors, all computed through one confusion matrix.

Every metric takes ``(preds, targets)``, the signature a trainer's ``metrics=`` expects, and returns a 0-d
float tensor on the inputs' device. The definitions are scikit-learn's with ``zero_division=0``: a ratio whose
denominator is zero (a class never predicted, a class with no true sample, an empty input) counts as 0.

Accepted inputs (N samples, C classes):

* ``preds``: class indices (an integer or bool tensor of shape ``[N]`` or ``[N, 1]``); scores, logits or
  probabilities of shape ``[N, C]`` with ``C >= 2`` (the predicted class is the argmax over dim 1); or a float
  tensor of shape ``[N]`` or ``[N, 1]`` holding the *probability* of class 1 in a binary problem: class 1 is
  predicted when it is ``>= threshold`` (0.5 by default; pass ``threshold=0.0`` for raw logits).
* ``targets``: class indices of shape ``[N]`` or ``[N, 1]`` (float labels such as ``1.0`` are rounded), or
  one-hot / soft labels of shape ``[N, C]`` (argmax over dim 1). Targets are always labels, never thresholded.

``average`` selects how per-class scores become one number, as in scikit-learn:

* ``None`` (the default), deepepochs 0.6's default: ``'micro'`` for more than two classes (0.6 documented
  ``average='micro'``), and ``'binary'`` for two classes, scoring class 1 as scikit-learn's default does
  (0.6 scored class 0 of a two-class matrix, and halved it under 'macro': that was wrong and is not kept).
  The class count is the confusion matrix's size: pass ``num_classes`` or ``[N, C]`` scores when a batch of
  class indices may not show every class, or name the average you want.
* ``'macro'``: the unweighted mean over the classes that occur in targets or preds. As in
  scikit-learn, a class that is neither true nor predicted anywhere is left out, so the value does not depend
  on ``num_classes`` or on how a confusion matrix was padded.
* ``'binary'``: the score of the positive class 1 (scikit-learn's default; two classes at most).
* ``'micro'``: computed from the total true/false positives and negatives; for single-label data this equals
  accuracy.
* ``'weighted'``: the mean of the per-class scores weighted by each class's number of true samples.

Host-device syncs: the matrix is filled with ``index_add_`` on the inputs' device, with no Python loop over
samples. The only host sync is reading the largest class index when the class count cannot be known from
shapes, i.e. when ``num_classes`` is None and both preds and targets are class indices. Pass ``num_classes``
(or ``[N, C]`` scores) to avoid it.

Example:
    >>> import torch
    >>> from deepepochs.metrics import f1
    >>> preds = torch.tensor([[2.0, 0.1], [0.3, 1.5], [0.2, 0.9]])   # logits of 2 classes
    >>> f1(preds, torch.tensor([0, 1, 0]), average='binary')
    tensor(0.6667)
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers

import torch

from deepepochs.errors import ConfigError

__all__ = [
    "AVERAGES",
    "CONFUSION_METRICS",
    "DEFAULT_CONFUSION",
    "BINARY_DEFAULT_NOTE",
    "default_average",
    "accuracy",
    "accuracy_from_confusion",
    "confusion_matrix",
    "f1",
    "f1_from_confusion",
    "fbeta",
    "fbeta_from_confusion",
    "from_confusion",
    "precision",
    "precision_from_confusion",
    "recall",
    "recall_from_confusion",
    "take_binary_default",
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


# Set when average=None scored class 1 of a two-class matrix; the trainer reads it (take_binary_default) after
# computing a task's metrics and tells the user once, since deepepochs 0.6 scored class 0 there.
_binary_default = [False]

BINARY_DEFAULT_NOTE = (
    "Note: precision, recall and F1 of a two-class problem score class 1, the positive class, as"
    " scikit-learn does (deepepochs 0.6 scored class 0). To choose, pass average='macro' (the mean over both"
    " classes) or average='micro' (equal to the accuracy) to the metric, e.g. rename(functools.partial(f1,"
    " average='macro'), 'f1'); for class 0's score swap the labels (1 - targets, and the score columns)."
)


def take_binary_default() -> bool:
    """Whether a default average scored class 1 of a two-class matrix since the last call (then reset)."""
    seen, _binary_default[0] = _binary_default[0], False
    return seen


def _check_num_classes(num_classes) -> None:
    if num_classes is None:
        return
    if isinstance(num_classes, bool) or not isinstance(num_classes, numbers.Integral) or num_classes < 1:
        raise ConfigError(
            f"num_classes must be None or a positive int (got {num_classes!r}); None infers it from the data"
        )


def _check_beta(beta) -> None:
    if isinstance(beta, bool) or not isinstance(beta, numbers.Real) or not math.isfinite(beta) or beta < 0:
        raise ConfigError(f"beta must be a finite number >= 0 (got {beta!r}); beta=1 gives F1")


def _check_confusion(cm) -> None:
    if not isinstance(cm, torch.Tensor) or cm.dim() != 2 or cm.shape[0] != cm.shape[1]:
        got = list(cm.shape) if isinstance(cm, torch.Tensor) else type(cm).__name__
        raise ConfigError(f"cm must be a square [C, C] tensor of counts (got {got})")


def _targets_to_indices(targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Class indices of the targets and the class count their shape implies (0 when it implies none)."""
    if targets.dim() == 2 and targets.shape[1] == 1:
        targets = targets[:, 0]
    if targets.dim() == 2:
        return targets.float().argmax(dim=1), targets.shape[1]
    if targets.dim() != 1:
        raise ConfigError(f"targets must have shape [N], [N, 1] or [N, C] (got {list(targets.shape)})")
    if targets.is_floating_point():
        targets = targets.round()
    return targets.long(), 0


def _preds_to_indices(preds: torch.Tensor, threshold: float) -> tuple[torch.Tensor, int]:
    """Predicted class indices and the class count the preds' shape implies (0 when it implies none)."""
    if preds.dim() == 2 and preds.shape[1] == 1:
        preds = preds[:, 0]
    if preds.dim() == 2:
        # argmax is not implemented for bool; an integer [N, C] input is taken as scores too.
        return preds.float().argmax(dim=1), preds.shape[1]
    if preds.dim() != 1:
        raise ConfigError(f"preds must have shape [N], [N, 1] or [N, C] (got {list(preds.shape)})")
    if preds.is_floating_point():
        return (preds >= threshold).long(), 2
    return preds.long(), 0


def _class_indices(preds, targets, threshold) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Turn any accepted (preds, targets) pair into two [N] int64 index tensors and a shape-implied C."""
    if not isinstance(preds, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise ConfigError(
            f"preds and targets must be tensors (got {type(preds).__name__} and {type(targets).__name__})"
        )
    pred_idx, pred_classes = _preds_to_indices(preds.detach(), threshold)
    target_idx, target_classes = _targets_to_indices(targets.detach())
    if pred_idx.shape[0] != target_idx.shape[0]:
        raise ConfigError(
            "preds and targets must hold the same number of samples "
            f"(got {pred_idx.shape[0]} and {target_idx.shape[0]})"
        )
    # A no-op when both are already on the same device, which is the normal case.
    return pred_idx, target_idx.to(pred_idx.device), max(pred_classes, target_classes)


def _count_confusion(pred_idx, target_idx, num_classes, shape_classes) -> torch.Tensor:
    c = num_classes if num_classes is not None else shape_classes
    if not c and pred_idx.numel():
        # The one host sync of this module: only the data can tell how many classes there are.
        low, high = (int(v) for v in torch.aminmax(torch.cat([pred_idx, target_idx])))
        if low < 0:
            raise ConfigError(f"class indices must be >= 0 (got {low})")
        c = high + 1
    valid = (pred_idx >= 0) & (pred_idx < c) & (target_idx >= 0) & (target_idx < c)
    if pred_idx.device.type == "cpu" and not bool(valid.all()):
        # On the CPU this check costs no device sync, so bad labels fail loudly; on other devices
        # out-of-range samples are dropped below rather than forcing a sync on every batch.
        low, high = (int(v) for v in torch.aminmax(torch.cat([pred_idx, target_idx])))
        raise ConfigError(
            f"class indices must lie in [0, {c - 1}] for {c} classes "
            f"(got values in [{low}, {high}]); pass a larger num_classes or fix the labels"
        )
    # Row = true class, column = predicted class; invalid samples land in a spare last bin that is cut off.
    flat = torch.where(valid, target_idx * c + pred_idx, c * c)
    counts = torch.zeros(c * c + 1, dtype=torch.int64, device=pred_idx.device)
    # index_add_ instead of bincount: bincount sizes its output from the data's maximum, a host sync on CUDA,
    # and index_add_ is deterministic on CUDA.
    counts.index_add_(0, flat, torch.ones_like(flat))
    return counts[: c * c].view(c, c)


def confusion_matrix(preds, targets, num_classes=None, threshold=0.5) -> torch.Tensor:
    """Count samples by (true class, predicted class).

    Args:
        preds: Class indices ``[N]``, scores ``[N, C]`` or binary probabilities ``[N]`` (see the module doc).
        targets: Class indices ``[N]`` or one-hot labels ``[N, C]``.
        num_classes: The class count C. None infers it from the shapes of ``[N, C]`` inputs, else from the
            largest class index (a host-device sync). When C is given or comes from shapes, indices outside
            ``[0, C)`` raise ConfigError on the CPU and are not counted on other devices, where checking
            would cost a sync per batch.
        threshold: The probability at or above which a 1-D float pred predicts class 1.

    Returns:
        An int64 tensor of shape ``[C, C]`` on the preds' device; ``cm[i, j]`` counts samples of true class
        ``i`` predicted as class ``j``.

    Raises:
        ConfigError: On unsupported shapes, a sample-count mismatch or a bad ``num_classes``.

    Example:
        >>> confusion_matrix(torch.tensor([0, 1, 1]), torch.tensor([0, 0, 1]))
        tensor([[1, 1],
                [0, 1]])
    """
    _check_num_classes(num_classes)
    pred_idx, target_idx, shape_classes = _class_indices(preds, targets, threshold)
    return _count_confusion(pred_idx, target_idx, num_classes, shape_classes)


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
        if cm.shape[0] == 2:
            _binary_default[0] = True
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


def accuracy(preds=None, targets=None, threshold=0.5, *, conf_mat=None) -> torch.Tensor:
    """Fraction of samples whose predicted class equals the target class.

    Computed without a confusion matrix, so it never syncs with the host and ignores class counts.

    Args:
        preds: Class indices ``[N]``, scores ``[N, C]`` or binary probabilities ``[N]`` (see the module doc).
        targets: Class indices ``[N]`` or one-hot labels ``[N, C]``.
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


def precision(preds=None, targets=None, average=None, num_classes=None, threshold=0.5, *,
              conf_mat=None) -> torch.Tensor:
    """Precision tp / (tp + fp), scikit-learn's definition with ``zero_division=0``.

    Args:
        preds: Class indices ``[N]``, scores ``[N, C]`` or binary probabilities ``[N]`` (see the module doc).
        targets: Class indices ``[N]`` or one-hot labels ``[N, C]``.
        average: None (the default, 0.6's: 'binary' for two classes, 'micro' for more), 'binary' (class 1),
            'micro', 'macro' or 'weighted'.
        num_classes: The class count; None infers it (see :func:`confusion_matrix`).
        threshold: The probability at or above which a 1-D float pred predicts class 1.
        conf_mat: Instead of preds and targets, a ``[C, C]`` confusion matrix to score (0.6's keyword),
            e.g. ``f1(conf_mat=confusion_matrix(preds, targets, 10), average='macro')``.

    Returns:
        A 0-d float tensor.
    """
    _check_average(average)
    cm = _given_matrix(preds, targets, conf_mat, "precision")
    if cm is None:
        cm = confusion_matrix(preds, targets, num_classes, threshold)
    return precision_from_confusion(cm, average)


def recall(preds=None, targets=None, average=None, num_classes=None, threshold=0.5, *, conf_mat=None) -> torch.Tensor:
    """Recall tp / (tp + fn), scikit-learn's definition with ``zero_division=0``.

    Args:
        preds: Class indices ``[N]``, scores ``[N, C]`` or binary probabilities ``[N]`` (see the module doc).
        targets: Class indices ``[N]`` or one-hot labels ``[N, C]``.
        average: None (the default, 0.6's: 'binary' for two classes, 'micro' for more), 'binary' (class 1),
            'micro', 'macro' or 'weighted'.
        num_classes: The class count; None infers it (see :func:`confusion_matrix`).
        threshold: The probability at or above which a 1-D float pred predicts class 1.
        conf_mat: Instead of preds and targets, a ``[C, C]`` confusion matrix to score (0.6's keyword),
            e.g. ``f1(conf_mat=confusion_matrix(preds, targets, 10), average='macro')``.

    Returns:
        A 0-d float tensor.
    """
    _check_average(average)
    cm = _given_matrix(preds, targets, conf_mat, "recall")
    if cm is None:
        cm = confusion_matrix(preds, targets, num_classes, threshold)
    return recall_from_confusion(cm, average)


def fbeta(preds=None, targets=None, beta=1.0, average=None, num_classes=None, threshold=0.5, *,
          conf_mat=None) -> torch.Tensor:
    """F-beta score (1 + b²)·tp / ((1 + b²)·tp + b²·fn + fp), as scikit-learn with ``zero_division=0``.

    Args:
        preds: Class indices ``[N]``, scores ``[N, C]`` or binary probabilities ``[N]`` (see the module doc).
        targets: Class indices ``[N]`` or one-hot labels ``[N, C]``.
        beta: Weight of recall relative to precision (>= 0; 1 gives F1).
        average: None (the default, 0.6's: 'binary' for two classes, 'micro' for more), 'binary' (class 1),
            'micro', 'macro' or 'weighted'.
        num_classes: The class count; None infers it (see :func:`confusion_matrix`).
        threshold: The probability at or above which a 1-D float pred predicts class 1.
        conf_mat: Instead of preds and targets, a ``[C, C]`` confusion matrix to score (0.6's keyword),
            e.g. ``f1(conf_mat=confusion_matrix(preds, targets, 10), average='macro')``.

    Returns:
        A 0-d float tensor.
    """
    _check_beta(beta)
    _check_average(average)
    cm = _given_matrix(preds, targets, conf_mat, "fbeta")
    if cm is None:
        cm = confusion_matrix(preds, targets, num_classes, threshold)
    return fbeta_from_confusion(cm, beta, average)


def f1(preds=None, targets=None, average=None, num_classes=None, threshold=0.5, *, conf_mat=None) -> torch.Tensor:
    """F1 score, the harmonic mean of precision and recall (:func:`fbeta` with ``beta=1``).

    Args:
        preds: Class indices ``[N]``, scores ``[N, C]`` or binary probabilities ``[N]`` (see the module doc).
        targets: Class indices ``[N]`` or one-hot labels ``[N, C]``.
        average: None (the default, 0.6's: 'binary' for two classes, 'micro' for more), 'binary' (class 1),
            'micro', 'macro' or 'weighted'.
        num_classes: The class count; None infers it (see :func:`confusion_matrix`).
        threshold: The probability at or above which a 1-D float pred predicts class 1.
        conf_mat: Instead of preds and targets, a ``[C, C]`` confusion matrix to score (0.6's keyword),
            e.g. ``f1(conf_mat=confusion_matrix(preds, targets, 10), average='macro')``.

    Returns:
        A 0-d float tensor.
    """
    _given_matrix(preds, targets, conf_mat, "f1")  # so a mistake names f1, not fbeta
    return fbeta(preds, targets, 1.0, average, num_classes, threshold, conf_mat=conf_mat)


DEFAULT_CONFUSION = ("accuracy", "precision", "recall", "f1")
"""The metrics a ConfusionPatch computes by default."""

_CONFUSION_NAMES = ("accuracy", "precision", "recall", "f1", "confusion_matrix")
_CONFUSION_FUNCTIONS = {
    accuracy: "accuracy",
    precision: "precision",
    recall: "recall",
    f1: "f1",
    confusion_matrix: "confusion_matrix",
}


def _confusion_specs(metrics) -> tuple[tuple[str, object], ...]:
    """Normalise ``metrics=`` into (result key, metric kind) pairs, validating every entry. The kind is a
    name of :data:`_CONFUSION_NAMES`, or a user's function of the confusion matrix (called as ``fn(cm)``)."""
    items = (metrics,) if isinstance(metrics, str) or callable(metrics) else tuple(metrics)
    names = ", ".join(repr(name) for name in _CONFUSION_NAMES)
    if not items:
        raise ConfigError(f"metrics must name at least one of {names} (got an empty sequence)")
    specs = []
    for item in items:
        if isinstance(item, str) and item in _CONFUSION_NAMES:
            specs.append((item, item))
        elif isinstance(item, str) or not callable(item):
            raise ConfigError(
                f"metrics of a ConfusionPatch must be among {names} (got {item!r}); "
                "the deepepochs.metrics functions of those names work too"
            )
        else:
            # unwrap follows __wrapped__, so a renamed wrapper made with functools.wraps is recognised.
            base = inspect.unwrap(item)
            kind = next((k for fn, k in _CONFUSION_FUNCTIONS.items() if base is fn), None)
            name = getattr(item, "__name__", None) or type(item).__name__
            if kind is None:
                # deepepochs 0.6's pattern: any other function takes the confusion matrix itself, fn(cm).
                # A partial of one of this module's functions still wants (preds, targets): refused.
                inner = inspect.unwrap(item.func) if isinstance(item, functools.partial) else None
                try:
                    inspect.signature(item).bind(None)
                    takes_matrix = getattr(inner, "__module__", None) != __name__
                except (TypeError, ValueError):
                    takes_matrix = False
                if not takes_matrix:
                    raise ConfigError(
                        "metric_patch='confusion' supports only the deepepochs.metrics functions accuracy, "
                        "precision, recall, f1 and confusion_matrix, and functions of one confusion matrix "
                        f"fn(cm) -> value (got {name!r}); use metric_patch='tensor' for other metrics"
                    )
                kind = item
            specs.append((name, kind))
    keys = [key for key, _ in specs]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"metrics of a ConfusionPatch must have distinct names (got {keys})")
    return tuple(specs)
