"""Checkpoint files written beside training: the loop waits only for a host copy of the state.

`host_copy` makes a consistent copy of everything a checkpoint holds, in the calling (training) thread: every
tensor copied into host memory (pinned memory on CUDA, the copies made on a side stream and waited for once),
every container and Python value copied, so that the loop may go on changing its model, optimizers and records
while the copy is written. `BackgroundWriter` then writes the copy with the same atomic write as a synchronous
save (`write.write_atomic`: a temporary file, `fsync`, `os.replace`) on a thread of its own:

- at most one write is in flight: the next `submit` waits for it first (how long is kept in `waited`);
- a failed write is kept and given once to `take_failure` (the caller reports it at its next commit point); the
  previous file at that path is untouched, as after any failed atomic write;
- `wait(timeout)` blocks until the write in flight, if any, has ended; the interpreter's exit waits for it too
  (`atexit`, bounded by `EXIT_WAIT_SECONDS`, printing the file's name when it cannot finish).

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

__all__ = ["EXIT_WAIT_SECONDS", "BackgroundWriter", "check_attached", "host_copy"]

#: How long the interpreter's exit waits for a write still in flight before it gives up and names the file.
EXIT_WAIT_SECONDS = 600.0


def host_copy(data: Mapping) -> dict:
    """A copy of `data` that shares nothing with the live objects: tensors copied to host memory (storage
    sharing between tensors kept), every container and value deep-copied. On CUDA the copies go to pinned
    memory on a side stream, with one synchronisation for the whole state."""
    memo: dict = {}
    cuda = []
    for tensor in _tensors(data):
        if id(tensor) in memo:
            continue
        source = tensor.detach()
        if source.device.type == "cuda":
            target = torch.empty_like(source, device="cpu", pin_memory=True)
            cuda.append((source, target))
        else:
            target = source.clone()
        memo[id(tensor)] = target
    if cuda:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # the copies see every update the loop queued before
        with torch.cuda.stream(stream):
            for source, target in cuda:
                target.copy_(source, non_blocking=True)
        stream.synchronize()  # the one synchronisation of the snapshot
    return copy.deepcopy(dict(data), memo)


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
        _LIVE.add(self)

    @property
    def in_flight(self) -> Path | None:
        """The file being written now, or None."""
        thread = self._thread
        return self._path if thread is not None and thread.is_alive() else None

    def submit(self, data: Mapping, path, after: Callable[[Path], None] | None = None) -> float:
        """Write `data` (a `host_copy`, which nothing else changes) to `path` in the background, once the write in
        flight has ended; `after(path)` runs on the writer's thread once the file is complete (pruning older
        files). Returns the seconds waited for the write before."""
        start = time.monotonic()
        self.wait()
        self.waited = time.monotonic() - start
        path = Path(path)
        self._path = path
        self._thread = threading.Thread(target=self._run, args=(data, path, after), daemon=True,
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
        """Wait for the write in flight, if any (at most `timeout` seconds), then `report`; True when none is
        left. A write that does not end in time is named in a warning."""
        path = self.in_flight
        done = self.wait(timeout)
        if not done:
            warnings.warn(f"{owner}: the background write of checkpoint {path} did not end within {timeout:.0f} s;"
                          " the previous file is intact", DeepEpochsWarning, stacklevel=3)
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
