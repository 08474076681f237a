"""Strategy selection: which distributed policy a Trainer holds, and the strategy options checked first.

`select_policy` picks, once per Trainer, `SingleProcess` (one process), `DDPPolicy` (several processes, a
replica each; `deepepochs.parallel.ddp`) or `FSDPPolicy` (several processes, the model sharded;
`deepepochs.parallel.fsdp`); `check_ddp_kwargs` checks `Trainer(ddp_kwargs=...)` against DDP's signature in any run.
The FSDP options are checked by `deepepochs.parallel.fsdp.check_strategy_kwargs`, next to the `FSDPConfig` they make.

This module sits above both policy modules (it imports each of them), so neither imports the other's
strategy: `fsdp` builds on `distributed`, and `distributed` knows nothing of `fsdp`.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from deepepochs.errors import ConfigError, DistributedError
from deepepochs.parallel import slurm
from deepepochs.parallel.ddp import DDPPolicy
from deepepochs.parallel.fsdp import FSDPConfig, FSDPPolicy
from deepepochs.parallel.process_group import env_int
from deepepochs.parallel.single import SingleProcess

__all__ = ["check_ddp_kwargs", "select_policy"]


# Set by the trainer: the wrapped module, its device and the process group are the trainer's to choose.
_DDP_RESERVED = ("module", "device_ids", "output_device", "process_group", "device_mesh")


def check_ddp_kwargs(ddp_kwargs) -> dict:
    """`Trainer(ddp_kwargs=...)` validated against `DistributedDataParallel`'s own keyword arguments (e.g.
    `find_unused_parameters`, `static_graph`, `gradient_as_bucket_view`, `broadcast_buffers`), so a
    typo is caught in a single-process run too, where the arguments are otherwise unused."""
    if ddp_kwargs is None:
        return {}
    if not isinstance(ddp_kwargs, Mapping) or not all(isinstance(k, str) for k in ddp_kwargs):
        raise ConfigError(f"ddp_kwargs must be None or a dict of DistributedDataParallel keyword arguments,"
                          f" e.g. {{'find_unused_parameters': True}} (got {ddp_kwargs!r})")
    accepted = sorted(set(inspect.signature(DistributedDataParallel.__init__).parameters)
                      - {"self", *_DDP_RESERVED})
    reserved = sorted(set(ddp_kwargs) & set(_DDP_RESERVED))
    if reserved:
        raise ConfigError(f"ddp_kwargs may not set {reserved}: the trainer sets the module, its device and"
                          f" the process group; accepted keys: {accepted}")
    unknown = sorted(set(ddp_kwargs) - set(accepted))
    if unknown:
        raise ConfigError(f"ddp_kwargs has keys DistributedDataParallel does not take: {unknown}; accepted"
                          f" keys: {accepted}")
    return dict(ddp_kwargs)


def select_policy(device: torch.device, split_batches: bool = False, timeout: float = 600,
                  fsdp: FSDPConfig | None = None, precision: str = "fp32", data_order: str | None = None):
    """The policy for this process: `DDPPolicy` (or `FSDPPolicy` when `fsdp`, an `FSDPConfig`, is given) in a
    job of several processes, else `SingleProcess` (one process: the strategy makes no difference).

    A job of several processes is recognised by `RANK` and `WORLD_SIZE` in the environment with
    `WORLD_SIZE > 1` (torchrun, `deepepochs.launch`, or a task of `srun --ntasks=N`, whose SLURM variables
    `deepepochs.parallel.slurm.adopt_environment` turns into them), or by an initialised default process group of
    several ranks (the caller set it up; it stays the caller's to destroy). `timeout`: seconds a
    collective of a group created here waits for the other ranks (`Trainer(dist_timeout=...)`).
    `precision` picks FSDP's mixed-precision policy. `data_order` (`Trainer(data_order=...)`, checked by
    `TrainerConfig`): None takes 'loader' in one process and 'global' under several; 'loader' under several
    processes is a `ConfigError` (each process must train on its shard of one global order).
    """
    several = False
    if not (dist.is_available() and dist.is_initialized()):
        slurm.adopt_environment()  # a task of `srun --ntasks=N`: ranks and rendezvous from SLURM's variables
    if dist.is_available() and dist.is_initialized():
        several = dist.get_world_size() > 1
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ and env_int("WORLD_SIZE") > 1:
        if not dist.is_available():
            raise DistributedError(
                f"WORLD_SIZE={os.environ['WORLD_SIZE']} asks for distributed training, but this torch build "
                "has no torch.distributed support; run a single process or install a build with it"
            )
        several = True
    if not several:
        return SingleProcess(device, split_batches, data_order or "loader")
    if data_order == "loader":
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else env_int("WORLD_SIZE")
        raise ConfigError(
            f"data_order='loader' trains on the DataLoader's own order, which only one process can do; this job"
            f" has {world} processes, which train on shards of"
            " the global order of (seed, epoch): pass data_order='global' or leave data_order unset")
    if fsdp is not None:
        return FSDPPolicy(device, split_batches, timeout, fsdp, precision)
    return DDPPolicy(device, split_batches, timeout)
