"""Sample-weighted means in constant memory: :class:`MeanPatch` (a metric computed per batch) and
:class:`ValuePatch` (values computed elsewhere, such as batch losses), both holding a :class:`MeanState`.

A mean weighted by each batch's sample count is the whole-dataset value for means over samples (accuracy,
mean losses), whatever the batch sizes; it is not for precision, recall or F1.
"""

from __future__ import annotations

import copy
import math
import numbers

import attrs
import torch
import torch.distributed as dist

from deepepochs.errors import ConfigError
from deepepochs.patches.base import PatchBase, _check_metric, _collective_device, _is_count, _metric_name, _world_size
from deepepochs.patches.nests import _first_tensor

__all__ = ["MeanPatch", "MeanState", "ValuePatch"]


def _check_total(instance, attribute, value) -> None:
    for item in value.values() if isinstance(value, dict) else [value]:
        if item is not None and not isinstance(item, (numbers.Real, torch.Tensor)):
            raise TypeError(f"{attribute.name} must hold numbers or tensors (got {type(item).__name__})")


@attrs.define
class MeanState:
    """What :class:`MeanPatch` and :class:`ValuePatch` hold: a sample-weighted sum and the sample count.

    ``total`` is None while empty, else a 0-d tensor or a float (or a dict of them for a dict-valued
    metric); ``count`` is an int, a float or a tensor, whichever form the batch sizes came in.
    """

    total: object = attrs.field(default=None, validator=_check_total)
    count: object = attrs.field(
        default=0, validator=attrs.validators.instance_of((numbers.Real, torch.Tensor))
    )


def _scalar(value, what: str):
    """A detached 0-d tensor (at least float32) or a float, from a per-batch value; a 1-D tensor of
    per-class values stays 1-D (each class averaged on its own)."""
    if isinstance(value, torch.Tensor) and (value.numel() == 1 or value.dim() == 1):
        value = value.detach() if value.dim() == 0 or value.numel() > 1 else value.detach().reshape(())
        if not value.is_floating_point() or value.element_size() < 4:
            # Half-precision sums lose counts quickly; integer values would truncate the mean.
            value = value.to(torch.get_default_dtype())
        return value
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    got = f"shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
    raise ConfigError(f"{what} must be a number, a one-element tensor or a 1-D tensor of per-class values"
                      f" (got {got})")


def _weighted(value, count):
    """value * count; an empty batch (a count of plain 0) adds 0 even when its metric value is NaN."""
    if isinstance(count, numbers.Real) and count == 0:
        return torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0.0
    return value * count


def _check_batch_size(batch_size):
    if isinstance(batch_size, torch.Tensor) and batch_size.numel() == 1:
        return batch_size.detach().reshape(())
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Real) or not batch_size >= 0:
        raise ConfigError(f"batch_size must be a number >= 0 or a one-element tensor (got {batch_size!r})")
    return batch_size


def _add_totals(a, b):
    """Sum two totals without writing into either (copies of a state may share the same tensors)."""
    if a is None or b is None:
        return b if a is None else a
    if isinstance(a, dict) != isinstance(b, dict) or (isinstance(a, dict) and a.keys() != b.keys()):
        keys = [sorted(x) if isinstance(x, dict) else "a single value" for x in (a, b)]
        raise ValueError(f"cannot merge mean patches of different metric results ({keys[0]} and {keys[1]})")
    return {key: a[key] + b[key] for key in a} if isinstance(a, dict) else a + b


class _MeanPatchBase(PatchBase):
    """Shared behaviour of the patches whose state is a :class:`MeanState`."""

    state: MeanState

    def add(self, other):
        """Add the sums and counts of ``other`` to those of self; return self."""
        self._check_same_kind(other)
        self.state = MeanState(
            _add_totals(self.state.total, other.state.total), self.state.count + other.state.count
        )
        return self

    def copy(self):
        """A copy with its own state record; tensors are shared, as :meth:`add` never writes into them."""
        new = copy.copy(self)
        new.state = attrs.evolve(self.state)
        return new

    def forward(self):
        """The sample-weighted mean sum / count as 0-d tensors (NaN while empty); never syncs."""
        if self.state.total is None:
            return torch.tensor(math.nan)
        divide = lambda total: torch.as_tensor(total, dtype=_dtype_of(total)) / self.state.count
        if isinstance(self.state.total, dict):
            return {key: divide(value) for key, value in self.state.total.items()}
        return divide(self.state.total)


def _dtype_of(value) -> torch.dtype:
    return value.dtype if isinstance(value, torch.Tensor) else torch.get_default_dtype()


