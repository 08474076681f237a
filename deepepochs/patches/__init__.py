"""Patches: the per-batch state of a dataset-level metric, and how those states merge.

A trainer evaluates batch by batch, but a metric must describe the whole dataset. A patch holds what
batches contribute to a metric, merges with other batches' patches (``add``, ``+``) and with other
processes' (``sync``), and computes the metric from the merged state (``forward``, or calling it):

* :class:`TensorPatch` keeps all preds and targets: right for any metric; memory grows with the data.
* :class:`MeanPatch` keeps a sample-weighted mean of per-batch metric values: exact for means over
  samples (accuracy, mean losses), not for precision, recall or F1.
* :class:`ValuePatch` does the same for values computed elsewhere, such as batch losses.
* :class:`~deepepochs.patches.confusion.ConfusionPatch` (in :mod:`deepepochs.patches.confusion`) keeps a confusion
  matrix: exact accuracy, precision, recall, F1 in constant memory.

Loading and merging never force a host-device sync: tensors stay on their device, detached from autograd.

The package: :mod:`~deepepochs.patches.base` (the protocol, merging), :mod:`~deepepochs.patches.tensor`,
:mod:`~deepepochs.patches.mean` (one patch kind each) and :mod:`~deepepochs.patches.nests` (walking
nests of tensors). The names here are its public surface.
"""

from deepepochs.compat import moved

# The underscored names are not the user API: other deepepochs modules import these helpers from here.
from deepepochs.patches.base import PatchBase, merge_patches
from deepepochs.patches.base import _collective_device as _collective_device
from deepepochs.patches.base import _metric_name as _metric_name
from deepepochs.patches.base import _world_size as _world_size
from deepepochs.patches.mean import MeanPatch, MeanState, ValuePatch
from deepepochs.patches.nests import _map_tensors as _map_tensors
from deepepochs.patches.tensor import TENSOR_PATCH_WARN_BYTES, TensorPatch, TensorState

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

__getattr__ = moved(__name__, {"ConfusionPatch": "deepepochs", "ConfusionMetrics": "deepepochs"})  # 0.6's paths
