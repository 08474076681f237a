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

The lock file is untrusted input: it is never opened through a symbolic link, a lock file that cannot be
locked (a symbolic or hard link, a directory, a file this user cannot write) stops the fit with
`RunLockedError` naming it (a fit never trains unlocked), and its holder record is read with a size and
nesting bound, anything malformed naming an unknown holder. `resume=True` without a `running_id` moves the
lock to the run whose files it reads (`lock_resumed_run`).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import socket
import stat
import time
import weakref
from pathlib import Path

from deepepochs.checkpoint.find import find_checkpoints, resume_scope
from deepepochs.checkpoint.format import monitors_of
from deepepochs.checkpoint.write import _alive
from deepepochs.errors import RunLockedError

try:
    import fcntl
except ImportError:  # Windows: no flock; Trainer(run_lock='error' or 'wait') says so
    fcntl = None

__all__ = ["LOCK_FILE", "POLL_SECONDS", "RECORD_BYTES", "RunLock", "hold_run", "lock_resumed_run", "run_folders"]

#: The lock file in each run folder.
LOCK_FILE = "run.lock"
#: How often a fit waiting for a run (`run_lock='wait'`) tries again, in seconds.
POLL_SECONDS = 1.0
#: The most of a lock file read for its holder record (a record deepepochs writes is about 150 bytes).
RECORD_BYTES = 4096
#: The largest pid a holder record may name (pid_t is a signed 32-bit integer).
_PID_LIMIT = 2**31 - 1
#: How the lock file is opened: never through a symbolic link, never blocking (a FIFO in its place), never
#: inherited by a program the fit starts.
_OPEN_FLAGS = (os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_CLOEXEC", 0))
#: The lock each fitting trainer holds and whether it waits (`hold_run`), for `lock_resumed_run`.
_FITTING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
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


def run_folders(trainer, run: str | None = None) -> tuple[str, list[Path]]:
    """The run a fit of `trainer` will train and the folders it writes: `<ckpt_dir>/<run>` of each checkpoint
    monitor and `<log_dir>/<run>` of each logging callback (a callback with a `log_dir`), once each. The run
    is `run` when given, else a pending `resume=...`'s (the named run, or with `resume=True` and no
    `running_id` the run of the most progressed checkpoint found, which `lock_resumed_run` moves the lock
    from when the resume loads another run's file), else `trainer.running_id`."""
    roots = [m.ckpt_dir for m in monitors_of(trainer)]
    if run is None:
        run = str(trainer.running_id)
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


def _nesting(text: str) -> int:
    """How deeply the JSON `text` nests arrays and objects (brackets inside strings do not count)."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _read_info(fd: int) -> dict | None:
    """The holder record of an open lock file, or None when it is empty or malformed (an unknown holder).

    The file is untrusted: at most `RECORD_BYTES` are read, a record nesting anything is refused before it
    is parsed, and only a flat record whose pid a process can have (1 to 2**31-1) and whose host, start
    time and run are text counts."""
    data = os.pread(fd, RECORD_BYTES + 1, 0)
    if len(data) > RECORD_BYTES:
        return None
    try:
        text = data.decode()
        info = json.loads(text) if _nesting(text) == 1 else None
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(info, dict):
        return None
    pid = info.get("pid")
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid <= _PID_LIMIT:
        return None
    if not isinstance(info.get("host"), str):
        return None
    if any(key in info and not isinstance(info[key], str) for key in ("since", "running_id")):
        return None
    return info


def _open_lock_file(folder: Path, path: Path) -> int:
    """Open (create) the lock file `path` for locking, or raise `RunLockedError` naming it and what is wrong
    (a symbolic link, which is never followed; a hard link; a directory or other non-file; not writable by
    this user):
    a lock that cannot be taken is never trained past. FileNotFoundError: the folder vanished (retry)."""
    def refuse(what: str) -> RunLockedError:
        return RunLockedError(f"cannot lock the run folder {folder}: its lock file {path} {what}; remove or fix it,"
                              " or pass Trainer(run_lock='off') to train without the lock (then make sure one"
                              " process trains the run)")

    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise RunLockedError(f"cannot lock the run folder {folder}: the folder cannot be made ({e.strerror or e});"
                             " the fit could write nothing there") from e
    try:
        fd = os.open(path, _OPEN_FLAGS, 0o644)
    except FileNotFoundError:
        raise
    except OSError as e:
        if path.is_symlink():
            raise refuse("is a symbolic link, which a lock file is never allowed to be") from e
        if path.is_dir():
            raise refuse("is a directory") from e
        if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise refuse(f"cannot be opened for writing by this user ({e.strerror})") from e
        raise refuse(f"cannot be opened ({e.strerror or e})") from e
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise refuse("is not a regular file")
    if info.st_nlink > 1:  # a hard link is another name of someone's file, which the lock record would overwrite
        os.close(fd)
        raise refuse(f"has {info.st_nlink} links (a hard link to another file), which a lock file is never allowed"
                     " to have")
    return fd


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
                fd = _open_lock_file(folder, path)
            except FileNotFoundError:
                continue  # the folder's last holder removed it just now: make it again
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    info = _read_info(fd)
                finally:
                    os.close(fd)
                return _holder_text(info, path), None
            except OSError as e:
                os.close(fd)
                raise RunLockedError(f"cannot lock the run folder {folder} ({e}): this file system does not support"
                                     " flock; pass Trainer(run_lock='off') to train without the lock") from e
            try:
                try:
                    same = os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
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
            except BaseException:
                os.close(fd)  # never keep a lock this fit does not hold on to
                raise
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
    outcome (one small broadcast per try). A resume in the block that loads another run moves the lock
    there first (`lock_resumed_run`)."""
    if mode == "off":
        yield None
        return
    _FITTING[trainer] = (_acquire(trainer, mode == "wait"), mode == "wait")
    try:
        yield _FITTING[trainer][0]
    finally:
        lock, _ = _FITTING.pop(trainer)
        lock.release()


def lock_resumed_run(trainer, run: str) -> None:
    """Before a resume of `trainer`'s fit reads run `run`'s checkpoints (or starts `run` fresh), make that the
    run the fit holds locked: release the run locked so far (`resume=True` without a `running_id` first locks
    the newest run, whose files may turn out unusable) and lock `run` as the fit's mode says, raising
    `RunLockedError` when another process trains it. A no-op outside a locked fit (a test, a predict,
    `run_lock='off'`) or when `run` is locked already. Every rank calls it alike (a collective under DDP)."""
    held = _FITTING.get(trainer)
    if held is None or held[0].running_id == run:
        return
    lock, wait = held
    lock.release()
    _FITTING[trainer] = (RunLock([], run), wait)  # nothing held, should the new lock be refused
    _FITTING[trainer] = (_acquire(trainer, wait, run), wait)


def _acquire(trainer, wait: bool, run: str | None = None) -> RunLock:
    """Lock the run folders (of `run`, default `run_folders`'s) on rank 0, trying until they are free when
    `wait`; every rank returns the lock (holding files on rank 0 only, naming the run everywhere) or raises
    `RunLockedError`."""
    dist, console = trainer.dist, trainer.console
    run, folders = run_folders(trainer, run) if dist.is_main else (run, [])
    lock = RunLock(folders, run)
    waiting = False
    while True:
        status, detail, run = dist.broadcast_object((*(_try(lock) if folders else ("ok", [])), run))
        lock.running_id = run
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