class MeanPatch(_MeanPatchBase):
    """Computes a metric on each batch at once and keeps the sample-weighted mean of the results.

    Exact for metrics that are means over samples (accuracy, mean absolute error): weighting each batch
    by its sample count gives the whole-dataset value for uneven batches too. Not exact for precision,
    recall or F1 (use :class:`TensorPatch` or :class:`ConfusionPatch`). The state is a detached sum and a
    count: constant memory, no autograd graph kept, no host-device sync. :meth:`sync` is the generic one:
    the state is a few numbers, and a rank left empty cannot know a dict-valued metric's keys, which a
    fixed-shape ``all_reduce`` would need.

    Args:
        metric: A callable ``metric(preds, targets)`` returning a scalar (number or one-element tensor)
            or a dict of scalars, each averaged on its own.
        batch_preds: One batch of predictions. None with ``batch_targets`` also None makes an empty patch.
        batch_targets: The batch's targets.
        batch_size: The batch's sample count (an int, a float or a tensor); by default the length of dim 0
            of the first tensor in the targets, else in the preds.
        name: An optional prefix for the keys of a dict result (as in 0.6: `name='C.'` shows `C.accuracy`).

    deepepochs 0.6.18's spelling works too: ``MeanPatch(metric, batch_size, name).load(preds, targets)``.

    Example:
        >>> from deepepochs.metrics import accuracy
        >>> p = MeanPatch(accuracy, torch.tensor([0, 1, 1]), torch.tensor([0, 1, 0]))
        >>> (p + MeanPatch(accuracy, torch.tensor([1]), torch.tensor([1])))()
        tensor(0.7500)
    """

    def __init__(self, metric, batch_preds=None, batch_targets=None, batch_size=None, name=None):
        if _is_count(batch_preds) and (batch_targets is None or isinstance(batch_targets, str)):
            # deepepochs 0.6.18: MeanPatch(metric, batch_size, name=None), then .load(preds, targets)
            batch_size, name = batch_preds, batch_targets if name is None else name
            batch_preds = batch_targets = None
        super().__init__(name)
        _check_metric(metric)
        self.metric = metric
        self.state = MeanState()
        self.batch_size = batch_size  # the count load() uses when it is given none
        if batch_preds is not None or batch_targets is not None:
            self.load(batch_preds, batch_targets, batch_size)

    def load(self, batch_preds, batch_targets=None, batch_size=None) -> MeanPatch:
        """Compute the metric on one batch and replace the state with its weighted value; return self.
        Without ``batch_size`` the count given to the constructor is used, else it is inferred."""
        if batch_size is None:
            batch_size = self.batch_size
        if batch_size is None:
            # A shape, so no sync.
            found = _first_tensor(batch_targets, min_dim=1)
            found = found if found is not None else _first_tensor(batch_preds, min_dim=1)
            if found is None:
                raise ConfigError(
                    "batch_size cannot be inferred: neither targets nor preds hold a tensor with a batch "
                    "dimension; pass batch_size= with the number of samples"
                )
            batch_size = found.shape[0]
        count = _check_batch_size(batch_size)
        value = self.metric(batch_preds, batch_targets)
        what = f"the value of metric {_metric_name(self.metric)!r}"
        if isinstance(value, dict):
            total = {key: _weighted(_scalar(item, f"{what}[{key!r}]"), count) for key, item in value.items()}
        else:
            total = _weighted(_scalar(value, what), count)
        self.state = MeanState(total, count)
        return self


class ValuePatch(_MeanPatchBase):
    """Keeps the sample-weighted mean of values computed elsewhere, such as per-batch mean losses.

    Args:
        batch_mean_value: The batch's mean, a number or a one-element tensor (detached here); None makes an
            empty patch.
        batch_size: The number of samples the mean was taken over (an int, a float or a tensor).
        name: An optional prefix for the keys of a dict result (as in 0.6: `name='C.'` shows `C.accuracy`).

    deepepochs 0.6.18's spelling works too: ``ValuePatch(batch_size, name).load(batch_mean_value)``.

    Example:
        >>> (ValuePatch(torch.tensor(1.0), 3) + ValuePatch(torch.tensor(3.0), 1))()
        tensor(1.5000)
    """

    def __init__(self, batch_mean_value=None, batch_size=None, name=None):
        if batch_mean_value is not None and (batch_size is None or isinstance(batch_size, str)):
            # deepepochs 0.6.18: ValuePatch(batch_size, name=None), then .load(batch_mean_value)
            batch_size, name = batch_mean_value, batch_size if name is None else name
            batch_mean_value = None
        super().__init__(name)
        self.state = MeanState()
        self.batch_size = batch_size  # the count load() uses when it is given none
        if batch_mean_value is not None:
            self.load(batch_mean_value, batch_size)

    def load(self, batch_mean_value, batch_size=None) -> ValuePatch:
        """Replace the state with one batch's mean times its sample count; return self. Without
        ``batch_size`` the count given to the constructor is used. A dict of means is averaged key by key."""
        if batch_size is None:
            batch_size = self.batch_size
        if batch_size is None:
            raise ConfigError("batch_size is required: ValuePatch(batch_mean_value, batch_size), or"
                              " ValuePatch(batch_size).load(batch_mean_value) as in deepepochs 0.6.18 (got None)")
        count = _check_batch_size(batch_size)
        if isinstance(batch_mean_value, dict):
            total = {key: _weighted(_scalar(value, f"batch_mean_value[{key!r}]"), count)
                     for key, value in batch_mean_value.items()}
        else:
            total = _weighted(_scalar(batch_mean_value, "batch_mean_value"), count)
        self.state = MeanState(total, count)
        return self

    def sync(self) -> ValuePatch:
        """Sum the totals and counts of all ranks with one ``all_reduce`` (see :meth:`PatchBase.sync`)."""
        if _world_size() == 1:
            return self
        if isinstance(self.state.total, dict):  # several means: merge them the generic way
            return super().sync()
        total, count = self.state.total, self.state.count
        home = total.device if isinstance(total, torch.Tensor) else torch.device("cpu")
        device = _collective_device()
        # float64 keeps summed counts exact; this runs once per epoch, so the copies do not matter.
        pair = [
            torch.as_tensor(0.0 if x is None else x, dtype=torch.float64, device=device)
            for x in (total, count)
        ]
        buffer = torch.stack(pair)
        dist.all_reduce(buffer)
        self.state = MeanState(*buffer.to(home, _dtype_of(total)).unbind())
        return self
