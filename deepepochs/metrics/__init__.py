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
  class indices may not show every class, or name the average you want. A trainer that used this default
  prints a note once per run: for two classes which class is scored, for more than two that the micro
  average equals the accuracy of single-label data and how to ask for ``'macro'``.
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

The package: :mod:`~deepepochs.metrics.functions` (the metrics above), :mod:`~deepepochs.metrics.counting`
(inputs to a confusion matrix), :mod:`~deepepochs.metrics.scores` (a matrix's scores and averages) and
:mod:`~deepepochs.metrics.matrix_metrics` (what a ConfusionPatch accepts). The names here are its public
surface.

Example:
    >>> import torch
    >>> from deepepochs.metrics import f1
    >>> preds = torch.tensor([[2.0, 0.1], [0.3, 1.5], [0.2, 0.9]])   # logits of 2 classes
    >>> f1(preds, torch.tensor([0, 1, 0]), average='binary')
    tensor(0.6667)
"""

# The underscored names are not the user API: deepepochs.patches.confusion and deepepochs.patches.selection import them.
from deepepochs.metrics.counting import _check_num_classes as _check_num_classes
from deepepochs.metrics.counting import confusion_matrix
from deepepochs.metrics.functions import accuracy, f1, fbeta, precision, recall
from deepepochs.metrics.matrix_metrics import _CONFUSION_FUNCTIONS as _CONFUSION_FUNCTIONS
from deepepochs.metrics.matrix_metrics import _CONFUSION_NAMES as _CONFUSION_NAMES
from deepepochs.metrics.matrix_metrics import DEFAULT_CONFUSION
from deepepochs.metrics.matrix_metrics import _confusion_specs as _confusion_specs
from deepepochs.metrics.scores import (
    AVERAGES,
    BINARY_DEFAULT_NOTE,
    CONFUSION_METRICS,
    DEFAULT_AVERAGE_NOTES,
    MICRO_DEFAULT_NOTE,
    accuracy_from_confusion,
    default_average,
    f1_from_confusion,
    fbeta_from_confusion,
    from_confusion,
    precision_from_confusion,
    recall_from_confusion,
    take_default_averages,
)
from deepepochs.metrics.scores import _check_average as _check_average
from deepepochs.metrics.scores import _check_beta as _check_beta

__all__ = [
    "AVERAGES",
    "CONFUSION_METRICS",
    "DEFAULT_CONFUSION",
    "BINARY_DEFAULT_NOTE",
    "DEFAULT_AVERAGE_NOTES",
    "MICRO_DEFAULT_NOTE",
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
    "take_default_averages",
]
