"""deepepochs: a PyTorch training loop driven by an explicit, spec-generated finite-state machine."""

from deepepochs.callbacks import (
    AnalyzeCallback,
    Callback,
    CheckCallback,
    EMACallback,
    GradClipCallback,
    InterpreteCallback,
    LogCallback,
    LRFindCallback,
    MLflowCallback,
    ProfileCallback,
    SnapshotCallback,
    SWACallback,
    TrackerCallback,
    WandbCallback,
)
from deepepochs.checkpoint import consolidate
from deepepochs.compat import (
    TensorDict,
    TensorTuple,
    batches,
    concat,
    flatten_dict,
    plot_confusion,
    sum_dicts,
    to_numpy,
)
from deepepochs.compat import removed as __getattr__  # noqa: F401 (module __getattr__: 0.6 names that are gone)
from deepepochs.data.outputs import ModelLoss
from deepepochs.errors import (
    CheckpointError,
    ConfigError,
    DesyncError,
    DistributedError,
    InvalidTransition,
    MigrationWarning,
    Preempted,
    RunLockedError,
)
from deepepochs.fsm.events import Event
from deepepochs.fsm.flight import save_flight_record
from deepepochs.launch import launch
from deepepochs.patches import (
    MeanPatch,
    PatchBase,
    TensorPatch,
    ValuePatch,
)
from deepepochs.patches.confusion import ConfusionMetrics, ConfusionPatch
from deepepochs.patches.streaming import StreamPatch
from deepepochs.tasks import EpochTask, rename
from deepepochs.trainer import Trainer, TrainerBase
from deepepochs.training.optim import Optimizer
from deepepochs.utils import set_seed

__version__ = "0.7.0"

__all__ = [
    "AnalyzeCallback",
    "Callback",
    "CheckCallback",
    "CheckpointError",
    "ConfigError",
    "ConfusionMetrics",
    "ConfusionPatch",
    "DesyncError",
    "DistributedError",
    "EMACallback",
    "EpochTask",
    "Event",
    "GradClipCallback",
    "InterpreteCallback",
    "InvalidTransition",
    "LRFindCallback",
    "LogCallback",
    "MLflowCallback",
    "MeanPatch",
    "MigrationWarning",
    "ModelLoss",
    "Optimizer",
    "PatchBase",
    "Preempted",
    "ProfileCallback",
    "RunLockedError",
    "SWACallback",
    "SnapshotCallback",
    "StreamPatch",
    "TensorDict",
    "TensorPatch",
    "TensorTuple",
    "TrackerCallback",
    "Trainer",
    "TrainerBase",
    "ValuePatch",
    "WandbCallback",
    "batches",
    "concat",
    "consolidate",
    "flatten_dict",
    "launch",
    "plot_confusion",
    "rename",
    "save_flight_record",
    "set_seed",
    "sum_dicts",
    "to_numpy",
]
