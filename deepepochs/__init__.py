"""deepepochs: a PyTorch training loop driven by an explicit, spec-generated finite-state machine."""

from deepepochs.callbacks import (
    AnalyzeCallback,
    Callback,
    CheckCallback,
    GradClipCallback,
    InterpreteCallback,
    LogCallback,
    LRFindCallback,
)
from deepepochs.confusion import ConfusionMetrics, ConfusionPatch
from deepepochs.errors import (
    CheckpointError,
    ConfigError,
    DistributedError,
    InvalidTransition,
    LoopError,
)
from deepepochs.fsm.events import Event
from deepepochs.launch import launch
from deepepochs.optim import Optimizer
from deepepochs.patches import (
    MeanPatch,
    PatchBase,
    TensorPatch,
    ValuePatch,
)
from deepepochs.tasks import EpochTask, rename
from deepepochs.trainer import Trainer, TrainerBase
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
    "DistributedError",
    "EpochTask",
    "Event",
    "GradClipCallback",
    "InterpreteCallback",
    "InvalidTransition",
    "LRFindCallback",
    "LogCallback",
    "LoopError",
    "MeanPatch",
    "Optimizer",
    "PatchBase",
    "TensorPatch",
    "Trainer",
    "TrainerBase",
    "ValuePatch",
    "launch",
    "rename",
    "set_seed",
]
