"""How long a snapshot stops training: synchronous and background snapshot writes against plain floors.

Trains MLPs of about 25M and 100M parameters with Adam on the CPU (a batch of 8 rows) with deepepochs, doing one
kind of save every N updates, and times every update (a callback's `on_after_train_batch`). A save's stall is the
time of the N updates of a period that ends with a save, minus N plain updates (the median update of a run
without saves, measured in the same process): so a background write that slows the updates after it (it shares
the machine's cores) counts in full. Every row is measured that way, inside a fit, one run per row:

- `sync`: `SnapshotCallback(every_n_updates=N)`, the file written before the loop goes on;
- `async`: `SnapshotCallback(every_n_updates=N, async_write=True)`, the loop waits for a host copy;
- `plain save`: what a hand-written loop pays for the same state, `torch.save` of the model's and optimizer's
  state dicts to a file, then `fsync`;
- `plain copy`: the floor of any background write, a copy of those state dicts into new host memory
  (`background.host_copy`);
- `reused copy`: the same copy into host memory kept from the copy before (`background.HostCopy`, what
  `async_write=True` does from its second snapshot on).

    python benchmarks/snapshot_stall.py [--sizes 25,100] [--every N] [--periods P] [--output FILE]
    (`make bench-snapshots`)
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import RESULTS_DIR, machine_info, median, quiet_stdout, write_json  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import deepepochs  # noqa: E402
from deepepochs.checkpoint import background  # noqa: E402

BATCH = 8


def mlp(millions: int) -> nn.Module:
    """Four square linear layers of about `millions` / 4 million parameters each."""
    width = int((millions * 1e6 / 4) ** 0.5)
    return nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(width, width), nn.ReLU())][:-1])


class UpdateTimes(deepepochs.Callback):
    """`perf_counter` after every training batch (one batch is one update here)."""

    def __init__(self):
        self.stamps: list[float] = []

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        self.stamps.append(time.perf_counter())


def _data(model: nn.Module, updates: int):
    width = model[0].in_features
    g = torch.Generator().manual_seed(0)
    x = torch.randn(updates * BATCH, width, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x), batch_size=BATCH)


class PlainSaves(deepepochs.Callback):
    """Every `every` updates, `save(state)` of the model's and optimizer's state dicts, as a hand-written loop
    would (after the update's time stamp, like a snapshot at its commit point)."""

    def __init__(self, every: int, save):
        self.every, self.save = every, save

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if (batch_idx + 1) % self.every == 0:
            self.save({"model": trainer.raw_model.state_dict(), "opt": trainer.opt.items[0].opt.state_dict()})


def _fit(millions: int, updates: int, saves: deepepochs.Callback | None) -> list[float]:
    """The seconds of every update of one fit (the first left out: it includes the fit's start)."""
    torch.manual_seed(0)
    model = mlp(millions)
    times = UpdateTimes()
    callbacks = [times] + ([saves] if saves is not None else [])
    with quiet_stdout():
        trainer = deepepochs.Trainer(model, F.mse_loss, torch.optim.Adam(model.parameters(), 1e-4), device="cpu",
                                     callbacks=callbacks, running_id="bench", log_batch=False, show_info=False,
                                     run_lock="off")
        trainer.fit(_data(model, updates), epochs=1)
        trainer.close()
    stamps = times.stamps
    return [b - a for a, b in zip(stamps, stamps[1:])]


def _stalls(durations: list[float], every: int, plain: float) -> list[float]:
    """Per save, the time of the `every` updates from the one it follows on, minus `every` plain updates.
    `durations[i]` is the time from update i + 1's end to update i + 2's (1-based): the save after update u
    falls in `durations[u - 2]` or `durations[u - 1]` (before or after the hook's stamp), and a background
    write's cost in the updates after it; the window `durations[u - 2 : u - 2 + every]` holds all of it."""
    stalls = []
    for u in range(every, len(durations) + 2 - every + 1, every):
        stalls.append(sum(durations[u - 2:u - 2 + every]) - every * plain)
    return stalls


def _plain_save(folder: Path):
    def save(state):
        with open(folder / "plain.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    return save


def _savers(folder: Path, every: int) -> dict:
    """Per row, the callback that makes its saves."""
    return {
        "sync": deepepochs.SnapshotCallback(folder / "sync", every_n_updates=every, on_signals=(), keep=1),
        "async": deepepochs.SnapshotCallback(folder / "async", every_n_updates=every, on_signals=(), keep=1,
                                             async_write=True),
        "plain save": PlainSaves(every, _plain_save(folder)),
        "plain copy": PlainSaves(every, background.host_copy),
        "reused copy": PlainSaves(every, background.HostCopy().take),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="25,100", help="model sizes in millions of parameters")
    parser.add_argument("--every", type=int, default=5, help="a snapshot every N updates")
    parser.add_argument("--periods", type=int, default=6, help="snapshots per run")
    parser.add_argument("--output", default=str(RESULTS_DIR / "snapshot_stall.json"))
    args = parser.parse_args()
    rows, load = [], {"start": os.getloadavg()}  # a shared machine's other work inflates every row
    updates = args.every * (args.periods + 1) + 2
    for millions in [int(s) for s in args.sizes.split(",") if s]:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            plain = median(_fit(millions, updates, None))
            measured = {mode: _stalls(_fit(millions, updates, saves), args.every, plain)
                        for mode, saves in _savers(folder, args.every).items()}
        params = sum(p.numel() for p in mlp(millions).parameters())
        for mode, values in measured.items():
            rows.append({"model": f"{millions}M", "parameters": params, "mode": mode, "stall_s": median(values),
                         "samples": len(values), "plain_update_s": plain})
            print(f"{millions:>4}M  {mode:<11} stall {median(values):8.3f} s  (median of {len(values)};"
                  f" a plain update {plain:.3f} s)")
    for millions in sorted({row["model"] for row in rows}):
        by_mode = {row["mode"]: row["stall_s"] for row in rows if row["model"] == millions}
        print(f"{millions}: async / plain copy {by_mode['async'] / by_mode['plain copy']:.2f}x,"
              f" async / reused copy {by_mode['async'] / by_mode['reused copy']:.2f}x,"
              f" async / sync {by_mode['async'] / by_mode['sync']:.2f}x")
    load["end"] = os.getloadavg()
    write_json(args.output, {"machine": machine_info(), "load_average": load, "every_n_updates": args.every,
                             "rows": rows})


if __name__ == "__main__":
    main()
