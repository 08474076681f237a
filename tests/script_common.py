"""Helpers shared by the standalone check scripts in tests/ (smoke_training, smoke_launch,
multigpu_training, multigpu_evaluation, single_gpu_checkpoint).

The scripts run under torchrun, `launch()` or a plain `python`, never under pytest, so they import this
module from their own folder (on `sys.path` when a script runs).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.utils.data import TensorDataset

PRECISIONS = ("fp32", "fp16", "bf16")


def parse_args(script: str, doc: str, options: dict[str, dict]) -> argparse.Namespace:
    """The script's options (`{"--flag": add_argument keywords}`) plus `--precision`; unknown arguments
    (launchers may add their own) are reported on stderr and ignored."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for flag, kwargs in options.items():
        parser.add_argument(flag, **kwargs)
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS)
    args, unknown = parser.parse_known_args()
    if unknown:
        print(f"{script}: ignoring unknown arguments {unknown}", file=sys.stderr)
    return args


def is_rank_0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def classification_data(n: int, seed: int, features: int, classes: int, noise: float) -> TensorDataset:
    """`n` samples whose class is the largest of the first `classes` features, blurred by `noise`."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    y = (x[:, :classes] + noise * torch.randn(n, classes, generator=generator)).argmax(dim=1)
    return TensorDataset(x, y)
