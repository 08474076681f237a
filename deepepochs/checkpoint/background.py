"""Checkpoint files written beside training: the loop waits only for a host copy of the state.

`HostCopy.take` makes a consistent copy of everything a checkpoint holds, in the calling (training) thread: every
tensor copied into host memory (pinned memory on CUDA, the copies made on a side stream and waited for once),
every container and Python value copied, so that the loop may go on changing its model, optimizers and records
while the copy is written. Its memory is kept and reused by the next copy (the same tensors, so the copy is a
plain memory copy, without allocation). `BackgroundWriter` then writes the copy with the same atomic write as a
synchronous save (`write.write_atomic`: a temporary file, `fsync`, `os.replace`) on a thread of its own:

- at most one write is in flight: the next `submit` waits for it first (how long is kept in `waited`), and only
  then copies the state into the memory that write was reading;
- a failed write is kept and given once to `take_failure` (the caller reports it at its next commit point); the
  previous file at that path is untouched, as after any failed atomic write;
- `wait(timeout)` blocks until the write in flight, if any, has ended; the interpreter's exit waits for it too
  (`atexit`, bounded by `EXIT_WAIT_SECONDS`, printing the file's name when it cannot finish); `finish` waits,
  reports and gives the host copy's memory back (at the fit's end, an interruption, `close()`).

A SIGKILL during a background write leaves what a killed synchronous write leaves: the previous file intact and a
temporary file that is never taken for a checkpoint (and is removed by the next save in that folder).
"""

from __future__ import annotations

import atexit
import copy
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from deepepochs.errors import ConfigError, DeepEpochsWarning

__all__ = ["EXIT_WAIT_SECONDS", "BackgroundWriter", "HostCopy", "check_attached", "host_copy"]

#: How long the interpreter's exit waits for a write still in flight before it gives up and names the file.
EXIT_WAIT_SECONDS = 600.0


def host_copy(data: Mapping) -> dict:
    """A copy of `data` that shares nothing with the live objects (`HostCopy.take` into fresh memory)."""
    return HostCopy().take(data)


class HostCopy:
    """Host memory for consecutive copies of a checkpoint's state, kept and reused: the state of one run has the
    same tensors at every commit point, so from the second copy on every tensor goes into the buffer the copy
    before it used (a plain memory copy, no allocation and no page faults: copying 1.2 GB into fresh memory
    costs several times a copy into memory already mapped). A tensor whose shape, strides, dtype or device kind
    changed gets a new buffer. `take` overwrites the previous copy: its caller must be done with it."""

    def __init__(self):
        self._buffers: list[tuple[tuple, torch.Tensor]] = []

    def take(self, data: Mapping) -> dict:
        """A copy of `data` that shares nothing with the live objects: tensors copied to host memory (storage
        sharing between tensors kept), every container and value deep-copied. On CUDA the copies go to pinned
        memory on a side stream, with one synchronisation for the whole state."""
        memo: dict = {}
        cuda, buffers, free = [], [], {}
        for key, buffer in reversed(self._buffers):  # by kind, in the order of the copy before
            free.setdefault(key, []).append(buffer)
        for tensor in _tensors(data):
            if id(tensor) in memo:
                continue
            source = tensor.detach()
            if source.layout != torch.strided or source.is_quantized:
                memo[id(tensor)] = source.to("cpu", copy=True)  # rare kinds: a fresh copy each time
                continue
            key = (source.dtype, tuple(source.shape), source.stride(), source.device.type == "cuda")
            spare = free.get(key)
            target = spare.pop() if spare else torch.empty_like(source, device="cpu", pin_memory=key[3])
            buffers.append((key, target))
            if key[3]:
                cuda.append((source, target))
            else:
                target.copy_(source)
            memo[id(tensor)] = target
        self._buffers = buffers
        if cuda:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())  # the copies see every update the loop queued before
            with torch.cuda.stream(stream):
                for source, target in cuda:
                    target.copy_(source, non_blocking=True)
            stream.synchronize()  # the one synchronisation of the snapshot
        return copy.deepcopy(dict(data), memo)

    def release(self) -> None:
        """Give the host memory back (the next `take` allocates afresh)."""
        self._buffers = []


