"""Streaming metric objects: a ``torchmetrics.Metric`` (or any object with its protocol) as a patch.

A metric object accumulates its own state batch by batch (``update``), computes from it (``compute``) and
knows how its state merges across processes. :class:`StreamPatch` drives such an object the way the trainer
drives every patch, so its memory is the object's state (counts for most metrics) instead of every
prediction of the epoch:

* the user's object is a template and is never updated: the state lives in the patch, so each task (train,
  val, test, each `EpochTask`) has its own, which starts empty;
* ``update`` runs once per batch, when the batch's patch is added to the task's patch; ``compute`` runs at
  the task's end; the object's ``forward`` (which updates *and* computes, and syncs on some settings) is
  never called;
* the state is a record of tensors and lists of tensors, so rollback keeps the committed part and snapshots
  store it like any patch's;
* :meth:`StreamPatch.sync` merges the ranks once, with the object's own distributed gather and reductions;
  its ``compute`` never syncs again.

torchmetrics is not a dependency: :func:`is_metric_object` recognises its ``Metric`` only when torchmetrics
was imported already (a user who made such an object has imported it).
"""

from __future__ import annotations

import copy
import sys
import weakref

import attrs
import torch

from deepepochs.errors import ConfigError
from deepepochs.patches import PatchBase, _map_tensors, _metric_name, _world_size

__all__ = ["StreamPatch", "StreamState", "is_metric_object"]


def is_metric_object(metric) -> bool:
    """Whether ``metric`` is a ``torchmetrics.Metric`` (without importing torchmetrics)."""
    module = sys.modules.get("torchmetrics")
    base = getattr(module, "Metric", None) if module is not None else None
    return base is not None and isinstance(metric, base)


@attrs.define
class StreamState:
    """What a :class:`StreamPatch` holds.

    Attributes:
        values: the metric object's state by name (its ``metric_state``): tensors and lists of tensors; None
            while nothing was fed (the object's defaults).
        updates: how many ``update`` calls made ``values``.
        pending: batches loaded but not fed yet, as ``(preds, targets)`` pairs (references, not copies):
            a batch's own patch feeds nothing until it is added to a task's patch.
    """

    values: dict | None = attrs.field(default=None)
    updates: int = attrs.field(default=0, validator=attrs.validators.instance_of(int))
    pending: list = attrs.field(factory=list, validator=attrs.validators.instance_of(list))


def _never() -> bool:
    return False


def _always() -> bool:
    return True


# One working copy per (template, device): the object whose `update` and `compute` run, its state swapped
# in and out around each call. Keyed weakly, so a template the user drops takes its workers with it.
_WORKERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _worker(template, device: torch.device | None):
    per_device = _WORKERS.setdefault(template, {})
    key = str(device) if device is not None else None
    worker = per_device.get(key)
    if worker is None:
        worker = copy.deepcopy(template)
        if device is not None:
            worker = worker.to(device)
        _clear(worker)
        # Merging across ranks is StreamPatch.sync's, once; compute must not gather a second time.
        worker.distributed_available_fn = _never
        per_device[key] = worker
    return worker


def _clear(worker) -> None:
    """Give the worker fresh default states. Not its `reset`: that empties list states in place, and those
    lists belong to a patch after a call."""
    for name, default in worker._defaults.items():
        setattr(worker, name, default.detach().clone().to(worker.device) if isinstance(default, torch.Tensor) else [])
    worker._update_count = 0
    worker._computed = None
    worker._cache = None
    worker._is_synced = False


def _clone_values(values: dict | None) -> dict | None:
    """An independent copy of a state: updates add into tensors in place and append to lists."""
    if values is None:
        return None
    return {name: list(v) if isinstance(v, list) else v.clone() for name, v in values.items()}


def _device_of(obj) -> torch.device | None:
    found = []
    _map_tensors(lambda t: found.append(t.device), obj)
    return found[0] if found else None


