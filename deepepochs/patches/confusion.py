"""Confusion-matrix patches: exact dataset-level classification metrics in constant memory.

:class:`ConfusionPatch` accumulates a confusion matrix batch by batch (merging across processes like every
patch, see :mod:`deepepochs.patches`) and computes accuracy, precision, recall and F1 from it;
:class:`ConfusionMetrics` makes such patches of one configuration for custom step methods.
"""

from __future__ import annotations

import copy

import attrs
import torch
import torch.distributed as dist

from deepepochs import metrics as _metrics
from deepepochs.errors import ConfigError
from deepepochs.patches import PatchBase, _collective_device, _world_size

__all__ = ["ConfusionMetrics", "ConfusionPatch", "ConfusionState"]


def _check_matrix(instance, attribute, value) -> None:
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.shape[0] != value.shape[1]:
        raise TypeError(f"{attribute.name} must be a square [C, C] tensor (got {value!r:.60})")


@attrs.define
class ConfusionState:
    """What a :class:`ConfusionPatch` holds: an int64 ``[C, C]`` matrix, rows = true, columns = predicted."""

    matrix: torch.Tensor = attrs.field(
        factory=lambda: torch.zeros(0, 0, dtype=torch.int64), validator=_check_matrix
    )


_DEFAULT_METRICS = _metrics.DEFAULT_CONFUSION


def _pad_to(matrix: torch.Tensor, size: int) -> torch.Tensor:
    extra = size - matrix.shape[0]
    return torch.nn.functional.pad(matrix, (0, extra, 0, extra)) if extra else matrix