def _tensors(value):
    """Every tensor inside `value` (dicts, lists, tuples, sets and attrs-free plain containers)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)


def check_attached(owner: str, writer, trainer) -> None:
    """Refuse `owner`'s background writes (`writer` not None) on a trainer whose ranks write shards (FSDP)."""
    if writer is not None and trainer.dist.shards_model:
        raise ConfigError(f"{owner} async_write=True writes one checkpoint file in the background; under"
                          " strategy='fsdp' every rank writes its shards: leave async_write=False there")


class BackgroundWriter:
    """Writes one checkpoint at a time on a background thread (see the module doc).

    Args:
        write: `write(data, path)`, the synchronous write (`write.write_atomic`).
    """

    def __init__(self, write: Callable[[Mapping, Path], object]):
        self._write = write
        self._thread: threading.Thread | None = None
        self._path: Path | None = None
        self._failure: tuple[Path, BaseException] | None = None
        self.waited = 0.0  # seconds the last `submit` waited for the write before it
        self.writes = 0  # writes ended (done or failed)
        self._copy = HostCopy()
        _LIVE.add(self)

    @property
    def in_flight(self) -> Path | None:
        """The file being written now, or None."""
        thread = self._thread
        return self._path if thread is not None and thread.is_alive() else None

    def submit(self, data: Mapping, path, after: Callable[[Path], None] | None = None) -> float:
        """Write a copy of `data` (the live state) to `path` in the background: once the write in flight has
        ended, `data` is copied into this writer's host memory (`HostCopy`, reused from the copy before) in the
        calling thread, and the copy written by a thread of its own; `after(path)` runs on that thread once the
        file is complete (pruning older files). Returns the seconds waited for the write before."""
        start = time.monotonic()
        self.wait()
        self.waited = time.monotonic() - start
        copied = self._copy.take(data)  # only now: the write before may have been reading the same memory
        path = Path(path)
        self._path = path
        self._thread = threading.Thread(target=self._run, args=(copied, path, after), daemon=True,
                                        name=f"deepepochs-write {path.name}")
        self._thread.start()
        return self.waited

    def _run(self, data: Mapping, path: Path, after) -> None:
        try:
            self._write(data, path)
            if after is not None:
                after(path)
        except BaseException as e:  # kept for the training thread, never raised here
            self._failure = (path, e)
        finally:
            self.writes += 1

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the write in flight (if any) has ended, at most `timeout` seconds; True when none is left."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                return False
            self._thread = None
        return True

    def take_failure(self) -> tuple[Path, BaseException] | None:
        """(path, error) of a background write that failed since the last call, or None; given once."""
        failure, self._failure = self._failure, None
        return failure

    def report(self, owner: str) -> None:
        """Warn once, in `owner`'s name, of a background write that failed since the last report."""
        failure = self.take_failure()
        if failure is not None:
            path, error = failure
            warnings.warn(f"{owner}: the background write of checkpoint {path} failed ({error}); the files before"
                          " it are intact and training goes on", DeepEpochsWarning, stacklevel=3)

    def finish(self, owner: str, timeout: float = EXIT_WAIT_SECONDS) -> bool:
        """Wait for the write in flight, if any (at most `timeout` seconds), then `report` and give the host
        copy's memory back; True when none is left. A write that does not end in time is named in a warning."""
        path = self.in_flight
        done = self.wait(timeout)
        if not done:
            warnings.warn(f"{owner}: the background write of checkpoint {path} did not end within {timeout:.0f} s;"
                          " the previous file is intact", DeepEpochsWarning, stacklevel=3)
        self._copy.release()  # a write still running keeps its copy alive until it ends
        self.report(owner)
        return done


_LIVE: weakref.WeakSet[BackgroundWriter] = weakref.WeakSet()


@atexit.register
def _wait_at_exit() -> None:
    """The interpreter's exit waits for every write still in flight (daemon threads would be cut off)."""
    deadline = time.monotonic() + EXIT_WAIT_SECONDS
    for writer in list(_LIVE):
        path = writer.in_flight
        if path is not None and not writer.wait(max(0.0, deadline - time.monotonic())):
            print(f"deepepochs: the background write of checkpoint {path} did not end within {EXIT_WAIT_SECONDS:.0f}"
                  " s of the interpreter's exit; it is left unfinished (the previous checkpoint is intact)",
                  file=sys.stderr, flush=True)
