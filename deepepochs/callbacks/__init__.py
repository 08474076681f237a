"""Callbacks: the `Callback` base class and the ready-made ones."""

from deepepochs.callbacks.analyze import AnalyzeCallback
from deepepochs.callbacks.averaging import EMACallback, SWACallback
from deepepochs.callbacks.base import Callback, HookTable
from deepepochs.callbacks.check import CheckCallback
from deepepochs.callbacks.grad_clip import GradClipCallback
from deepepochs.callbacks.interprete import InterpreteCallback
from deepepochs.callbacks.log import LogCallback
from deepepochs.callbacks.lr_find import LRFindCallback
from deepepochs.callbacks.mlflow_tracker import MLflowCallback
from deepepochs.callbacks.profile import ProfileCallback
from deepepochs.callbacks.snapshot import SnapshotCallback
from deepepochs.callbacks.tracker import TrackerCallback
from deepepochs.callbacks.wandb_tracker import WandbCallback

__all__ = [
    "AnalyzeCallback",
    "Callback",
    "CheckCallback",
    "EMACallback",
    "GradClipCallback",
    "HookTable",
    "InterpreteCallback",
    "LRFindCallback",
    "LogCallback",
    "MLflowCallback",
    "ProfileCallback",
    "SWACallback",
    "SnapshotCallback",
    "TrackerCallback",
    "WandbCallback",
]
