"""`SnapshotCallback`: snapshots at commit points, mid-epoch, and a clean stop on preemption signals.

The callback decides when; the machine does the rest (`deepepochs.engine.snapshot_trigger`): at every commit
point (a committed window's update, an epoch's end) the spec's `snapshot` trigger asks it whether a
snapshot is due and whether a signal arrived; the `save_snapshot` action calls `write_snapshot`, and on a
signal `stop_on_signal` ends the fit with `deepepochs.Preempted`. A snapshot is a checkpoint file
(`deepepochs.checkpoint`) with the data position inside the epoch; `Trainer(resume=True)` continues from
the most progressed snapshot or checkpoint, mid-epoch included.
"""

from __future__ import annotations

import math
import numbers
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path

from deepepochs import checkpoint, torch_private
from deepepochs.callbacks.base import Callback
from deepepochs.checkpoint import background
from deepepochs.errors import ConfigError, DeepEpochsWarning, Preempted
from deepepochs.parallel import slurm

__all__ = ["SnapshotCallback"]

_DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
_UNCATCHABLE = {"SIGKILL", "SIGSTOP"}
# Signals a process receives for what it did itself (a fault in native code, abort()) or for its children:
# a Python handler only runs between bytecodes, so after a native fault the process would retry the
# faulting instruction forever instead of dying; a child's exit is no preemption.
_SYNCHRONOUS = {"SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGTRAP", "SIGSYS", "SIGEMT", "SIGIOT"}
_CHILD = {"SIGCHLD", "SIGCLD"}


