"""``launch(main)``: check the arguments, run ``main`` here when this process already belongs to a job (or
one process is asked for), else spawn the processes (:mod:`~deepepochs.launch.spawn`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from numbers import Integral
from typing import TypeVar

import torch
import torch.distributed as dist

from deepepochs.config import decimal_variable
from deepepochs.errors import ConfigError
from deepepochs.launch.child import _ENV_RANK, _ENV_WORLD_SIZE
from deepepochs.launch.importable import _check_importable
from deepepochs.launch.spawn import _spawn

__all__ = ["NO_GPU_NOTE", "launch"]

T = TypeVar("T")

#: What `launch(main)` prints (stderr) when it runs one process because no GPU is visible.
NO_GPU_NOTE = (
    "launch: no GPU here, so main() runs in this one process. To train in several processes on the CPU"
    " (gloo), ask for them: launch(main, num_processes=2), or run the script with"
    " torchrun --nproc-per-node=2 script.py"
)


def launch(main: Callable[[], T], num_processes: int | None = None) -> T:
    """Run ``main()`` in ``num_processes`` processes and return rank 0's result.

    Each process is a fresh Python interpreter (spawn start method) that imports ``main`` and calls it with
    no arguments, so everything a rank needs (data, model, optimizer, ``Trainer``) is created inside
    ``main``. The environment variables ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR`` and ``MASTER_PORT`` are set in each process before ``main()`` runs, exactly as under
    ``torchrun``; the ``Trainer`` initialises the process group from them. ``launch`` itself never does.

    - Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` are set) or when a process group is already
      initialised, ``main()`` is simply called in every rank; rank 0 gets its result and the other ranks
      get None, as they would if ``launch`` had started them, so ``if result is not None: print(result)``
      prints once under either launcher. The process count is then ``torchrun``'s (``num_processes`` is
      ignored).
    - ``num_processes=1`` calls ``main()`` in this process, without touching the environment; handy for
      debugging, and any callable (a lambda too) is accepted.
    - With several processes, the first failing process ends the whole group (the others are terminated,
      even when blocked in a collective) and :class:`~deepepochs.errors.DistributedError` is raised here
      with that process's traceback. Nothing is restarted.
    - While the processes run, ``OMP_NUM_THREADS=1`` is set if the caller has not set it. The caller's
      environment and its SIGINT/SIGTERM/SIGUSR1 handlers are the same after the call as before it.
    - SIGTERM and SIGUSR1 sent to this process while the processes run are passed on to them. When every
      rank ends ``fit`` with :class:`~deepepochs.errors.Preempted` (a ``SnapshotCallback`` stopped them at
      one commit point), ``Preempted`` is raised here too: left uncaught, the script exits with its
      status (143 for SIGTERM) and a requeued job resumes with ``resume=True``. A forwarded signal that
      did not end in ``Preempted`` is delivered to the caller's own handler once the processes ended.

    The return value of rank 0 travels back by pickle, so it must be a plain picklable object: a dict of
    floats, lists, strings... Convert tensors with ``.item()`` or ``.tolist()`` (or at least ``.cpu()``);
    the other ranks' return values are discarded.

    Args:
        main: A function taking no arguments. With more than one process it must be importable by the child
            processes: defined at the top level of a module or of the script being run, not a lambda, not a
            nested function, not defined in a notebook cell or an interactive session.
        num_processes: How many processes to start. ``None`` means one per visible CUDA device
            (``torch.cuda.device_count()``), or 1 when there is none (then a line on stderr says so and how
            to run several). Choose the devices with ``CUDA_VISIBLE_DEVICES``.

    Returns:
        What ``main()`` returned in the rank 0 process; None in the other ranks of a ``torchrun`` job.

    Raises:
        ConfigError: ``num_processes`` is not a positive int or None, ``main`` is not callable, or (with
            more than one process) ``main`` cannot be imported by the child processes (a lambda, a nested
            function, one defined in a notebook or under the script's ``if __name__ == '__main__':``).
        DistributedError: A process raised an exception or died; the message holds its traceback (a
            child that died before ``main`` ran, e.g. importing the script, carries the end of what the
            children printed to stderr). The children's stderr reaches the caller's as it comes.

    Example:
        ``launch`` runs any no-argument function; with one process it simply calls it:

        >>> from deepepochs.launch import launch
        >>> launch(lambda: {"loss": 0.25}, num_processes=1)
        {'loss': 0.25}

        A multi-process training script (save as ``train.py``, run ``python train.py``)::

            import torch
            from torch import nn
            from torch.nn import functional as F
            from torch.utils.data import DataLoader, TensorDataset
            from deepepochs import Trainer, launch


            def main():
                x = torch.randn(256, 16)
                y = (x[:, 0] > 0).long()
                train_dl = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)
                model = nn.Linear(16, 2)
                opt = torch.optim.Adam(model.parameters(), lr=1e-3)
                with Trainer(model, F.cross_entropy, opt, epochs=3) as trainer:
                    trainer.fit(train_dl)
                    return trainer.test(train_dl)


            if __name__ == "__main__":
                print(launch(main, num_processes=2))
    """
    if not callable(main):
        raise ConfigError(
            f"main must be a callable taking no arguments (got {main!r} of type {type(main).__name__}); "
            "pass the function itself, e.g. launch(main), not launch(main())"
        )
    _check_num_processes(num_processes)

    # Already inside a distributed job: torchrun (or another launcher) started this process, or the caller
    # set up the group by hand. Starting more processes here would nest jobs, so just run.
    if _inside_distributed_job():
        rank = _job_rank()  # read before main(): a Trainer inside it may destroy the group it made
        result = main()
        return result if rank == 0 else None  # one rule under every launcher: rank 0's result, else None

    gpus = torch.cuda.device_count()
    world_size = num_processes if num_processes is not None else max(1, gpus)
    if world_size == 1:
        if num_processes is None and gpus == 0:  # one process because no GPU was found: say so, and how to run more
            print(NO_GPU_NOTE, file=sys.stderr, flush=True)
        return main()
    _check_importable(main)
    return _spawn(main, int(world_size))


def _check_num_processes(num_processes: object) -> None:
    """Raise ConfigError unless ``num_processes`` is None or a positive integer (bool is not a count)."""
    if num_processes is None:
        return
    if isinstance(num_processes, bool) or not isinstance(num_processes, Integral) or num_processes < 1:
        raise ConfigError(
            "num_processes must be a positive int, or None for one process per visible GPU "
            f"(got {num_processes!r} of type {type(num_processes).__name__}); e.g. num_processes=2"
        )


def _job_rank() -> int:
    """This process's global rank in the job it already belongs to (the live group's, else ``RANK``)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return decimal_variable(_ENV_RANK, os.environ.get(_ENV_RANK, "0"))
    except ConfigError:
        return 0  # a malformed RANK is the Trainer's to report when it joins the group


def _inside_distributed_job() -> bool:
    """Return whether this process already belongs to a distributed job (torchrun env or live group)."""
    if _ENV_RANK in os.environ and _ENV_WORLD_SIZE in os.environ:
        return True
    return dist.is_available() and dist.is_initialized()
