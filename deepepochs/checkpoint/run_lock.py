"""One run, one writer: the lock a `fit` holds on its run's folders.

Two live processes training the same run (the same `running_id` under the same `ckpt_dir` or `log_dir`, e.g.
a requeued SLURM job that starts while its predecessor still runs) would write into the same folders and
overwrite each other's checkpoints. So `fit` locks every folder it writes, `<ckpt_dir>/<running_id>` of each
checkpoint monitor and `<log_dir>/<running_id>` of each logging callback, before a pending `resume=...`
reads them and until the fit ends (returns, fails or is preempted); `test`, `predict` and `find_lr` take no
lock (they write no checkpoint).

The lock is the operating system's advisory lock (`fcntl.flock`) on a file `run.lock` in each folder, which
also holds its holder's pid, host and start time for the messages. The kernel releases it when its holder
dies, SIGKILL included, so the file a killed holder leaves is found unlocked: the next fit takes it over and
says whose it was. A released lock's file is removed. On a shared file system another host's lock counts
only if that file system passes `flock` locks between hosts (NFSv4, GPFS, BeeGFS and Lustre mounted with
`flock` do; Lustre's `localflock` does not): a lock file no process holds is taken over, whichever host
wrote it. Under DDP rank 0 (the process that writes) takes the lock and the ranks agree on the outcome.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import time
from pathlib import Path

from deepepochs.checkpoint.find import find_checkpoints, resume_scope
from deepepochs.checkpoint.format import monitors_of
from deepepochs.checkpoint.write import _alive
from deepepochs.errors import RunLockedError

try:
    import fcntl
except ImportError:  # Windows: no flock; Trainer(run_lock='error' or 'wait') says so
    fcntl = None

__all__ = ["LOCK_FILE", "POLL_SECONDS", "RunLock", "hold_run", "run_folders"]

#: The lock file in each run folder.
LOCK_FILE = "run.lock"
#: How often a fit waiting for a run (`run_lock='wait'`) tries again, in seconds.
POLL_SECONDS = 1.0
#: File descriptors of the locks this process holds: closed in a forked child (a DataLoader worker), which
#: would otherwise keep a lock alive after its parent was killed.
_HELD: set[int] = set()


def _close_held_in_child() -> None:
    for fd in _HELD:
        try:
            os.close(fd)  # not flock(LOCK_UN): that would release the parent's lock too
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_held_in_child)


def run_folders(trainer) -> tuple[str, list[Path]]:
    """The run a fit of `trainer` will train and the folders it writes: `<ckpt_dir>/<run>` of each checkpoint
    monitor and `<log_dir>/<run>` of each logging callback (a callback with a `log_dir`), once each. The run
    is a pending `resume=...`'s (the named run, or with `resume=True` and no `running_id` the run of the most
    progressed checkpoint found), else `trainer.running_id`."""
    run = str(trainer.running_id)
    roots = [m.ckpt_dir for m in monitors_of(trainer)]
    if trainer.loop.resume_pending:
        named, _, _ = resume_scope(trainer)
        found = [] if named is not None else find_checkpoints(roots, None)
        run = named if named is not None else found[0].parent.name if found else run
    roots += [cb.log_dir for cb in trainer.callbacks if isinstance(getattr(cb, "log_dir", None), (str, os.PathLike))]
    folders = {os.path.abspath(os.path.join(os.fspath(root), run)): None for root in roots}
    return run, [Path(f) for f in sorted(folders)]  # one order everywhere: two waiting fits cannot deadlock


def _holder_text(info: dict | None, path: Path) -> str:
    """Who `info` (a lock file's contents) names, for the messages."""
    if not info:
        return f"an unknown process (its lock file {path} names none)"
    pid, host = info.get("pid"), info.get("host")
    here = host == socket.gethostname()
    gone = " (no longer running here: a process it started may still hold the file open)" if (
        here and isinstance(pid, int) and not _alive(pid)) else ""
    return f"pid {pid} on host {host}{gone}, since {info.get('since')}, lock file {path}"


def _read_info(fd: int) -> dict | None:
    """The holder record of an open lock file, or None (empty or not ours)."""
    os.lseek(fd, 0, os.SEEK_SET)
    data = os.read(fd, 4096)
    try:
        info = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError):
        return None
    return info if isinstance(info, dict) else None