class ConfusionPatch(PatchBase):
    """Accumulates a confusion matrix; computes several classification metrics of the whole dataset from it.

    Constant memory and exact dataset-level accuracy, precision, recall and F1 (scikit-learn's definitions,
    see :mod:`deepepochs.metrics`). Matrices of different sizes (a batch lacking the highest classes) merge
    by zero-padding the smaller one.

    Args:
        batch_preds: One batch of predictions (class indices, ``[N, C]`` scores or binary probabilities).
            None with ``batch_targets`` also None makes an empty patch.
        batch_targets: The batch's class indices or one-hot labels.
        metrics: Names among 'accuracy', 'precision', 'recall', 'f1', 'confusion_matrix' (the ``[C, C]``
            matrix itself, not a scalar), or the functions of those names from :mod:`deepepochs.metrics`
            (result key: the function's ``__name__``).
        average: None (the default of :mod:`deepepochs.metrics`: 'binary' for two classes, else 'micro'),
            'binary', 'micro', 'macro' or 'weighted'.
        num_classes: The class count, or None to infer it (from class-index preds and targets this costs
            one host sync per batch; see :func:`deepepochs.metrics.confusion_matrix`).
        name: An optional prefix for the keys of a dict result (as in 0.6: `name='C.'` shows `C.accuracy`).
        threshold: The probability at or above which a 1-D float pred predicts class 1.

    Example:
        >>> p = ConfusionPatch(torch.tensor([0, 1]), torch.tensor([0, 1]), metrics=('accuracy', 'f1'))
        >>> p = p + ConfusionPatch(torch.tensor([2]), torch.tensor([1]), metrics=('accuracy', 'f1'))
        >>> {key: round(float(value), 4) for key, value in p().items()}
        {'accuracy': 0.6667, 'f1': 0.6667}
    """

    def __init__(self, batch_preds=None, batch_targets=None, metrics=_DEFAULT_METRICS, average=None,
                 num_classes=None, name=None, threshold=0.5):  # fmt: skip
        self.matrix_fn = None
        if callable(batch_preds) and not isinstance(batch_preds, torch.Tensor):
            # deepepochs 0.6.18: ConfusionPatch(metric, batch_size=None, name=None), then .load(preds,
            # targets); metric(cm) is the result as it is (the count is not needed and is ignored).
            self.matrix_fn = batch_preds
            if isinstance(metrics, str) and name is None and metrics not in _metrics._CONFUSION_NAMES:
                name = metrics
            batch_preds = batch_targets = None
            metrics = _DEFAULT_METRICS
        super().__init__(name)
        self.metrics = _metrics._confusion_specs(metrics)
        _metrics._check_average(average)
        _metrics._check_num_classes(num_classes)
        self.average, self.num_classes, self.threshold = average, num_classes, threshold
        self.beta = 1.0  # for 'fbeta' (0.6.18's ConfusionMetrics(beta=...))
        self.state = ConfusionState()
        if batch_preds is not None or batch_targets is not None:
            self.load(batch_preds, batch_targets)

    def load(self, batch_preds, batch_targets) -> ConfusionPatch:
        """Replace the state with the confusion matrix of one batch; return self."""
        matrix = _metrics.confusion_matrix(batch_preds, batch_targets, self.num_classes, self.threshold)
        self.state = ConfusionState(matrix)
        return self

    def add(self, other: ConfusionPatch) -> ConfusionPatch:
        """Add the matrix of ``other`` to that of self, padding the smaller one; return self."""
        self._check_same_kind(other)
        mine, theirs = self.state.matrix, other.state.matrix
        # An empty matrix lives on the CPU: follow the other operand, so sums stay where the data is.
        device = mine.device if mine.shape[0] else theirs.device
        size = max(mine.shape[0], theirs.shape[0])
        self.state = ConfusionState(_pad_to(mine.to(device), size) + _pad_to(theirs.to(device), size))
        return self

    def copy(self) -> ConfusionPatch:
        """A copy with its own state record; the matrix is shared, as :meth:`add` never writes into it."""
        new = copy.copy(self)
        new.state = attrs.evolve(self.state)
        return new

    def forward(self) -> dict:
        """A dict of each requested metric, computed from the accumulated matrix."""
        cm = self.state.matrix
        if self.matrix_fn is not None:  # 0.6.18's ConfusionPatch(metric): the metric's value as it is
            return self.matrix_fn(cm.clone())

        def compute(kind):
            if callable(kind):  # a user's function of the matrix (0.6's metric_patch='confusion' metrics)
                return kind(cm.clone())
            if kind == "confusion_matrix":
                return cm.clone()
            return _metrics.from_confusion(cm, kind, self.average, self.beta)

        return {key: compute(kind) for key, kind in self.metrics}

    def sync(self) -> ConfusionPatch:
        """Sum the matrices of all ranks with ``all_reduce`` (see :meth:`PatchBase.sync`).

        Ranks may hold matrices of different sizes, so the largest size is agreed first (one host read of
        one integer), then the padded matrices are summed. The sum is made in a new tensor: the metrics of
        one batch share its matrix (and :meth:`copy` shares it too), so a sum written into it would be
        counted again by each later metric's sync.
        """
        if _world_size() == 1:
            return self
        matrix, device = self.state.matrix, _collective_device()
        size = torch.tensor([matrix.shape[0]], dtype=torch.int64, device=device)
        dist.all_reduce(size, op=dist.ReduceOp.MAX)
        buffer = _pad_to(matrix, int(size)).to(device, copy=True)  # never all_reduce into a shared matrix
        dist.all_reduce(buffer)
        self.state = ConfusionState(buffer.to(matrix.device))
        return self

    def __repr__(self) -> str:
        keys = [key for key, _ in self.metrics]
        return f"ConfusionPatch({keys}, average={self.average!r}, classes={self.state.matrix.shape[0]})"


