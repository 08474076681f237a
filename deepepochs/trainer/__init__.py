"""The Trainer facade and its pieces: the facade (`facade`), its checked arguments (`arguments`), what step
methods call on `self` (`step_methods`) and the resume policy (`resume_policy`).

`from deepepochs.trainer import Trainer, TrainerBase` keeps working; the classes live in `facade`.
"""

from deepepochs.compat import moved
from deepepochs.trainer.facade import Trainer, TrainerBase

__all__ = ["Trainer", "TrainerBase"]

__getattr__ = moved(__name__, {"EpochTask": "deepepochs"})  # 0.6's deepepochs.trainer.EpochTask
