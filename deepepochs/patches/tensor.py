""":class:`TensorPatch`: every batch's predictions and targets kept, the metric computed once on all of them.

Right for any metric; its memory grows with the data, so it warns once per metric name past
:data:`TENSOR_PATCH_WARN_BYTES`.
"""

from __future__ import annotations

import copy
import warnings

import attrs
import torch

from deepepochs.errors import DeepEpochsWarning
from deepepochs.patches.base import PatchBase, _check_metric, _is_count, _metric_name
from deepepochs.patches.nests import _concat, _is_catable, _map_tensors, _nbytes

__all__ = ["TENSOR_PATCH_WARN_BYTES", "TensorPatch", "TensorState"]


@attrs.define
class TensorState:
    """What a :class:`TensorPatch` holds: each loaded batch's detached preds and targets, in load order, and
    the bytes their tensors take (``nbytes``, read from shapes: no sync)."""

    preds: list = attrs.field(factory=list, validator=attrs.validators.instance_of(list))
    targets: list = attrs.field(factory=list, validator=attrs.validators.instance_of(list))
    nbytes: int = attrs.field(default=0, validator=attrs.validators.instance_of(int))


TENSOR_PATCH_WARN_BYTES = 1 << 30
"""Stored predictions and targets (bytes, one patch, one process) past which a :class:`TensorPatch` warns,
once per metric name and process, that its memory grows with the data (1 GiB)."""

_warned_growth: set = set()


class TensorPatch(PatchBase):
    """Keeps every batch's predictions and targets; computes the metric once, on all of them.

    Right for any metric. Memory grows with the dataset: the patch holds every loaded prediction and
    target (detached, on their device) until dropped, and :meth:`sync` (the generic one) copies every
    rank's data to every rank. Prefer :class:`ConfusionPatch` or :class:`MeanPatch` when the metric allows.

    Loading stores references only (no copy, no sync). :meth:`forward` concatenates the batches, leaf-wise
    along dim 0 for nested tuples, lists or dicts of tensors, and keeps the result instead of the pieces.

    Args:
        metric: A callable ``metric(all_preds, all_targets)`` returning a value or a dict of values.
        batch_preds: One batch of predictions, a tensor or a nest of tensors.
        batch_targets: The batch's targets (None when the metric needs none; None with ``batch_preds``
            also None makes an empty patch).
        name: An optional prefix for the keys of a dict result (as in 0.6: `name='C.'` shows `C.accuracy`).

    deepepochs 0.6.18's spelling works too: ``TensorPatch(metric, batch_size, name).load(preds, targets)``
    (the sample count is not needed here and is ignored).

    Example:
        >>> from deepepochs.metrics import f1
        >>> patch = TensorPatch(f1, torch.tensor([0, 1]), torch.tensor([0, 1]))
        >>> (patch + TensorPatch(f1, torch.tensor([1]), torch.tensor([0])))()
        tensor(0.6667)
    """

    def __init__(self, metric, batch_preds=None, batch_targets=None, name=None):
        if _is_count(batch_preds) and (batch_targets is None or isinstance(batch_targets, str)):
            # deepepochs 0.6.18: TensorPatch(metric, batch_size=None, name=None), then .load(preds, targets)
            name = batch_targets if name is None else name
            batch_preds = batch_targets = None
        super().__init__(name)
        _check_metric(metric)
        self.metric = metric
        self.state = TensorState()
        if batch_preds is not None or batch_targets is not None:
            self.load(batch_preds, batch_targets)

    def load(self, batch_preds, batch_targets=None) -> TensorPatch:
        """Replace the state with one batch's preds and targets (detached, not copied); return self."""
        preds = _map_tensors(torch.Tensor.detach, batch_preds)
        targets = _map_tensors(torch.Tensor.detach, batch_targets)
        self.state = TensorState([preds], [targets], _nbytes(preds) + _nbytes(targets))
        return self

    def add(self, other: TensorPatch) -> TensorPatch:
        """Append the batches of ``other`` after those of self; return self.

        Warns once per metric name (a :class:`~deepepochs.errors.DeepEpochsWarning`) when the stored
        tensors pass :data:`TENSOR_PATCH_WARN_BYTES`."""
        self._check_same_kind(other)
        state = self.state
        state.preds.extend(other.state.preds)
        state.targets.extend(other.state.targets)
        before, state.nbytes = state.nbytes, state.nbytes + other.state.nbytes
        if before <= TENSOR_PATCH_WARN_BYTES < state.nbytes:
            self._warn_growth()
        return self

    def _warn_growth(self) -> None:
        name = _metric_name(self.metric)
        if name in _warned_growth:
            return
        _warned_growth.add(name)
        warnings.warn(
            f"metric {name!r} keeps every prediction and target of the task to compute its value at the end;"
            f" they now take {self.state.nbytes / 2**30:.1f} GiB in this process and grow with the data. To"
            " bound the memory: pass a torchmetrics metric object instead of a function (it is updated per"
            " batch and keeps only its own state), use metric_patch='mean' (exact for means over samples such"
            " as accuracy), or compute it from a confusion matrix (metric_patch='confusion')",
            DeepEpochsWarning, stacklevel=3)

    def copy(self) -> TensorPatch:
        """A copy with its own batch lists; the tensors are shared, as nothing writes into them."""
        new = copy.copy(self)
        new.state = TensorState(list(self.state.preds), list(self.state.targets), self.state.nbytes)
        return new

    def forward(self):
        """Concatenate all batches and return ``metric(all_preds, all_targets)``."""
        if not self.state.preds:
            raise ValueError(f"{self!r} is empty: load a batch or add a loaded patch before computing it")
        preds, targets = _concat(self.state.preds), _concat(self.state.targets)
        if len(self.state.preds) > 1 and _is_catable(preds) and _is_catable(targets):
            # The next forward need not concatenate again.
            self.state = TensorState([preds], [targets], self.state.nbytes)
        return self.metric(preds, targets)

    def __repr__(self) -> str:
        return (
            f"TensorPatch({_metric_name(self.metric)}, batches={len(self.state.preds)}, name={self.name!r})"
        )
