"""Which patch each metric of a batch gets under `Trainer(metric_patch=...)`.

=================  ===================================================================================
`'auto'`           deepepochs' accuracy, precision, recall, f1 and confusion_matrix (also renamed):
(default)          a confusion matrix each (one matrix per batch, shared); other functions: every
                   prediction kept (`TensorPatch`, which warns once past `TENSOR_PATCH_WARN_BYTES`).
`'tensor'`         every function keeps every prediction (`TensorPatch`).
`'mean'`           every function averages its per-batch values (`MeanPatch`).
`'confusion'`      all functions from one confusion matrix (`ConfusionPatch`, key ``'confusion'``).
=================  ===================================================================================

Under every setting a metric object (a ``torchmetrics.Metric``) is streamed (`StreamPatch`): updated per
batch, computed at the task's end. Results equal the whole-data computation in every case but `'mean'`
for metrics that are not means over samples.
"""

from __future__ import annotations

import inspect

from deepepochs import metrics as _metrics
from deepepochs.confusion import ConfusionPatch
from deepepochs.patches import MeanPatch, TensorPatch
from deepepochs.streaming import StreamPatch, is_metric_object
from deepepochs.tasks import metric_name

__all__ = ["confusion_kind", "make_patches"]


def confusion_kind(metric) -> str | None:
    """The confusion-matrix metric ``metric`` is ('accuracy', ..., 'confusion_matrix'), or None: one of
    deepepochs' own functions with its default arguments, possibly renamed (`rename`, `functools.wraps`)."""
    base = inspect.unwrap(metric) if callable(metric) and not is_metric_object(metric) else None
    return next((kind for fn, kind in _metrics._CONFUSION_FUNCTIONS.items() if base is fn), None)


def make_patches(kind: str, metrics, preds, targets) -> dict:
    """`{name: patch}` of one batch for `metrics` under `metric_patch=kind`, in the order of `metrics`."""
    if kind == "confusion":
        functions = [m for m in metrics if not is_metric_object(m)]
        out = {"confusion": ConfusionPatch(preds, targets, metrics=functions)} if functions else {}
        out.update({metric_name(m): StreamPatch(m, preds, targets) for m in metrics if is_metric_object(m)})
        return out
    out, matrix = {}, None
    for m in metrics:
        if is_metric_object(m):
            patch = StreamPatch(m, preds, targets)
        elif kind == "mean":
            patch = MeanPatch(m, preds, targets)
        elif kind == "auto" and confusion_kind(m) is not None:
            patch = ConfusionPatch(metrics=(m,))
            if matrix is None:
                matrix = patch.load(preds, targets).state
            else:
                patch.state = matrix  # one matrix per batch, shared: a ConfusionPatch never writes into it
        else:
            patch = TensorPatch(m, preds, targets)
        out[metric_name(m)] = patch
    return out
