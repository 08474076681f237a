"""Patches: the per-batch state of a dataset-level metric, and how those states merge.

A trainer evaluates batch by batch, but a metric must describe the whole dataset. A patch holds what
batches contribute to a metric, merges with other batches' patches (``add``, ``+``) and with other
processes' (``sync``), and computes the metric from the merged state (``forward``, or calling it):

* :class:`TensorPatch` keeps all preds and targets: right for any metric; memory grows with the data.
* :class:`MeanPatch` keeps a sample-weighted mean of per-batch metric values: exact for means over
  samples (accuracy, mean losses), not for precision, recall or F1.
* :class:`ValuePatch` does the same for values computed elsewhere, such as batch losses.
* :class:`~deepepochs.confusion.ConfusionPatch` (in :mod:`deepepochs.confusion`) keeps a confusion matrix:
  exact accuracy, precision, recall, F1 in constant memory.

Loading and merging never force a host-device sync: tensors stay on their device, detached from autograd.
"""

from __future__ import annotations

import abc
import copy
import math
import numbers
import warnings

import attrs
import torch
import torch.distributed as dist

from deepepochs.errors import ConfigError, DeepEpochsWarning

__all__ = [
    "TENSOR_PATCH_WARN_BYTES",
    "MeanPatch",
    "MeanState",
    "PatchBase",
    "TensorPatch",
    "TensorState",
    "ValuePatch",
    "merge_patches",
]


def _map_tensors(fn, obj):
    """Apply ``fn`` to every tensor in a nest of tuples, lists, dicts and attrs records; keep other leaves."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {key: _map_tensors(fn, value) for key, value in obj.items()}
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple takes positional fields
        return type(obj)(*(_map_tensors(fn, value) for value in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(fn, value) for value in obj)
    if attrs.has(type(obj)):
        fields = [f for f in attrs.fields(type(obj)) if f.init]
        return attrs.evolve(obj, **{f.alias: _map_tensors(fn, getattr(obj, f.name)) for f in fields})
    return obj


def _first_tensor(obj, min_dim: int = 0) -> torch.Tensor | None:
    """The first tensor with at least ``min_dim`` dimensions in a nest, depth first, or None."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.dim() >= min_dim else None
    if attrs.has(type(obj)):
        obj = [getattr(obj, f.name) for f in attrs.fields(type(obj))]
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    return next((t for t in (_first_tensor(v, min_dim) for v in values) if t is not None), None)


def _world_size() -> int:
    """The number of processes to merge with: 1 unless a process group is initialised."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _collective_device() -> torch.device:
    """Where tensors must be for a collective: NCCL moves only CUDA tensors, gloo works on the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _metric_name(metric) -> str:
    return getattr(metric, "__name__", None) or type(metric).__name__


def _check_metric(metric) -> None:
    if not callable(metric):
        raise ConfigError(f"metric must be a callable taking (preds, targets) (got {type(metric).__name__})")


def _is_count(value) -> bool:
    """Whether a constructor's second positional argument is a sample count (deepepochs 0.6.18's
    `MeanPatch(metric, batch_size)`, `TensorPatch(metric, batch_size)`) rather than a batch of predictions."""
    if isinstance(value, torch.Tensor):
        return value.dim() == 0
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_total(instance, attribute, value) -> None:
    for item in value.values() if isinstance(value, dict) else [value]:
        if item is not None and not isinstance(item, (numbers.Real, torch.Tensor)):
            raise TypeError(f"{attribute.name} must hold numbers or tensors (got {type(item).__name__})")


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


def _nbytes(obj) -> int:
    sizes = []
    _map_tensors(lambda t: sizes.append(t.numel() * t.element_size()), obj)
    return sum(sizes)


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