class SnapshotCallback(Callback):
    """Write snapshots at commit points (mid-epoch included) and stop cleanly on preemption signals.

    A snapshot holds the model, optimizers, schedulers, GradScaler, the checkpoint monitors' states, the
    data position inside the epoch, the task meters (so the epoch's metrics cover the batches before a
    resume) and every rank's random generator states. Files go to
    `<ckpt_dir>/<running_id>/snapshot-u<updates>[-epoch<n>].ckpt`, written atomically by rank 0 (under
    FSDP sharded checkpoint folders of that name, each rank writing its shards); the `keep` most progressed are
    kept. A snapshot is also written at every epoch's end.

    Args:
        ckpt_dir: root folder (shared with `CheckCallback`: `resume=True` searches both).
        every_n_updates: write when the run's committed update windows reach a multiple of n (skipped
            windows count: each is a commit point), counted over the run across epoch ends (each writes one
            too) and resumes, so a refit after an interruption or a resumed run writes the files the
            uninterrupted run writes; None: not by count.
        every_n_minutes: write at the first commit point once this many minutes passed since the last
            snapshot (agreed over the ranks under DDP); None: not by time.
        on_signals: signal names (or numbers) that stop the fit: the update in progress completes, a snapshot
            is written, and `fit` raises `deepepochs.Preempted` (a `SystemExit` with exit status
            `exit_code`). Under DDP a signal reaching any rank stops every rank at the same commit point
            (one small all-reduce per commit point while signals are armed). SIGINT (Ctrl-C) is not
            accepted here: it already rolls back to the last commit point. Signals are armed during `fit`
            only, in the main thread; the previous handlers are put back when `fit` ends, after its end
            hooks: a signal arriving after the last commit point (while the last snapshot is written, in
            `on_after_fit`) still ends `fit` with `Preempted` (the last snapshot holds everything), and one
            arriving later goes to the previous handler. Signals sent for the process's own faults
            (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, ...) and SIGCHLD are refused. The defaults absent on
            this platform (SIGUSR1 on Windows) are left out. A scheduler signals the whole job, DataLoader
            workers included: a worker killed by a listed signal counts as that signal arriving (not as a
            data error), and once a signal arrived the fit fetches no further batch; in an accumulation
            window still open then, its micro-batches are dropped and the snapshot is the last commit
            point's (see `deepepochs.engine.snapshot_trigger`).
        keep: how many snapshot files to keep (the most progressed: completed epochs, then updates). The file
            pruned is hidden (`checkpoint.retire`) and the next snapshot written over it, reusing its disk blocks;
            it is removed when the fit ends.
        exit_code: the exit status of `Preempted`; None: 128 + the signal's number (143 for SIGTERM), what
            a shell reports for a process ended by that signal.
        async_write: write each snapshot beside training: at the commit point the loop waits only for a copy of
            the state in host memory (pinned on CUDA), and a background thread writes the file (the same atomic
            write: complete or absent). At most one write is in flight; a snapshot due meanwhile waits for it
            (`waited_seconds` sums those waits). The snapshot a signal asks for is written after the one in
            flight, and the fit stops once both are on disk; the fit's end, an interruption, `close()` and the
            interpreter's exit wait for the write. A failed background write is reported once, as a warning at
            the next commit point (or the fit's end), and training goes on from the previous snapshot's
            safety. Costs one extra host copy of the state, kept from the fit's first snapshot to its end (every
            snapshot copies into it: a memory copy, without allocating). Not under
            `strategy='fsdp'` (refused when attached).
        requeue: in a SLURM job, ask SLURM to requeue it (`scontrol requeue $SLURM_JOB_ID`, from rank 0)
            once a signal stopped the fit and its snapshot is written, so that the same sbatch script runs
            again and `resume=True` continues; a failed requeue is reported on stderr and `Preempted` is
            raised all the same. Outside a SLURM job (no `SLURM_JOB_ID`) it is refused.

    Example:
        >>> snap = SnapshotCallback(every_n_minutes=30)            # and on SIGTERM / SIGUSR1
        >>> trainer = Trainer(model, loss, opt, epochs=100, callbacks=[snap], resume=True)
        >>> trainer.fit(train_dl, val_dl)   # requeued after preemption, it continues mid-epoch
    """

    monitor_id = "snapshot"  # its state (the update count) travels in every checkpoint; resume searches ckpt_dir

    def __init__(self, ckpt_dir="./checkpoints", every_n_updates: int | None = None,
                 every_n_minutes: float | None = None, on_signals=_DEFAULT_SIGNALS, keep: int = 2,
                 exit_code: int | None = None, requeue: bool = False, async_write: bool = False):
        super().__init__()
        if not isinstance(async_write, bool):
            raise ConfigError(f"SnapshotCallback async_write must be True or False (got {async_write!r})")
        if not isinstance(requeue, bool):
            raise ConfigError(f"SnapshotCallback requeue must be True or False (got {requeue!r})")
        if requeue and not slurm.in_slurm_job():
            raise ConfigError("SnapshotCallback requeue=True requeues a SLURM job, but this process runs outside"
                              " one (SLURM_JOB_ID is not set); start it with sbatch, or leave requeue=False")
        if every_n_updates is not None and (isinstance(every_n_updates, bool)
                                            or not isinstance(every_n_updates, int) or every_n_updates < 1):
            raise ConfigError(f"SnapshotCallback every_n_updates must be None or an int >= 1 (got"
                              f" {every_n_updates!r})")
        if every_n_minutes is not None and (isinstance(every_n_minutes, bool)
                                            or not isinstance(every_n_minutes, numbers.Real)
                                            or not math.isfinite(every_n_minutes) or every_n_minutes <= 0):
            raise ConfigError(f"SnapshotCallback every_n_minutes must be None or a positive number (got"
                              f" {every_n_minutes!r})")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ConfigError(f"SnapshotCallback keep must be an int >= 1 (got {keep!r})")
        if exit_code is not None and (isinstance(exit_code, bool) or not isinstance(exit_code, int)
                                      or not 0 <= exit_code <= 255):
            raise ConfigError(f"SnapshotCallback exit_code must be None or an int in 0..255 (got {exit_code!r})")
        self.ckpt_dir = Path(ckpt_dir)
        self.every_n_updates, self.every_n_minutes = every_n_updates, every_n_minutes
        self.signals = _signal_names(on_signals, on_signals is _DEFAULT_SIGNALS)
        self.keep, self._exit_code, self.requeue = keep, exit_code, requeue
        self._loop = None  # the trainer's loop, whose run state owns the update count (set when attached)
        # when the run's first fit started (time.time_ns()), kept through resumes: a fresh run named like an
        # older one in the same folder starts a new count, and resume ranks its files above the older run's
        self.started_ns = 0
        self._written_at = -1  # the run's update count at the last snapshot written (-1: none yet)
        self._last = time.monotonic()
        self._signal: str | None = None
        self._previous: dict = {}
        self._writer = background.BackgroundWriter(self._write_file) if async_write else None
        self._spare: Path | None = None  # the file rotation took out last, which the next write goes over
        self.waited_seconds = 0.0  # time snapshots waited for the background write before them

    def __repr__(self) -> str:
        return (f"SnapshotCallback(ckpt_dir={str(self.ckpt_dir)!r}, every_n_updates={self.every_n_updates},"
                f" every_n_minutes={self.every_n_minutes}, on_signals={self.signals}, keep={self.keep},"
                f" requeue={self.requeue}, async_write={self.async_write})")

    @property
    def async_write(self) -> bool:
        """Whether snapshots are written on a background thread."""
        return self._writer is not None

    @property
    def updates(self) -> int:
        """The update windows the run committed (`RunState.updates`, restored from checkpoints: the count goes
        on); 0 before the callback is attached."""
        return 0 if self._loop is None else self._loop.run.updates

    @property
    def pending_signal(self) -> str | None:
        """The listed signal that arrived (or killed a DataLoader worker) since the fit began, or None."""
        return self._signal

    @property
    def listening(self) -> bool:
        """Whether its signal handlers are installed now (during `fit`, in the main thread): only then can a
        listed signal stop a stage, or a failed fetch be its doing."""
        return bool(self._previous)

    def signal_after_error(self, timeout: float = 1.0) -> str | None:
        """After a fetch failed: the listed signal that arrived, or that killed a child (a DataLoader worker)
        within `timeout` seconds. A dying worker closes its connections before its exit status can be read,
        so the fetch may fail before SIGCHLD says why."""
        deadline = time.monotonic() + timeout
        while self._signal is None and self._previous:
            self._signal = _killed_by(self.signals)
            if self._signal is not None or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        return self._signal

    @property
    def must_agree(self) -> bool:
        """Whether ranks may decide differently (signals, clocks): then they agree per commit point."""
        return bool(self.signals) or self.every_n_minutes is not None

    # ---- the engine's side (deepepochs.engine.snapshot_trigger) ----
    def poll_snapshot(self, epoch_end: bool) -> tuple[bool, str | None]:
        """At a commit point (its window already counted in the run's `updates`): (whether a snapshot is due
        here, the signal that arrived or None). By count, one is due at each multiple of `every_n_updates`
        committed updates of the run (across epoch ends and resumes), once."""
        if epoch_end:
            return True, self._signal
        due = ((self.every_n_updates is not None and self.updates % self.every_n_updates == 0
                and self.updates != self._written_at)
               or (self.every_n_minutes is not None and time.monotonic() - self._last >= 60 * self.every_n_minutes))
        return due, self._signal

    def late_signal(self) -> str | None:
        """After the fit's end hooks: disarm (a signal from now on goes to the handler it replaced), then the
        signal that arrived after the last commit point's poll, or None; the engine stops the fit on it."""
        self._disarm()
        signal, self._signal = self._signal, None
        return signal

    def write_snapshot(self, trainer, position) -> Path | None:
        """Write the snapshot (every rank calls it: rank 0 writes the file, or under FSDP every rank its
        shards; `position` None at an epoch's end) and prune old ones; its path (None on other ranks)."""
        self._written_at, self._last = self.updates, time.monotonic()
        folder = self.ckpt_dir / str(trainer.running_id)
        end = "" if position is not None else f"-epoch{trainer.loop.completed_epochs}"
        target = folder / f"snapshot-u{self.updates:09d}{end}{checkpoint.SUFFIX}"
        writer = self._writer
        if writer is None or self._signal is not None:
            # synchronous; a preemption's snapshot also after the write in flight: both are on disk when it stops
            self.finish_writes()
            spare, self._spare = self._spare, None
            path = checkpoint.save(trainer, target, position, spare=spare)
            if path is not None:
                self._prune(folder)
            return path
        writer.report("SnapshotCallback")
        path = checkpoint.save(trainer, target, position, writer=writer, after=lambda _: self._prune(folder))
        self.waited_seconds += writer.waited
        return path

    def _write_file(self, data, path: Path) -> Path:
        """The background writer's write: `checkpoint.write_atomic`, over the spare file rotation left."""
        spare, self._spare = self._spare, None
        return checkpoint.write_atomic(data, path, spare=spare)

    def finish_writes(self) -> None:
        """Wait for the background write in flight, if any (bounded), and report a failed one."""
        if self._writer is not None:
            self._writer.finish("SnapshotCallback")

    def _end_writes(self) -> None:
        """`finish_writes`, then remove the spare file: nothing is written until the next fit."""
        self.finish_writes()
        spare, self._spare = self._spare, None
        if spare is not None:
            spare.unlink(missing_ok=True)

    def exit_code(self, signal_name: str) -> int:
        """`Preempted`'s exit status for `signal_name`."""
        return self._exit_code if self._exit_code is not None else 128 + signal.Signals[signal_name].value

    def _prune(self, folder: Path) -> None:
        """Keep the `keep` most progressed snapshots (`checkpoint.by_progress`: completed epochs, then updates,
        then time, the order resume takes them in); also remove sharded snapshot folders never committed
        (their save was killed: each snapshot has a new name, so no later save would tidy them). The first file
        pruned is kept out of sight as the spare the next snapshot is written over (`checkpoint.retire`)."""
        found = list(folder.glob(f"snapshot-u*{checkpoint.SUFFIX}"))
        files = checkpoint.by_progress([p for p in found if checkpoint.exists(p)])
        for old in files[self.keep:] + [p for p in found if p.is_dir() and not checkpoint.exists(p)]:
            try:
                if self._spare is None and old.is_file():
                    self._spare = checkpoint.retire(old)
                else:
                    checkpoint.remove(old)
            except OSError:
                pass

    # ---- monitor protocol (its state is in every checkpoint) ----
    def state_dict(self) -> dict:
        # the run's update count, also here: `checkpoint.by_progress` orders files of older versions by it
        return {"updates": self.updates, "started_ns": self.started_ns}

    def load_state_dict(self, state: dict) -> None:
        # the update count comes back with the run state (the file's `updates`), not from here
        self.started_ns = int(state.get("started_ns", 0))
        self._written_at = -1  # the count's multiples are due as they are reached

    # ---- hooks ----
    def on_attach(self, trainer) -> None:
        self._loop = trainer.loop
        background.check_attached("SnapshotCallback", self._writer, trainer)
        same = [cb for cb in trainer.callbacks if isinstance(cb, SnapshotCallback)]
        if len(same) > 1:
            raise ConfigError(f"a trainer takes one SnapshotCallback (got {same[0]!r} and {same[1]!r})")

    def on_before_fit(self, trainer, epochs):
        """Arm the signals; a run not resumed from a file records when it started (see `started_ns`)."""
        if not self.started_ns:
            self.started_ns = time.time_ns()
        self._last, self._signal = time.monotonic(), None
        self._arm()

    def on_after_fit(self, trainer):
        self._end_writes()  # the last snapshot is on disk when fit() returns

    def on_close(self, trainer):
        self._end_writes()

    def on_interrupted(self, trainer, exception):
        self._disarm()
        self._end_writes()  # on disk before the run's lock is released
        if self.requeue and isinstance(exception, Preempted) and trainer.dist.is_main:
            try:
                done = slurm.requeue()
            except (ConfigError, RuntimeError) as exc:
                done = f"not requeued: {exc}"
            print(f"deepepochs: {done}", file=sys.stderr, flush=True)

    def _arm(self) -> None:
        if not self.signals or self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            warnings.warn(f"SnapshotCallback: fit() runs outside the main thread, where signal handlers cannot be"
                          f" set; {', '.join(self.signals)} will not stop it cleanly", DeepEpochsWarning,
                          stacklevel=3)
            return
        for name in self.signals:
            number = signal.Signals[name]
            self._previous[number] = signal.signal(number, self._handle)
        if hasattr(signal, "SIGCHLD"):
            # torch's DataLoader handler raises in the main thread wherever it is when a worker dies (while a
            # snapshot is written, too): it is installed now, so that ours comes first and can tell a worker
            # killed by a listed signal (the scheduler signalled the whole job) from a worker that failed.
            torch_private.install_loader_child_handler()
            self._previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, self._child_exited)

    def _disarm(self) -> None:
        previous, self._previous = self._previous, {}
        for number, handler in previous.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)

    def _handle(self, signum, frame) -> None:
        if self._signal is None:
            self._signal = signal.Signals(signum).name

    def _child_exited(self, signum, frame) -> None:
        """SIGCHLD while armed: a child killed by a listed signal is that signal arriving; any other exit
        goes to the handler this one replaced (torch's, which raises for a failed DataLoader worker), unless
        a signal already arrived: the fit is stopping, and nothing may interrupt the snapshot it writes."""
        if self._signal is None:
            self._signal = _killed_by(self.signals)
        if self._signal is not None:
            return
        previous = self._previous.get(signal.SIGCHLD)
        if callable(previous):
            previous(signum, frame)


