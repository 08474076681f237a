"""Small helpers: `set_seed`."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

__all__ = ["set_seed"]


def set_seed(seed: int, deterministic: bool = False) -> None:
    """Seed Python, NumPy and PyTorch (all devices); `deterministic` also asks cuDNN for determinism."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    if deterministic:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
