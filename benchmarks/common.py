"""Helpers shared by the benchmark scripts: machine details, a time-stamping batch iterable, JSON output."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate

__all__ = ["FEEDS", "RESULTS_DIR", "Stamped", "StampedLoader", "devnull", "machine_info", "median", "quantile",
           "quiet_stdout", "write_json"]

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """What a reader needs to compare numbers across machines."""
    info = {
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    try:
        import deepepochs

        info["deepepochs"] = deepepochs.__version__
    except ImportError:  # the throughput benchmark's --raw mode works without it
        info["deepepochs"] = None
    return info


def median(values) -> float:
    return float(statistics.median(values))


def quantile(values, q: float) -> float:
    """The `q` quantile (0..1) of `values`, nearest rank."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


class Stamped:
    """A re-iterable sequence of batches that records `perf_counter()` when each batch is handed out.

    Every loop under test (raw, deepepochs, peers) iterates the same object, so the cost of the stamp is
    identical for all of them; the stamps give a steady-state time per batch that leaves out per-epoch
    fixed costs (setup, end-of-epoch metrics, a framework's fit() preparation). `data` is what the loops
    are given (this object: pre-batched tensors, no DataLoader cost).
    """

    feed = "tensors"

    def __init__(self, batches: list):
        self.batches = batches
        self.stamps: list[float] = []
        self.data = self

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        stamps = self.stamps
        stamps.clear()
        clock = time.perf_counter
        for batch in self.batches:
            stamps.append(clock())
            yield batch

    def reset(self) -> None:
        """Forget the stamps (before an epoch)."""
        self.stamps.clear()

    def intervals_us(self, skip: int = 5, window: int = 1) -> list[float]:
        """Intervals between batch hand-outs after the first `skip` batches (all of them in a short epoch),
        in microseconds; with `window=k`, the mean interval of each run of k consecutive batches (a loop
        that updates every k batches does unlike work per batch, and any k consecutive batches hold one
        update whatever loop reads ahead)."""
        s = self.stamps[skip:] if len(self.stamps) > skip + window else self.stamps
        intervals = [(b - a) * 1e6 / window for a, b in zip(s[::window], s[window::window])]
        if not intervals and len(s) >= 2:  # an epoch shorter than one window (e.g. --quick): its mean interval
            intervals = [(s[-1] - s[0]) * 1e6 / (len(s) - 1)]
        return intervals

    def steady_us(self, skip: int = 5) -> float:
        """Mean interval between batch hand-outs after the first `skip` batches, in microseconds."""
        s = self.stamps
        if len(s) <= skip + 1:
            skip = 0
        if len(s) < 2:
            return float("nan")
        return (s[-1] - s[skip]) / (len(s) - 1 - skip) * 1e6


class StampedLoader(Stamped):
    """The same batches fed as users feed them: `data` is a `DataLoader(TensorDataset(x, y),
    batch_size=...)` (one process, no workers), so every batch pays the DataLoader's indexing and collation
    (~120 µs for the tiny model's 32 samples). The stamp is taken by its `collate_fn` (torch's
    `default_collate` and one clock read), the last thing the DataLoader does before handing a batch out;
    a loop that rebuilds the DataLoader (deepepochs does, to own the training order) keeps the
    `collate_fn`. Call `reset()` before each epoch."""

    feed = "loader"

    def __init__(self, batches: list):
        super().__init__(batches)
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        self.data = DataLoader(TensorDataset(x, y), batch_size=len(batches[0][0]), collate_fn=self._collate)

    def __iter__(self):
        raise TypeError("iterate StampedLoader.data (the DataLoader), not the feed itself")

    def _collate(self, samples):
        batch = default_collate(samples)
        self.stamps.append(time.perf_counter())
        return batch


FEEDS = {"loader": StampedLoader, "tensors": Stamped}


_DEVNULL = None


def devnull():
    """One os.devnull text stream for the whole process, never closed: objects created under
    `quiet_stdout()` may keep a reference to it (deepepochs' console binds sys.stdout when created)."""
    global _DEVNULL
    if _DEVNULL is None:
        _DEVNULL = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the process
    return _DEVNULL


@contextlib.contextmanager
def quiet_stdout():
    """Send stdout to os.devnull (a non-TTY stream, like a log file) for the duration."""
    with contextlib.redirect_stdout(devnull()):
        yield


def print_verdicts(verdict: list, digits: int, heading: str, table: str, skipped: dict) -> None:
    """The report's end: each budget with its value, limit and verdict, then the full table under `heading`,
    then the loops that were skipped and why."""
    print("\n### Budget\n")
    for v in verdict:
        print(f"- {v['budget']}: {v['value']:.{digits}f} against {v['limit']:.{digits}f}:"
              f" {'met' if v['met'] else 'NOT met'}")
    print(f"\n### {heading}\n")
    print(table)
    for name, why in skipped.items():
        print(f"\n_{name} skipped: {why}_")


def write_json(path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=False)
        f.write("\n")
    print(f"wrote {path}", file=sys.stderr)
    return path
