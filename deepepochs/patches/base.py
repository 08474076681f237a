"""The patch protocol (:class:`PatchBase`: load, add, forward, copy, ``+``, sync) and merging patches.

Also what every patch kind checks of its arguments (a callable metric, 0.6.18's positional sample count)
and the process-group facts a cross-process merge needs (world size, where a collective's tensors live).
"""

from __future__ import annotations

import abc
import copy
import numbers

import torch
import torch.distributed as dist

from deepepochs.errors import ConfigError
from deepepochs.patches.nests import _first_tensor, _map_tensors

__all__ = [
    "PatchBase",
    "_check_metric",
    "_collective_device",
    "_is_count",
    "_metric_name",
    "_world_size",
    "merge_patches",
]


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
        order, so all ranks end with the same state. An override replaces the state with new tensors and
        never reduces into the ones it holds: patches may share a state (the metrics of one batch share one
        confusion matrix, and a copy shares what it never writes), so an in-place sum would be counted again
        by the next patch's sync.

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
