"""The parts of a snapshot's cost, each alone, for the ~100M-parameter MLP with Adam of `snapshot_stall.py`
(a 1.2 GB state): where a synchronous snapshot's time goes and what the commit point of a background one pays.

Per repetition, in turn: a copy of the state into new host memory (`background.host_copy`) and into memory kept
from the copy before (`background.HostCopy`, what `async_write=True` does); the atomic snapshot write to a new
file followed by the removal of the snapshot before it (what rotation did) and the same write over the file
rotation retired (`checkpoint.retire`, what it does now); and a plain `torch.save` + `fsync` of the same state
over one file. Minimum and median of the repetitions (a shared machine's other work only adds time).

    python benchmarks/snapshot_parts.py [--millions 100] [--repeats 5] [--output FILE]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import RESULTS_DIR, machine_info, median, write_json  # noqa: E402
from snapshot_stall import BATCH, mlp  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from deepepochs.checkpoint import background, retire, write_atomic  # noqa: E402


def _rotate(data, path: Path, before: Path) -> Path:
    """The atomic write to a new file, then the removal of the file before it."""
    write_atomic(data, path)
    before.unlink()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--millions", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", default=str(RESULTS_DIR / "snapshot_parts.json"))
    args = parser.parse_args()
    torch.manual_seed(0)
    model = mlp(args.millions)
    opt = torch.optim.Adam(model.parameters(), 1e-4)
    x = torch.randn(BATCH, model[0].in_features)
    F.mse_loss(model(x), x).backward()
    opt.step()  # the optimizer's state exists, as in a snapshot after updates

    def state():
        return {"model": model.state_dict(), "opt": opt.state_dict()}

    folder = Path(tempfile.mkdtemp())
    host = background.HostCopy()
    host.take(state())
    before, spare = write_atomic(state(), folder / "new-0.ckpt"), None
    seconds: dict[str, list[float]] = {}

    def timed(name, work, *args, **kwargs):
        start = time.perf_counter()
        result = work(*args, **kwargs)
        seconds.setdefault(name, []).append(time.perf_counter() - start)
        return result

    def plain_save():
        with open(folder / "plain.pt", "wb") as f:
            torch.save(state(), f)
            f.flush()
            os.fsync(f.fileno())

    load = {"start": os.getloadavg()}
    try:
        for i in range(1, args.repeats + 1):
            timed("copy into new memory", lambda: background.host_copy(state()))
            timed("copy into kept memory", lambda: host.take(state()))
            before = timed("write a new file, remove the one before", _rotate, state(), folder / f"new-{i}.ckpt",
                           before)
            spare = retire(timed("write over the retired file", write_atomic, state(), folder / f"over-{i}.ckpt",
                                 spare=spare))
            timed("plain torch.save + fsync", plain_save)
            print(i, {name: round(values[-1], 2) for name, values in seconds.items()}, flush=True)
    finally:
        shutil.rmtree(folder)
    load["end"] = os.getloadavg()
    rows = [{"part": name, "min_s": min(values), "median_s": median(values), "seconds": values}
            for name, values in seconds.items()]
    for row in rows:
        print(f"{row['part']:<42} min {row['min_s']:6.2f} s  median {row['median_s']:6.2f} s")
    write_json(args.output, {"machine": machine_info(), "load_average": load, "millions": args.millions,
                             "rows": rows})


if __name__ == "__main__":
    main()