class RunLock:
    """The locks of one fit on its run folders (see the module docstring).

    Args:
        folders: the run folders, in the order they are locked.
        running_id: the run's name, written into the lock files.
    """

    def __init__(self, folders, running_id: str):
        self.folders = [Path(f) for f in folders]
        self.running_id = running_id
        self._held: list[tuple[Path, int, bool]] = []  # (lock file, descriptor, whether the folder was made)

    def try_acquire(self) -> tuple[str | None, list[str]]:
        """Lock every folder without waiting: (None, messages about locks taken over from dead holders) when
        all are locked, or (the busy lock's holder, []) with none kept."""
        taken_over = []
        for folder in self.folders:
            busy, previous = self._try_folder(folder)
            if busy is not None:
                self.release()
                return busy, []
            if previous is not None:
                taken_over.append(f"took over the run lock {folder / LOCK_FILE} of run {self.running_id!r}, left by"
                                  f" pid {previous.get('pid')} on host {previous.get('host')} (holding it since"
                                  f" {previous.get('since')}), which ended without releasing it")
        return None, taken_over

    def _try_folder(self, folder: Path) -> tuple[str | None, dict | None]:
        """Lock one folder: (holder text, None) when another process holds it, else (None, the record a
        dead holder left or None)."""
        path = folder / LOCK_FILE
        for _attempt in range(100):  # each retry follows a release by another process: a few at most
            made = not folder.exists()
            try:
                folder.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            except FileNotFoundError:
                continue  # the folder's last holder removed it just now: make it again
            except OSError:
                # A folder this process cannot make or write (a file in its place, no permission): nothing can
                # be written there, and the fit's first save says so, naming it; there is nothing to lock.
                return None, None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                info = _read_info(fd)
                os.close(fd)
                return _holder_text(info, path), None
            except OSError as e:
                os.close(fd)
                raise RunLockedError(f"cannot lock the run folder {folder} ({e}): this file system does not support"
                                     " flock; pass Trainer(run_lock='off') to train without the lock") from e
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # its holder released and removed it between our open and our lock: lock the new one
                os.close(fd)
                continue
            previous = _read_info(fd)
            record = {"pid": os.getpid(), "host": socket.gethostname(), "running_id": self.running_id,
                      "since": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
            self._held.append((path, fd, made))
            _HELD.add(fd)
            return None, previous
        raise RunLockedError(f"could not lock the run folder {folder}: its lock file {path} kept being removed while"
                             " this process locked it; is another program deleting it?")

    def release(self) -> None:
        """Remove and unlock every lock file held (removed first: a process that opened it meanwhile sees
        the file it locked is gone and locks a new one), and the folders the lock made if still empty."""
        held, self._held = self._held, []
        for path, fd, made in reversed(held):
            try:
                path.unlink()
            except OSError:
                pass
            _HELD.discard(fd)
            os.close(fd)  # closing the last descriptor releases the lock
            if made:
                try:
                    path.parent.rmdir()  # nothing was written there (a fit that failed before its first file)
                except OSError:
                    pass


@contextlib.contextmanager
def hold_run(trainer, mode: str):
    """Context: lock the run folders of `trainer`'s fit (`run_folders`) for the block, as `mode` says:
    'error' raises `RunLockedError` naming the holder when another live process holds one, 'wait' waits for
    it (trying every `POLL_SECONDS`), 'off' locks nothing. Under DDP rank 0 locks and every rank gets the
    outcome (one small broadcast per try)."""
    lock = None if mode == "off" else _acquire(trainer, mode == "wait")
    try:
        yield lock
    finally:
        if lock is not None:
            lock.release()


def _acquire(trainer, wait: bool) -> RunLock:
    """Lock the run folders on rank 0, trying until they are free when `wait`; every rank returns the lock
    (holding files on rank 0 only) or raises `RunLockedError`."""
    dist, console = trainer.dist, trainer.console
    run, folders = run_folders(trainer) if dist.is_main else (None, [])
    lock = RunLock(folders, run)
    waiting = False
    while True:
        status, detail, run = dist.broadcast_object((*(_try(lock) if folders else ("ok", [])), run))
        if status == "ok":
            for line in detail:
                console.decision(f"deepepochs: {line}")
            return lock
        if status == "failed":
            raise RunLockedError(detail)
        if not wait:
            raise RunLockedError(f"run {run!r} is being trained by another process: {detail}; wait for it"
                                 " to end (or stop it), or pass Trainer(run_lock='wait') to wait for it")
        if not waiting:
            waiting = True
            console.decision(f"deepepochs: waiting for run {run!r}, which another process trains: {detail}")
        time.sleep(POLL_SECONDS)


def _try(lock: RunLock) -> tuple[str, object]:
    """Rank 0's try, as something every rank can be sent: ('ok', messages), ('busy', holder) or
    ('failed', why)."""
    if fcntl is None:
        return "failed", "this platform has no flock, which the run lock needs; pass Trainer(run_lock='off')"
    try:
        busy, taken_over = lock.try_acquire()
    except (RunLockedError, OSError) as e:
        lock.release()  # the folders locked before the one that failed
        return "failed", str(e)
    return ("busy", busy) if busy is not None else ("ok", taken_over)
