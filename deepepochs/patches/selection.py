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

import copy
import inspect

import torch
import torch.distributed as dist

from deepepochs import metrics as _metrics
from deepepochs.errors import ConfigError
from deepepochs.patches import MeanPatch, PatchBase, TensorPatch, TensorState, _map_tensors
from deepepochs.patches.confusion import ConfusionPatch
from deepepochs.patches.streaming import StreamPatch, is_metric_object
from deepepochs.tasks import metric_name

__all__ = ["PATCH_CLASSES", "confusion_kind", "make_patches", "merge_on_root", "patch_kind"]

#: deepepochs 0.6's `Trainer(metric_patch=<a patch class>)`: the setting each class stands for.
PATCH_CLASSES = {TensorPatch: "tensor", MeanPatch: "mean", ConfusionPatch: "confusion"}


def patch_kind(metric_patch):
    """`metric_patch` as a setting name: 0.6's patch classes (`metric_patch=TensorPatch`) become the name of
    the setting that gives their patches (`'tensor'`, `'mean'`, `'confusion'`); a string is returned as it is
    (the trainer's configuration checks it); another class is refused, naming the accepted ones."""
    if not isinstance(metric_patch, type):
        return metric_patch
    kind = next((k for cls, k in PATCH_CLASSES.items() if issubclass(metric_patch, cls)), None)
    if kind is None:
        accepted = ", ".join(f"{cls.__name__} (= {k!r})" for cls, k in PATCH_CLASSES.items())
        raise ConfigError(f"metric_patch must be 'auto', 'tensor', 'mean' or 'confusion', or one of the patch"
                          f" classes {accepted} (got the class {metric_patch.__name__}); a patch of your own is"
                          " returned by a custom step: return {'name': MyPatch(...)}")
    return kind


def confusion_kind(metric) -> str | None:
    """The confusion-matrix metric ``metric`` is ('accuracy', ..., 'confusion_matrix'), or None: one of
    deepepochs' own functions with its default arguments, possibly renamed (`rename`, `functools.wraps`)."""
    base = inspect.unwrap(metric) if callable(metric) and not is_metric_object(metric) else None
    return next((kind for fn, kind in _metrics._CONFUSION_FUNCTIONS.items() if base is fn), None)


def make_patches(kind: str, metrics, preds, targets) -> dict:
    """`{name: patch}` of one batch for `metrics` under `metric_patch=kind`, in the order of `metrics`.

    Every patch has `name=''`: the keys of a dict result are shown as they are, also when a custom step
    returns these patches (a step's nameless patches are prefixed by their key, see `steps.name_by_key`)."""
    if kind == "confusion":
        functions = [m for m in metrics if not is_metric_object(m)]
        out = {"confusion": ConfusionPatch(preds, targets, metrics=functions, name="")} if functions else {}
        out.update({metric_name(m): StreamPatch(m, preds, targets, name="") for m in metrics if is_metric_object(m)})
        return out
    out, matrix = {}, None
    for m in metrics:
        if is_metric_object(m):
            patch = StreamPatch(m, preds, targets, name="")
        elif kind == "mean":
            patch = MeanPatch(m, preds, targets, name="")
        elif kind == "auto" and confusion_kind(m) is not None:
            patch = ConfusionPatch(metrics=(m,), name="")
            if matrix is None:
                matrix = patch.load(preds, targets).state
            else:
                patch.state = matrix  # one matrix per batch, shared: a ConfusionPatch never writes into it
        else:
            patch = TensorPatch(m, preds, targets, name="")
        out[metric_name(m)] = patch
    return out


class _Computed(PatchBase):
    """A metric value computed on one rank and sent to every rank: a merged `TensorPatch` under DDP."""

    def __init__(self, value, name=None):
        super().__init__(name)
        self.value = value

    def add(self, other):
        raise TypeError("a metric value computed on rank 0 is final: it merges with nothing")

    def forward(self):
        return self.value


def merge_on_root(patch: TensorPatch, device: torch.device) -> PatchBase:
    """`patch`'s metric over every rank's batches, computed once, on rank 0, and sent to every rank.

    A collective (every rank calls it, in the same order). The predictions travel to rank 0 only, instead
    of to every rank as in `TensorPatch.sync`: the other ranks hold nothing but their own, and only rank 0
    concatenates them all. A metric that raises on rank 0 raises there, and on the other ranks as a
    RuntimeError naming it.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    to_cpu = lambda t: t.detach().cpu()  # noqa: E731 (pickled for the other rank)
    mine = None if rank == 0 else (_map_tensors(to_cpu, patch.state.preds), _map_tensors(to_cpu, patch.state.targets))
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    outcome = [None]
    if rank == 0:
        merged = patch.copy()
        to_device = lambda t: t.to(device)  # noqa: E731
        for preds, targets in gathered[1:]:
            part = copy.copy(patch)
            part.state = TensorState(_map_tensors(to_device, preds), _map_tensors(to_device, targets))
            merged.add(part)
        gathered = None
        try:
            outcome[0] = ("value", _map_tensors(to_cpu, merged.forward()))
        except Exception as e:
            error = e
            outcome[0] = ("error", f"{type(e).__name__}: {e}")
        del merged
    dist.broadcast_object_list(outcome, src=0)
    kind, value = outcome[0]
    if kind == "error":
        if rank == 0:
            raise error
        raise RuntimeError(f"metric {metric_name(patch.metric)!r} failed on rank 0, where it is computed: {value}")
    return _Computed(value, patch.name)