def _killed_by(names: tuple[str, ...]) -> str | None:
    """The name of the listed signal that killed the first child waiting to be reaped, or None. The child is
    left waiting (`WNOWAIT`): its owner (multiprocessing, torch's worker checks) still reaps it."""
    if not hasattr(os, "waitid"):  # not on every platform; there a dead worker raises as torch decides
        return None
    try:
        info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except (ChildProcessError, OSError):
        return None
    if info is None or info.si_code not in (os.CLD_KILLED, os.CLD_DUMPED):
        return None
    try:
        name = signal.Signals(info.si_status).name
    except ValueError:
        return None
    return name if name in names else None


def _signal_names(on_signals, default: bool) -> tuple[str, ...]:
    """Validated signal names; the defaults missing on this platform are dropped."""
    items = (on_signals,) if isinstance(on_signals, (str, int)) else tuple(on_signals or ())
    names = []
    valid = sorted(s.name for s in signal.Signals if s.name not in _UNCATCHABLE | _SYNCHRONOUS | _CHILD | {"SIGINT"})
    for item in items:
        try:
            name = signal.Signals(item).name if isinstance(item, int) else signal.Signals[str(item).upper()].name
        except (KeyError, ValueError):
            if default:
                continue
            raise ConfigError(f"SnapshotCallback on_signals: {item!r} is not a signal of this platform; accepted:"
                              f" {', '.join(valid)}") from None
        if name == "SIGINT":
            raise ConfigError("SnapshotCallback on_signals cannot hold SIGINT: Ctrl-C already rolls the fit back to"
                              " its last commit point (KeyboardInterrupt); list SIGTERM or SIGUSR1 for preemption")
        if name in _UNCATCHABLE:
            raise ConfigError(f"SnapshotCallback on_signals cannot hold {name}: it cannot be caught; accepted:"
                              f" {', '.join(valid)}")
        if name in _SYNCHRONOUS | _CHILD:
            why = ("a child process's exit, not a request to stop" if name in _CHILD else
                   "sent for a fault of the process itself (native code), which must end it at once; caught,"
                   " the faulting instruction would run again forever")
            raise ConfigError(f"SnapshotCallback on_signals cannot hold {name}: it is {why}; accepted:"
                              f" {', '.join(valid)}")
        if name not in names:
            names.append(name)
    return tuple(names)
