"""Console output: run header, batch lines or tqdm bars, epoch and test lines.

Reading a metric value is a host-device sync, so batch lines are refreshed at most every
`REFRESH_S` seconds (terminal) or `LOG_REFRESH_S` seconds (a log file, one line each), never per batch.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping

from deepepochs.config import UNBOUNDED_EPOCHS

__all__ = ["Console"]

REFRESH_S = 0.1
LOG_REFRESH_S = 10.0


def _fmt(metrics: Mapping[str, float], digits: int) -> str:
    return "  ".join(f"{k}: {v:.{digits}f}" for k, v in metrics.items())


def _of(count: int, target: int | None) -> str:
    """`3/10`, or `3` without a target (epochs unbounded under an update budget)."""
    return f"{count}" if target is None or target >= UNBOUNDED_EPOCHS else f"{count}/{target}"


def _skipped(count: int) -> str:
    return "" if not count else f"  ({count} update{'s' if count > 1 else ''} skipped)"


class Console:
    """Prints on the main process only; everything is a no-op elsewhere or when switched off."""

    def __init__(self, log_batch: bool, log_tqdm: bool, log_long: bool, show_info: bool, enabled: bool,
                 stream=None):
        self._stream = stream  # None: whatever sys.stdout is when printing (it may be redirected later)
        self.enabled = enabled
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.log_batch = log_batch and enabled
        self.log_tqdm = log_tqdm and enabled and self.tty  # bars in a log file only make noise
        self.show_info = show_info and enabled
        self.digits = 7 if log_long else 4
        self.interval = REFRESH_S if self.tty else LOG_REFRESH_S
        self._due = 0.0
        self._bar = None
        self._prefix = ""
        self._total = None
        self._updates = None
        self._dirty = False
        self._noted: set[str] = set()

    @property
    def stream(self):
        """The output stream: the one given, else the current `sys.stdout`."""
        return self._stream if self._stream is not None else sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        self._stream = value

    def _print(self, text: str) -> None:
        if self._dirty:  # end an overwritten batch line first
            self.stream.write("\r" + " " * 100 + "\r")
            self._dirty = False
        print(text, file=self.stream, flush=True)

    def info(self, text: str) -> None:
        """A run-information line (the header), shown with show_info=True."""
        if self.show_info:
            self._print(text)

    def decision(self, text: str) -> None:
        """A decision the run took for the user (which run and checkpoint a resume loaded, or why it starts
        fresh, or trains nothing): shown on rank 0 whatever `show_info` says, as deepepochs 0.6 did."""
        if self.enabled:
            self._print(text)

    def note_once(self, key: str, text: str) -> None:
        """An information line shown once per trainer (with show_info=True), e.g. a behaviour that
        differs from deepepochs 0.6."""
        if key not in self._noted:
            self._noted.add(key)
            self.info(text)

    def start_task(self, stage: str, epoch: int, epochs: int | None, total: int | None,
                   updates: tuple[int, int | None] | None = None) -> None:
        """A task begins: reset the refresh clock and open a progress bar when asked. `updates`: (committed
        updates, their target or None) when the update clock runs a training task: the bar and the batch
        lines then count updates (`U 17/30`) instead of the task's batches."""
        self._prefix = f"E {_of(epoch, epochs)}  "
        self._stage = stage.upper()
        self._total = total
        self._updates = updates
        self._due = time.monotonic() + self.interval
        if self.log_tqdm:
            from tqdm.auto import tqdm

            count, total = updates if updates is not None else (0, total)
            self._bar = tqdm(total=total, initial=count, desc=f"{self._prefix}{self._stage}", leave=False,
                             file=self.stream, dynamic_ncols=True, unit="update" if updates is not None else "it")

    def batch(self, batch_idx: int, metrics: Callable[[], Mapping[str, float]], skipped: int = 0,
              updates: int = 0) -> None:
        """After batch `batch_idx` (1-based); `metrics()` is only called when a refresh is due; `skipped`
        updates so far in the task (inf/NaN) are shown when there are any; `updates`: the run's committed
        updates, which the bar and line count when the task began with `updates`."""
        bar, clock = self._bar, self._updates
        if bar is not None:
            if clock is None:
                bar.update(1)
            elif updates > bar.n:  # a committed window (an inner micro-batch leaves the count as it is)
                bar.update(updates - bar.n)
        if not self.log_batch:
            return
        now = time.monotonic()
        if now < self._due:
            return
        self._due = now + self.interval
        text = _fmt(metrics(), self.digits) + _skipped(skipped)
        if bar is not None:
            # Redraw now: this branch already runs at most once per refresh interval, and without it the
            # metrics would wait for tqdm's next redraw (or never show, on a task's last refresh).
            bar.set_postfix_str(text, refresh=True)
            return
        if clock is None:
            total = f"/{self._total}" if self._total else ""
            line = f"{self._prefix}B {batch_idx}{total}  {self._stage}> {text}"
        else:
            line = f"{self._prefix}U {_of(updates, clock[1])}  {self._stage}> {text}"
        if self.tty:
            self.stream.write("\r" + line)
            self.stream.flush()
            self._dirty = True
        else:
            print(line, file=self.stream, flush=True)

    def end_task(self) -> None:
        """Close the task's progress bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def epoch(self, epoch: int, epochs: int | None, stages: Mapping[str, Mapping[str, float]],
              skipped: int = 0, updates: tuple[int, int | None] | None = None) -> None:
        """`E 1/3  TRAIN> loss: ...   VAL> loss: ...`; the training stage's `skipped` updates (inf/NaN)
        follow its metrics when there are any: `TRAIN> loss: ... (2 updates skipped)`. Under the update
        clock (`updates`: the committed updates and `max_updates`) the line also names the update count its
        end reached, the step the trackers log it at: `E 1  U 6/15  TRAIN> loss: ...`."""
        if not self.enabled:
            return
        parts = [f"{stage.upper()}> {_fmt(m, self.digits)}{_skipped(skipped) if stage == 'train' else ''}"
                 for stage, m in stages.items() if m]
        at = "" if updates is None else f"U {_of(*updates)}  "
        self._print(f"E {_of(epoch, epochs)}  {at}" + "   ".join(parts))

    def update_point(self, updates: int, target: int | None, metrics: Mapping[str, float]) -> None:
        """A validation point of the update clock: `U 500/1001  VAL> loss: ...`."""
        if self.enabled:
            self._print(f"U {_of(updates, target)}  VAL> {_fmt(metrics, self.digits)}")

    def test(self, metrics: Mapping[str, float], updates: int | None = None) -> None:
        """`E 1/1  TEST>  loss: ...`; under the update clock the run's committed updates instead, the
        count the run's other lines use (`U 1001  TEST>  loss: ...`)."""
        if self.enabled:
            head = "E 1/1" if updates is None else f"U {updates}"
            self._print(f"{head}  TEST>  {_fmt(metrics, self.digits)}")

    def close(self) -> None:
        """Close any open bar."""
        self.end_task()
