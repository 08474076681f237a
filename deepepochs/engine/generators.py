"""torch's generator states at commit points: copied, put back, and turned into tensors for snapshots.

A commit point keeps a copy of torch's generators (`remember_random_state`), so the fit after a rollback
(a refit) draws the random numbers the uninterrupted run drew; `engine.position` stores them in snapshots.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from deepepochs.engine.context import Context
from deepepochs.utils import host_state

__all__ = ["keep_host_state", "put_back_host_state", "random_state", "remember_random_state", "set_generators",
           "set_random_state", "state_tensor"]


def random_state(ctx: Context) -> tuple:
    """torch's generator states: the CPU's, and the training GPU's (None elsewhere), as copies of the
    generators (`Generator.clone_state`: no state tensor is made; `state_tensor` makes one)."""
    parts = ctx.parts
    if not parts.on_cuda:
        return torch.default_generator.clone_state(), None
    return torch.default_generator.clone_state(), _gpu_copy(parts.device)


def _gpu_copy(device: torch.device):
    """A copy of the CUDA generator of `device`; its state tensor where no copy can be made (CUDA not
    initialised yet, or generators that cannot be cloned)."""
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index].clone_state()
    except (IndexError, RuntimeError, NotImplementedError):
        return torch.cuda.get_rng_state(device)


def state_tensor(state) -> torch.Tensor:
    """A generator state as `get_rng_state()` gives it: from a copy `random_state` made, or as it is."""
    return state.get_state() if isinstance(state, torch.Generator) else state


def set_random_state(ctx: Context, state: tuple) -> None:
    """Put back generator states `random_state` returned (or their `state_tensor`s)."""
    set_generators(ctx.parts.device, state)


def set_generators(device: torch.device, state: tuple) -> None:
    """`set_random_state` for the training device `device` (loading a checkpoint has no context)."""
    cpu, gpu = state
    torch.set_rng_state(state_tensor(cpu))
    if gpu is not None:
        torch.cuda.set_rng_state(state_tensor(gpu), device)


def remember_random_state(ctx: Context) -> None:
    """Keep torch's generator states as of this commit point: the fit after a rollback (a refit) starts
    from them, so it draws the random numbers (dropout, augmentation in torch) the uninterrupted run drew.
    Once per update; a copy of each generator is kept rather than its state tensor, which costs a third
    as much inside a training loop. Python's and NumPy's generators are 10-70x dearer to read: they are kept
    only where a signal can drop a window that drew from them (`keep_host_state`)."""
    ctx.loop.run.random_state = random_state(ctx)  # the run state's own field (`ctx.random_state` aliases it)
    writer = ctx.snapshots
    ctx.host_random_state = None
    ctx.host_state_due = (writer is not None and bool(writer.signals)
                          and ctx.parts.config.gradient_accumulation_steps > 1)


def keep_host_state(ctx: Context) -> None:
    """Right before a training batch is fetched: on the first fetch after a commit point (the next window's
    first batch, after the hooks, snapshot and validation point that follow the commit) keep Python's and
    NumPy's generator states, when the commit point asked for it (`remember_random_state`: a snapshot writer
    listens for signals, windows of several batches). A signal inside that window drops the micro-batches it
    ran (no batch is fetched once it arrived), and `put_back_host_state` rewinds what they drew."""
    if ctx.host_state_due:
        ctx.host_state_due = False
        ctx.host_random_state = host_state()


def put_back_host_state(ctx: Context) -> None:
    """A dropped window (`discard_window`): Python's and NumPy's generators back to where its first batch was
    fetched, when `keep_host_state` kept them, so that a snapshot written now holds what the resumed run
    draws next."""
    kept = ctx.host_random_state
    if kept is not None:
        ctx.host_random_state = None
        random.setstate(kept[0])
        np.random.set_state(kept[1])