class ConfusionMetrics:
    """Makes :class:`ConfusionPatch` objects of one configuration, for custom step methods.

    One confusion matrix per batch gives several metrics. A step returns the patch under one key; the
    metric names shown are the dict's keys (the patches it makes have the empty prefix ``name=''`` unless
    ``name`` is given). Arguments are those of :class:`ConfusionPatch`, validated here once.

    The positional order is 0.6.18's, ``(metrics, average, beta, name)``; ``num_classes`` and ``threshold``
    are keywords. deepepochs 0.6.18's spelling works too: ``ConfusionMetrics(metrics, average, beta=1.0,
    name='C.').load(preds, targets)`` gives 0.6.18's short keys ('acc', 'p', 'r', 'f1', 'fb' for
    'accuracy', 'precision', 'recall', 'f1', 'fbeta'), all five by default, behind the prefix 'C.'.

    Example:
        In a trainer subclass::

            class MyTrainer(Trainer):
                cm = ConfusionMetrics(('accuracy', 'precision', 'recall', 'f1'), average='macro')

                def train_step(self, batch_x, batch_y, **step_args):
                    preds = self.model(batch_x)
                    self.loss(preds, batch_y)
                    return {'cm': self.cm(preds, batch_y)}   # shown as accuracy, precision, recall, f1

        >>> cm = ConfusionMetrics(('precision', 'recall'), average='micro')
        >>> patch = cm(torch.tensor([0, 1, 1]), torch.tensor([0, 1, 0]))
        >>> {key: round(float(value), 4) for key, value in patch().items()}
        {'precision': 0.6667, 'recall': 0.6667}
    """

    SHORT_NAMES = {"accuracy": "acc", "precision": "p", "recall": "r", "f1": "f1", "fbeta": "fb"}
    """0.6.18's keys for the metrics of :meth:`load`."""

    def __init__(self, metrics=None, average=None, beta=1.0, name=None, *, num_classes=None, threshold=0.5):
        given = _DEFAULT_METRICS if metrics is None else metrics
        if isinstance(given, str):
            given = (given,)
        if not (isinstance(given, (list, tuple)) and "fbeta" in given):
            ConfusionPatch(metrics=given, average=average, num_classes=num_classes)  # validates, loads nothing
        else:
            self._short_specs(given)
        _metrics._check_beta(beta)
        if name is not None and not isinstance(name, str):
            raise ConfigError(f"name must be a string prefix of the metric names, or None (got {name!r})")
        self.metrics, self.average, self.beta, self.name = metrics, average, beta, name
        self.num_classes, self.threshold = num_classes, threshold

    def __call__(self, preds, targets) -> ConfusionPatch:
        """A :class:`ConfusionPatch` loaded with one batch."""
        metrics = _DEFAULT_METRICS if self.metrics is None else self.metrics
        fbeta = isinstance(metrics, (list, tuple)) and "fbeta" in metrics
        patch = ConfusionPatch(None, None, "accuracy" if fbeta else metrics, self.average, self.num_classes,
                               "" if self.name is None else self.name, self.threshold)
        specs = None
        if fbeta:  # 'fbeta' is not a ConfusionPatch name: give the patch its specs directly, long keys
            specs = tuple((long, long) for _, long in self._short_specs(metrics))
        return self._configured(patch, specs).load(preds, targets)

    def load(self, preds, targets) -> ConfusionPatch:
        """deepepochs 0.6.18's ``ConfusionMetrics(...).load(preds, targets)``: a patch of one batch whose
        keys are 0.6.18's short names behind the prefix ``name`` (default 'C.')."""
        metrics = tuple(self.SHORT_NAMES) if self.metrics is None else self.metrics
        patch = ConfusionPatch(None, None, "accuracy", self.average, self.num_classes,
                               "C." if self.name is None else self.name, self.threshold)
        return self._configured(patch, self._short_specs(metrics)).load(preds, targets)

    def _configured(self, patch: ConfusionPatch, specs) -> ConfusionPatch:
        patch.beta = self.beta
        if specs is not None:
            patch.metrics = specs
        return patch

    @classmethod
    def _short_specs(cls, metrics) -> tuple:
        metrics = (metrics,) if isinstance(metrics, str) else tuple(metrics)
        unknown = [m for m in metrics if m not in cls.SHORT_NAMES]
        if unknown or not metrics:
            raise ConfigError(f"metrics must be among {list(cls.SHORT_NAMES)} (got {list(metrics)})")
        return tuple((cls.SHORT_NAMES[m], m) for m in metrics)
