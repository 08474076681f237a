"""What runs in each child of a launch: export the torchrun-style environment, run ``main()``, and leave
files for the parent (rank 0's pickled result, a marker per rank that returned, a record per rank that
stopped on :class:`~deepepochs.errors.Preempted`), then exit without the interpreter's teardown.
"""

from __future__ import annotations

import atexit
import os
import pickle
import sys
from pathlib import Path
from typing import Any

from deepepochs.errors import Preempted

__all__ = ["LAUNCH_MARK", "_MASTER_ADDR", "_RESULT_FILE", "_done_path", "_read_preempted", "_run_rank"]

# The variables torchrun exports to each worker; the Trainer reads them to join the group.
_ENV_RANK = "RANK"
_ENV_LOCAL_RANK = "LOCAL_RANK"
_ENV_WORLD_SIZE = "WORLD_SIZE"
_ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
_ENV_MASTER_ADDR = "MASTER_ADDR"
_ENV_MASTER_PORT = "MASTER_PORT"
#: Set in every child, so that a start-up error can say that launch set the variables above.
LAUNCH_MARK = "DEEPEPOCHS_LAUNCHED"

# All processes run on this machine, so rank 0's rendezvous store listens on the loopback interface only.
_MASTER_ADDR = "127.0.0.1"

_RESULT_FILE = "rank0-result.pickle"


def _preempted_path(result_dir: str, rank: int) -> str:
    return os.path.join(result_dir, f"rank{rank}.preempted")


def _read_preempted(result_dir: str, world_size: int) -> Preempted | None:
    """Rank 0's `Preempted` when every rank stopped on one (see `_run_rank`), else None."""
    paths = [_preempted_path(result_dir, rank) for rank in range(world_size)]
    if not all(os.path.exists(path) for path in paths):
        return None
    with open(paths[0], "rb") as fh:
        code, signal_name, snapshot = pickle.load(fh)
    return Preempted(code, signal_name, None if snapshot is None else Path(snapshot))


def _run_rank(local_rank: int, main_pickled: bytes, world_size: int, master_port: int, result_path: str) -> None:
    """Child-process entry: export the torchrun-style environment, run ``main()``, save rank 0's result.

    Top level of this module so that ``torch.multiprocessing`` can pickle it by reference.
    """
    main = pickle.loads(main_pickled)
    os.environ.update(
        {
            _ENV_RANK: str(local_rank),
            _ENV_LOCAL_RANK: str(local_rank),
            _ENV_WORLD_SIZE: str(world_size),
            _ENV_LOCAL_WORLD_SIZE: str(world_size),
            _ENV_MASTER_ADDR: _MASTER_ADDR,
            _ENV_MASTER_PORT: str(master_port),
            LAUNCH_MARK: "1",  # a start-up error names launch as the source of these variables
        }
    )
    # No init_process_group here: the Trainer creates the group from these variables (and so owns it and
    # destroys it), exactly as it does under torchrun.
    try:
        result = main()
    except Preempted as stop:
        # Every rank stopped at the same commit point (SnapshotCallback): no failure. The parent raises it
        # once all ranks ended so; a clean exit here keeps the others from being terminated meanwhile.
        with open(_preempted_path(os.path.dirname(result_path), local_rank), "wb") as fh:
            pickle.dump((stop.code, stop.signal_name, None if stop.path is None else str(stop.path)), fh)
        _exit_quietly()
    except KeyboardInterrupt as exc:
        # torch's child wrapper takes a KeyboardInterrupt for its parent stopping it and exits 0 without a
        # word; a SIGINT that reached this rank alone would then surface as the other ranks' collective
        # failing for want of a peer. Raised as an error, its traceback (the rollback's flight record) is the
        # one the parent reports first.
        raise RuntimeError(f"rank {local_rank} was interrupted (KeyboardInterrupt: SIGINT reached it); main() "
                           "rolled back and ended there") from exc
    if local_rank == 0:
        _write_result(result, result_path)
    open(_done_path(result_path, local_rank), "w").close()
    _exit_quietly()


def _done_path(result_path: str, rank: int) -> str:
    """The marker a rank leaves beside the result file once its main() has returned."""
    return os.path.join(os.path.dirname(result_path), f"rank{rank}.done")


def _exit_quietly() -> None:
    """End a child whose main() returned: run its atexit handlers, flush its output, then leave without
    the interpreter's teardown.

    Why: that teardown sometimes aborts (SIGABRT, "terminate called without an active exception") when
    C++ threads of gloo or the TCPStore are destroyed while still joinable, after main() returned and the
    result was saved; plain torch does it too. The parent would then report a failed rank and drop the
    result. The child has nothing left to do, so it skips the teardown; the atexit handlers main()
    registered still run (`atexit._run_exitfuncs`, CPython's own hook for this; skipped if absent).
    """
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if run_exitfuncs is not None:
        run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


def _write_result(result: Any, result_path: str) -> None:
    """Pickle rank 0's result to ``result_path`` atomically (the parent reads it after all ranks exit)."""
    try:
        payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"launch: the value main() returned on rank 0 ({type(result).__name__}) cannot be sent back to "
            f"the caller ({type(exc).__name__}: {exc}); return plain picklable Python objects, converting "
            "tensors with .item() or .tolist()"
        ) from exc
    partial_path = result_path + ".partial"
    with open(partial_path, "wb") as fh:
        fh.write(payload)
    os.replace(partial_path, result_path)
