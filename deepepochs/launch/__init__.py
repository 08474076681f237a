"""Start a training function in one process per device, the way ``torchrun`` would.

``launch(main)`` is the entry point of multi-process training from a plain ``python train.py`` (or an IDE's
run button). It does not train anything itself: it starts the processes, gives each one the environment
variables ``torchrun`` would give it, runs ``main()`` in each, and hands rank 0's return value back.

Division of labour with the Trainer:

- ``launch`` sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
  ``MASTER_PORT`` in every child before ``main()`` runs. It never initialises a process group.
- The Trainer built inside ``main()`` reads those variables, picks its device from ``LOCAL_RANK``,
  initialises the default process group from the environment (gloo on CPU, nccl on CUDA) and destroys it
  in ``close()``. Under ``torchrun`` the same variables come from ``torchrun``, so the Trainer's code path is
  identical.

The package: :mod:`~deepepochs.launch.entry` (``launch`` itself: its arguments, running inside a job
already), :mod:`~deepepochs.launch.importable` (can spawned children import ``main``?),
:mod:`~deepepochs.launch.spawn` (starting and waiting for the children, signals, the environment),
:mod:`~deepepochs.launch.child` (what runs in each child, and the files it leaves for the parent) and
:mod:`~deepepochs.launch.failures` (stopping the group and reporting the failing rank).
"""

from deepepochs.launch.entry import launch

__all__ = ["launch"]
