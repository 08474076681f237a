"""One fault-matrix cell in a process of its own (run as a script by tests/test_fault_matrix.py).

`python fault_matrix_target.py MODE STAGE STATE OCCURRENCE FAULT CONTEXT FOLDER OUT` (MATRIX_THREADS: torch's
thread count, the test process's), MODE one of:

- `group`: run STAGE with 2 DataLoader workers per loader started by CONTEXT (fork or spawn); on the
  OCCURRENCE-th entry into STATE, send FAULT (SIGTERM, SIGUSR1, SIGINT) to this process's whole group, as a
  scheduler signals a job (the test starts this script in a session of its own). In a fit a SnapshotCallback
  in FOLDER listens for FAULT. What the stage ended with goes to OUT: `preempted` (with the status and the
  snapshot; then a new trainer resumed from it runs the stage to its end) or `rolled back` (then the same
  trainer runs the stage again), with the final result; a signal nobody listens for ends the process.
- `kill`: run STAGE with a snapshot after every update in FOLDER and SIGKILL this process on that entry.
- `resume`: a new trainer with `resume=True` on FOLDER runs STAGE to its end; the result goes to OUT.

`ddp_cell` is a `launch` target: each of 2 gloo ranks runs the stage named by the DDP_* variables; the rank
DDP_RANK gets the fault on the DDP_OCCURRENCE-th entry into DDP_STATE (an exception, or the signal sent to its
own process); in a fit a SnapshotCallback in DDP_FOLDER listens for the signal, and with DDP_RESUME the run
resumes from it. Rank 0 returns the stage's result and the states it entered.
"""

from __future__ import annotations

import collections
import os
import signal
import sys

import torch
from fault_matrix_setup import FITS, make_trainer, stage_result  # this folder, sys.path[0] as a script

from deepepochs import Preempted

__all__ = ["DDP_VARIABLES", "ddp_cell"]

WORKERS = 2
#: What `ddp_cell` reads: the stage, state, occurrence, fault, faulted rank, snapshot folder, resume flag.
DDP_VARIABLES = ("DDP_STAGE", "DDP_STATE", "DDP_OCCURRENCE", "DDP_FAULT", "DDP_RANK", "DDP_FOLDER", "DDP_RESUME")


class InjectedOnRank(Exception):
    pass


def _foreground_sigint() -> None:
    """SIGINT raises KeyboardInterrupt, as in a job started from a terminal. A suite started in the background
    by a shell (`cmd &`) passes SIGINT on ignored, and Python then installs no handler for it: test and
    predict, which install none either, would not see the signal at all."""
    signal.signal(signal.SIGINT, signal.default_int_handler)


def ddp_cell():
    """One rank of a 2-process DDP cell (see the module's text); rank 0 returns the result and the states."""
    _foreground_sigint()
    stage, state, occurrence, fault, rank, folder, resume = (os.environ.get(name, "") for name in DDP_VARIABLES)
    listened = stage in FITS and fault in ("SIGTERM", "SIGUSR1")
    trainer = make_trainer(folder or None, stage, resume=bool(resume), snapshot_signal=fault if listened else None)
    seen, entered = [0], collections.Counter()

    def probe(dest):
        entered[dest] += 1
        if dest != state or resume or os.environ["RANK"] != rank:
            return
        seen[0] += 1
        if seen[0] != int(occurrence):
            return
        if fault == "exception":
            raise InjectedOnRank(f"injected on rank {rank} entering {state}")
        signal.raise_signal(getattr(signal, fault))

    trainer.machine.probe = probe
    try:
        return {"result": stage_result(trainer, stage), "entered": entered}
    finally:
        trainer.close()


def main() -> None:
    mode, stage, state, occurrence, fault, context, folder, out = sys.argv[1:]
    occurrence = int(occurrence)
    _foreground_sigint()
    # the test process's thread count: BatchNorm's reductions split over threads round otherwise than over one,
    # and the result is compared bit for bit with the uninterrupted run the test process made
    torch.set_num_threads(int(os.environ["MATRIX_THREADS"]))
    if mode == "resume":
        trainer = make_trainer(folder, stage, resume=True, every_n_updates=1)
        torch.save({"outcome": "resumed", "result": stage_result(trainer, stage)}, out)
        return
    if mode == "kill":
        trainer, send = make_trainer(folder, stage, resume=True, every_n_updates=1), None
    else:
        listened = stage in FITS and fault != "SIGINT"
        trainer = make_trainer(folder, stage, snapshot_signal=fault if listened else None)
    seen = [0]

    def probe(dest):
        if dest == state:
            seen[0] += 1
            if seen[0] == occurrence:
                send()

    if mode == "kill":
        def send():
            os.kill(os.getpid(), signal.SIGKILL)
    else:
        def send():
            os.killpg(os.getpgrp(), getattr(signal, fault))

    trainer.machine.probe = probe
    workers = WORKERS if mode == "group" else 0
    try:
        result = stage_result(trainer, stage, workers, context)
        record = {"outcome": "unaffected", "result": result}
    except Preempted as stop:
        record = {"outcome": "preempted", "code": stop.code, "idle": trainer.machine.state == "idle",
                  "snapshot_written": stop.path is not None and stop.path.is_file()}  # (the resume may prune it)
        resumed = make_trainer(folder, stage, resume=True, snapshot_signal=fault)
        record["result"] = stage_result(resumed, stage)
    except KeyboardInterrupt:
        record = {"outcome": "rolled back", "idle": trainer.machine.state == "idle"}
        trainer.machine.probe = None
        record["result"] = stage_result(trainer, stage)
    record["injected"] = seen[0] >= occurrence
    torch.save(record, out)


if __name__ == "__main__":
    main()
