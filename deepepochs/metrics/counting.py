"""From ``(preds, targets)`` to a confusion matrix: the accepted input forms, read as class indices, counted.

The input forms (class indices, ``[N, C]`` scores, binary probabilities, one-hot targets) are described in
:mod:`deepepochs.metrics`. Counting runs on the inputs' device with ``index_add_``; the one host sync is
reading the largest class index when neither ``num_classes`` nor a shape gives the class count.
"""

from __future__ import annotations

import numbers

import torch

from deepepochs.errors import ConfigError

__all__ = ["_check_num_classes", "_class_indices", "confusion_matrix"]


def _check_num_classes(num_classes) -> None:
    if num_classes is None:
        return
    if isinstance(num_classes, bool) or not isinstance(num_classes, numbers.Integral) or num_classes < 1:
        raise ConfigError(
            f"num_classes must be None or a positive int (got {num_classes!r}); None infers it from the data"
        )


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
