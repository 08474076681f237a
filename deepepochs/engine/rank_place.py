"""A rank's place in the loop, as its peers read it from its heartbeat (`deepepochs.parallel.heartbeat`): the
machine's state, the stage, the 1-based epoch, the update, the 1-based batch, and what the thread running the loop
is in, a callback or a collective (or the agreement on the ranks' paths), and the path it took since the ranks
last agreed (`LoopMachine.path`).

Nothing here runs per batch. The heartbeat thread calls `reader(ctx, driver)()` every beat: it reads the counters
the loop keeps anyway and looks at the training thread's Python stack (`sys._current_frames`) for a callback
(the frame `emit` called) and a collective (a frame of `torch.distributed`, named by the deepepochs function
that issued it; a DDP backward that all-reduces gradients; DDP's own sync before a forward). On a collective's
failure, `failure_place` reads the same from the traceback, before the rollback moves the loop.

`update`: in training, the 1-based update the rank works toward (committed updates + 1); elsewhere the updates
committed so far.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

from deepepochs.engine.context import Context
from deepepochs.engine.emit import emit

__all__ = ["COLLECTIVE_WORDS", "agree", "failure_place", "place", "reader", "task_end"]

#: The collectives deepepochs issues, by the function that issues them, in the loop's words.
COLLECTIVE_WORDS = {
    "global_sum": "sample-count all-reduce",
    "all_have": "end-of-shard agreement",
    "reduce_sum": "loss-sum all-reduce",
    "sync_patches": "metric exchange",
    "merge_on_root": "metric exchange",
    "check_batch_counts": "batch-count check",
    "prepare_dataloader": "batch-count exchange",
    "sync_eval_buffers": "buffer broadcast",
    "broadcast_model": "parameter broadcast",
    "broadcast_object": "object broadcast",
    "all_gather_object": "object exchange",
    "_barrier": "barrier",
}

_BACKWARD = ("_engine_run_backward", "run_backward")
# DDP's own collectives before a training forward (the buckets rebuilt at the second iteration, the buffers'
# broadcast), issued from C++ under these functions of torch/nn/parallel/distributed.py.
_DDP_FORWARD_SYNC = ("_pre_forward", "_sync_buffers")


def _activity(codes: list, grad_sync: bool) -> tuple[str | None, str | None]:
    """(callback, collective) of a stack given as code objects, outermost first."""
    callback = collective = None
    ours = None  # the innermost deepepochs function seen so far
    for index, code in enumerate(codes):
        name = code.co_filename.replace("\\", "/")
        if code is emit.__code__ and index + 1 < len(codes):
            callee = codes[index + 1]
            callback = getattr(callee, "co_qualname", callee.co_name)
        elif "/deepepochs/" in name:
            ours = code.co_name
        elif name.endswith("distributed_c10d.py") and collective is None:
            collective = COLLECTIVE_WORDS.get(ours) or f"{code.co_name} (from {ours or 'user code'})"
        elif code.co_name in _BACKWARD and "/torch/autograd/" in name and grad_sync and collective is None:
            collective = "gradient all-reduce"
        elif code.co_name in _DDP_FORWARD_SYNC and name.endswith("nn/parallel/distributed.py") and collective is None:
            collective = "DDP forward sync"
    return callback, collective


def place(ctx: Context, codes: list) -> dict:
    """The place of the loop `ctx` runs, with `codes` the running thread's stack (code objects, outermost
    first; empty when no fit/test runs)."""
    loop = ctx.loop
    grad_sync = bool(getattr(ctx.parts.train_model, "require_backward_grad_sync", False))
    callback, collective = _activity(codes, grad_sync)
    stage = loop.stage
    machine = ctx.machine
    if machine.waiting_at is not None:
        collective = f"path agreement at {machine.waiting_at}"
    return {"state": machine.state, "stage": stage, "epoch": loop.epoch,
            "update": ctx.run.updates + (stage == "train"), "batch": loop.batch_idx, "collective": collective,
            "callback": callback, "stop": loop.stop.reason if loop.stop is not None else None, "path": machine.path()}


def reader(ctx: Context, driver) -> Callable[[], dict]:
    """A function the heartbeat thread calls for this rank's place now (`driver.running_thread` runs the loop)."""
    def read() -> dict:
        thread = driver.running_thread
        frame = sys._current_frames().get(thread.ident) if thread is not None else None
        codes = []
        while frame is not None:
            codes.append(frame.f_code)
            frame = frame.f_back
        return place(ctx, codes[::-1])
    return read


def failure_place(ctx: Context, exc: BaseException) -> dict | None:
    """The place where `exc` was raised (its traceback's stack), read before the rollback moves the loop; None
    if it cannot be read (it only words an error: it must never replace the error being handled)."""
    try:
        return place(ctx, [frame.f_code for frame, _ in traceback.walk_tb(exc.__traceback__)])
    except Exception:  # noqa: BLE001 (see the docstring)
        return None


_STAGE_WORDS = {"train": "training", "val": "validation", "test": "test"}


def task_end(stage: str, index: int, epoch: int) -> str:
    """The agreement point at the end of a task, in words: 'the end of validation task 1 of epoch 2'."""
    of_epoch = f" of epoch {epoch}" if stage != "test" else ""
    return f"the end of {_STAGE_WORDS[stage]} task {index + 1}{of_epoch}"


def agree(ctx: Context, point: str) -> None:
    """Under DDP, compare the ranks' paths since their last agreement at `point`, a place of the loop every rank
    passes (a task's end, before its collectives; the fit's end): this rank waits there for its peers, and
    `DesyncError` is raised when the paths parted (`DistPolicy.agree_paths`), e.g. a stop requested on one rank
    only, or a longer evaluation shard while a peer's code still issues collectives in it, instead of meeting
    in a collective that does not match. One process does nothing."""
    dist = ctx.parts.dist
    if dist.world_size == 1:
        return
    machine = ctx.machine
    machine.waiting_at = point
    try:
        dist.agree_paths(place(ctx, []))
    finally:
        machine.waiting_at = None
    machine.agreed()
