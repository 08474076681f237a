"""Distributed policy: process group, DDP wrapping, sharding, gradient sync and global reductions.

`SingleProcess` is the policy of an ordinary run: every method is a cheap no-op or identity, so the
trainer calls them unconditionally and the per-batch path has no `if distributed` branches.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["SingleProcess", "select_policy"]


class SingleProcess:
    """One process: nothing to synchronise."""

    world_size = 1
    rank = 0
    local_rank = 0
    is_main = True

    def __init__(self, device: torch.device):
        self.device = device
        self.model = None

    def wrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module the step calls (DDP wraps it; one process uses it as is)."""
        self.model = model
        return model

    def prepare_dataloader(self, dataloader, stage: str):
        """The iterable a task iterates (DDP shards plain DataLoaders)."""
        return dataloader

    def set_epoch(self, epoch: int) -> None:
        """Tell sharded samplers the epoch so shuffling differs per epoch and agrees across ranks."""

    def set_grad_sync(self, enabled: bool) -> None:
        """Whether the next backward all-reduces gradients (DDP's no_sync when False)."""

    def global_sum(self, value: int) -> int:
        """Sum of an int over all ranks."""
        return value

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of a tensor over all ranks."""
        return tensor

    def sync_patch(self, patch):
        """A metric patch merged over all ranks."""
        return patch

    def broadcast_model(self, model: torch.nn.Module) -> None:
        """Make every rank's parameters and buffers equal to rank 0's."""

    def check_batch_counts(self, count: int, stage: str) -> None:
        """Raise if ranks ran different numbers of training batches (a hang otherwise)."""

    def main_process_first(self):
        """Context: the main process runs the block first, the others after it."""
        return contextlib.nullcontext()

    def close(self) -> None:
        """Release what this policy created (process groups it initialised)."""


def select_policy(device: torch.device):
    """The policy for this process: `SingleProcess` unless a distributed environment is detected."""
    return SingleProcess(device)