class StreamPatch(PatchBase):
    """Streams batches through a metric object (``update`` per batch, ``compute`` at the end).

    Memory is the object's own state, whatever the number of batches. The result equals the object's value
    over all the batches at once (for a ``torchmetrics.Metric``: its ``update`` on every batch, then
    ``compute``).

    Args:
        metric: A ``torchmetrics.Metric`` (or an object with ``update``, ``compute``, ``reset``,
            ``metric_state`` and torchmetrics' sync protocol). It is a template: never updated itself.
        batch_preds: One batch of predictions; None with ``batch_targets`` also None makes an empty patch.
        batch_targets: The batch's targets.
        name: An optional prefix for the keys of a dict result.

    Example:
        >>> from torchmetrics.classification import MulticlassF1Score
        >>> f1 = MulticlassF1Score(num_classes=3, average='macro')
        >>> p = StreamPatch(f1, torch.tensor([0, 1, 2]), torch.tensor([0, 1, 1]))
        >>> (p + StreamPatch(f1, torch.tensor([2]), torch.tensor([2])))()
        tensor(0.7778)
    """

    def __init__(self, metric, batch_preds=None, batch_targets=None, name=None):
        super().__init__(name)
        missing = [m for m in ("update", "compute", "reset") if not callable(getattr(metric, m, None))]
        if missing:
            raise ConfigError(f"metric must be a metric object with update(), compute() and reset() methods, such"
                              f" as a torchmetrics.Metric (got {type(metric).__name__}, lacking {missing})")
        self.metric = metric
        self.state = StreamState()
        if batch_preds is not None or batch_targets is not None:
            self.load(batch_preds, batch_targets)

    def load(self, batch_preds, batch_targets=None) -> StreamPatch:
        """Replace the state with one batch, kept by reference until it is fed; return self."""
        pair = (_map_tensors(torch.Tensor.detach, batch_preds), _map_tensors(torch.Tensor.detach, batch_targets))
        self.state = StreamState(pending=[pair])
        return self

    # ---- the object's state, swapped in and out of a worker ----
    def _run(self, values: dict | None, updates: int, fn):
        """Call ``fn(worker)`` with ``values`` as the worker's state; return (fn's result, the state after)."""
        device = _device_of(values) or _device_of(self.state.pending) or _device_of(dict(self.metric.metric_state))
        worker = _worker(self.metric, device)
        if values is None:
            _clear(worker)
        else:
            for name, value in values.items():
                setattr(worker, name, value)
        worker._update_count = updates
        worker._computed = None
        try:
            result = fn(worker)
            after = {name: getattr(worker, name) for name in worker._defaults}
            return result, after, worker._update_count
        finally:
            _clear(worker)

    def _fed(self, values, updates, pending):
        """The state after feeding ``pending`` into ``values`` (which is updated in place)."""
        if not pending:
            return values, updates

        def feed(worker):
            for preds, targets in pending:
                worker.update(preds, targets)

        _, values, updates = self._run(values, updates, feed)
        return values, updates

    def flush(self) -> StreamPatch:
        """Feed the pending batches into the state, dropping the references to them; return self."""
        state = self.state
        if state.pending:
            values, updates = self._fed(state.values, state.updates, state.pending)
            self.state = StreamState(values, updates)
        return self

    # ---- the patch protocol ----
    def add(self, other: StreamPatch) -> StreamPatch:
        """Feed ``other``'s batches after self's (merging ``other``'s fed state first, if it has one)."""
        self._check_same_kind(other)
        self.flush()
        if other.state.values is not None:
            def merge(worker):
                worker.merge_state(other.state.values)  # `values` is never aliased by another patch

            try:
                _, values, updates = self._run(self.state.values, self.state.updates, merge)
            except (RuntimeError, ValueError) as e:
                raise ConfigError(f"cannot merge two fed states of metric {_metric_name(self.metric)!r} ({e});"
                                  " feed batches in order instead") from e
            self.state = StreamState(values, updates + other.state.updates)
        values, updates = self._fed(self.state.values, self.state.updates, list(other.state.pending))
        self.state = StreamState(values, updates)
        return self

    def copy(self) -> StreamPatch:
        """A copy with its own state (tensors cloned: updates add into them in place)."""
        new = copy.copy(self)
        state = self.state
        new.state = StreamState(_clone_values(state.values), state.updates, list(state.pending))
        return new

    def forward(self):
        """The object's ``compute`` over every batch fed or pending (self is left unchanged)."""
        state = self.state
        if state.updates == 0 and not state.pending:
            raise ValueError(f"{self!r} is empty: load a batch or add a loaded patch before computing it")
        values, updates = self._fed(_clone_values(state.values), state.updates, state.pending)
        result, _, _ = self._run(values, updates, lambda worker: worker.compute())
        return result

    def sync(self) -> StreamPatch:
        """Merge the states of all ranks with the object's own gather and reductions (once).

        A collective, like :meth:`PatchBase.sync`: every rank calls it, each with a patch of this metric.
        """
        if _world_size() == 1:
            return self
        self.flush()

        def gather(worker):
            worker.sync(distributed_available=_always)
            synced = {name: getattr(worker, name) for name in worker._defaults}
            worker.unsync()
            return synced

        synced, _, _ = self._run(self.state.values, self.state.updates, gather)
        # The count only tells compute that the state was updated (a rank may have fed none itself).
        self.state = StreamState(synced, max(self.state.updates, 1))
        return self

    def __repr__(self) -> str:
        return (f"StreamPatch({_metric_name(self.metric)}, updates={self.state.updates},"
                f" pending={len(self.state.pending)}, name={self.name!r})")