class PatchBase(abc.ABC):
    """The state one or more batches contribute to a dataset-level metric.

    Subclasses implement :meth:`load`, :meth:`add` and :meth:`forward`; calling a patch calls
    :meth:`forward`. ``a + b`` returns a new patch and leaves ``a`` and ``b`` unchanged: it adds ``b`` to
    ``a.copy()``. ``sum(patches)`` works too. :meth:`sync` merges across processes with no extra code.

    Args:
        name: An optional prefix for the keys of a dict result, as in 0.6 (`name='C.'` shows `C.accuracy`).

    Example:
        >>> class MaxPatch(PatchBase):
        ...     def load(self, values):
        ...         self.value = values.detach().max()
        ...         return self
        ...     def add(self, other):
        ...         self.value = torch.maximum(self.value, other.value)
        ...         return self
        ...     def forward(self):
        ...         return self.value
        >>> (MaxPatch().load(torch.tensor([1.0, 5.0])) + MaxPatch().load(torch.tensor([3.0])))()
        tensor(5.)
    """

    def __init__(self, name: str | None = None):
        self.name = name

    def load(self, *args, **kwargs) -> PatchBase:
        """Replace the state with the one of a single batch; return self.

        Not abstract: a patch that sets its state in ``__init__``, as deepepochs 0.6 patches did, works
        without it (the trainer itself only adds, copies and computes patches)."""
        raise NotImplementedError(f"{type(self).__name__}.load() is not implemented: define load(...) to fill"
                                  " the patch from one batch, or set the state in __init__")

    @abc.abstractmethod
    def add(self, other: PatchBase) -> PatchBase:
        """Merge the state of ``other`` (a patch of the same class) into self, in place; return self."""

    @abc.abstractmethod
    def forward(self):
        """Compute the metric from the state: a 0-d tensor, a number, or a dict of name -> value."""

    def __call__(self):
        return self.forward()

    def copy(self) -> PatchBase:
        """An independent copy (a deep copy here; subclasses override it with something cheaper)."""
        return copy.deepcopy(self)

    def __add__(self, other):
        return self.copy().add(other) if isinstance(other, PatchBase) else NotImplemented

    def __radd__(self, other):
        # sum(patches) starts from the integer 0.
        return self.copy() if isinstance(other, numbers.Number) and other == 0 else NotImplemented

    def _check_same_kind(self, other) -> None:
        if type(other) is not type(self):
            raise TypeError(
                f"cannot add a {type(other).__name__} to a {type(self).__name__}; "
                "a patch merges only with patches of its own class"
            )

    def sync(self) -> PatchBase:
        """Merge the states of all processes, so that every rank's patch holds the global state.

        A collective: all ranks call it in the same order on patches of one class and configuration (an
        empty patch where a rank saw no batch). Without a process group of 2+ ranks it returns self as is.
        This generic version gathers every rank's attributes with ``all_gather_object`` (tensors via the
        CPU; callables such as the metric stay home, each rank has its own), then adds the patches in rank
        order, so all ranks end with the same state.

        Returns:
            self, now holding the merged state.
        """
        world = _world_size()
        if world == 1:
            return self
        state = {
            k: _map_tensors(lambda t: t.detach().cpu(), v) for k, v in vars(self).items() if not callable(v)
        }
        gathered = [None] * world
        dist.all_gather_object(gathered, state)
        local = _first_tensor(vars(self))
        device = local.device if local is not None else torch.device("cpu")
        merged = None
        for rank, received in enumerate(gathered):
            if rank == dist.get_rank():
                part = self.copy()
            else:
                part = copy.copy(self)  # shares only the callables: every other attribute is replaced
                part.__dict__.update(
                    {k: _map_tensors(lambda t: t.to(device), v) for k, v in received.items()}
                )
            merged = part if merged is None else merged.add(part)
        self.__dict__.update(vars(merged))
        return self


def merge_patches(patches) -> PatchBase:
    """Merge a non-empty iterable of patches of one class into a new patch, leaving the inputs unchanged.

    Raises:
        ConfigError: When ``patches`` is empty.
    """
    patches = list(patches)
    if not patches:
        raise ConfigError("patches must hold at least one patch (got an empty sequence)")
    merged = patches[0].copy()
    for patch in patches[1:]:
        merged.add(patch)
    return merged


def _is_catable(obj) -> bool:
    """Whether concatenated batches keep this structure (only tensors with a dim 0, and Nones)."""
    if isinstance(obj, (dict, tuple, list)):
        return all(_is_catable(value) for value in (obj.values() if isinstance(obj, dict) else obj))
    return obj is None or (isinstance(obj, torch.Tensor) and obj.dim() >= 1)


def _concat(batches: list):
    """Concatenate batches leaf-wise along dim 0.

    Tensors are concatenated (0-d ones stacked); tuples, lists and dicts holding tensors are concatenated
    item by item; a list of plain values (one string or number per sample) is joined into one list; any
    other leaf becomes the list of its per-batch values.
    """
    first = batches[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return torch.stack(batches) if first.dim() == 0 else torch.cat(batches)
    if isinstance(first, dict):
        if any(not isinstance(batch, dict) or batch.keys() != first.keys() for batch in batches):
            raise ValueError(f"TensorPatch batches must all be dicts with the keys {list(first)}")
        return {key: _concat([batch[key] for batch in batches]) for key in first}
    if isinstance(first, (tuple, list)) and all(
        v is None or isinstance(v, (torch.Tensor, tuple, list, dict)) for v in first
    ):
        if any(not isinstance(batch, (tuple, list)) or len(batch) != len(first) for batch in batches):
            raise ValueError(f"TensorPatch batches must all be sequences of {len(first)} items")
        parts = [_concat([batch[i] for batch in batches]) for i in range(len(first))]
        return type(first)(*parts) if hasattr(first, "_fields") else type(first)(parts)
    if isinstance(first, (tuple, list)):
        return [value for batch in batches for value in batch]
    return list(batches)


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
