"""What dataset-level metrics cost in memory: peak RSS growth of one training epoch against its size.

A 1,000-class linear model (32 features, batch 500, CPU, one thread) trains one epoch of N samples under
each way of keeping a metric. One fresh process (or one fresh pair of ranks through `launch`, gloo) runs
every measurement of a configuration in turn, smallest first; each samples its own RSS every 5 ms during
`fit`. The figure is the peak over the epoch minus the RSS just before it (after a 4-batch warm-up fit,
garbage collection and `malloc_trim`), per rank: it includes the batch's own work (logits, gradients,
per-batch confusion matrices), which does not grow with N.

==================  ==================================================================================
`tensor`            metric_patch='tensor', a user accuracy function: keeps every prediction (grows).
`mean`              metric_patch='mean', the same function: a running sample-weighted mean.
`confusion`         metric_patch='confusion', deepepochs' accuracy: a 1000x1000 count matrix.
`auto`              the default, deepepochs' accuracy and f1: one count matrix each.
`torchmetrics`      the default, torchmetrics' MulticlassAccuracy and MulticlassF1Score objects, streamed.
==================  ==================================================================================

With two ranks N is split between them (N / 2 samples each), and it also compares the two ways of
merging a `tensor` metric at the task's end: now (the predictions go to rank 0, which computes the value
and sends it to every rank) and the previous one (every rank received every rank's predictions and
computed the value itself), with the time spent merging.

    python benchmarks/metric_memory.py            # N = 60k, 120k, 240k; 1.2M for the bounded kinds
    python benchmarks/metric_memory.py --quick    # N = 10k, 20k: a smoke run
Writes results/metric_memory.json and prints a Markdown table. The growing kinds stop at 240k samples
(~1 GB of logits, several at the peak), as this machine is shared; their growth is linear in N.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import RESULTS_DIR, machine_info, write_json  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

MB = 1024 * 1024
FEATURES, CLASSES, BATCH = 32, 1000, 500
KINDS = ("tensor", "mean", "confusion", "auto", "torchmetrics")
BOUNDED = ("mean", "confusion", "auto", "torchmetrics")


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakSampler:
    """Samples the RSS every 5 ms on a thread; `peak` is the highest seen."""

    def __init__(self):
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


class Cycle:
    """`length` batches drawn in turn from a small pool: the data itself takes no memory that grows."""

    def __init__(self, pool: list, length: int):
        self.pool, self.length = pool, length

    def __len__(self):
        return self.length

    def __iter__(self):
        for i in range(self.length):
            yield self.pool[i % len(self.pool)]


def user_accuracy(preds, targets):
    """A user's metric function: deepepochs cannot know it is a mean or a count."""
    return (preds.argmax(1) == targets).float().mean()


def _metrics(kind: str):
    from deepepochs.metrics import accuracy, f1

    if kind in ("tensor", "mean"):
        return kind, [user_accuracy]
    if kind == "confusion":
        return "confusion", [accuracy]
    if kind == "auto":
        return "auto", [accuracy, f1]
    from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

    return "auto", [MulticlassAccuracy(num_classes=CLASSES, average="micro"),
                    MulticlassF1Score(num_classes=CLASSES, average="micro")]


def _trim() -> None:
    """Give freed heap memory back to the system, so the next run's baseline is its own."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _timed_merge(merge: str, spent: list) -> None:
    """Count the time spent merging patches across ranks; `everywhere` puts back the previous merge."""
    from deepepochs.parallel import ddp as distributed

    if merge == "everywhere":
        distributed.DDPPolicy.sync_patch = lambda self, patch: patch.copy().sync()
    original = distributed.DDPPolicy.sync_patches

    def timed(self, patches):
        start = time.perf_counter()
        try:
            return original(self, patches)
        finally:
            spent[0] += time.perf_counter() - start

    distributed.DDPPolicy.sync_patches = timed


def measure(kind: str, n: int, world: int, merge: str, spent: list) -> dict:
    """This rank's figures for one epoch of `n` samples over all ranks."""
    from deepepochs import Trainer

    g = torch.Generator().manual_seed(0)
    pool = [(torch.randn(BATCH, FEATURES, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
            for _ in range(8)]
    patch, metrics = _metrics(kind)
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, CLASSES)
    kw = dict(device="cpu", metrics=metrics, metric_patch=patch, log_batch=False, show_info=False)
    with Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.01), epochs=1, **kw) as warm:
        warm.fit(Cycle(pool, 4))
    batches = max(1, n // BATCH // world)
    with Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.01), epochs=1, **kw) as trainer:
        _trim()
        before, spent[0] = rss_bytes(), 0.0
        start = time.perf_counter()
        with PeakSampler() as sampler:
            records = trainer.fit(Cycle(pool, batches))
        seconds = time.perf_counter() - start
    return {"kind": kind, "n": batches * BATCH * world, "world": world, "merge": merge,
            "rank": int(os.environ.get("RANK", 0)), "growth_mb": (sampler.peak - before) / MB,
            "fit_s": seconds, "merge_s": spent[0] if world > 1 else 0.0,
            "value": {k: v[-1] for k, v in records["train"].items()}}


def rank_main():
    """The body of each rank (or of the one process): the runs come through the environment, smallest
    first; each rank writes its figures to the folder named there."""
    spec = json.loads(os.environ["METRIC_MEMORY_SPEC"])
    torch.set_num_threads(1)
    spent = [0.0]
    _timed_merge(spec["merge"], spent)
    rows = [measure(kind, n, spec["world"], spec["merge"], spent) for kind, n in spec["runs"]]
    Path(spec["out"], f"rank{os.environ.get('RANK', 0)}.json").write_text(json.dumps(rows))


def child(runs: list, world: int, merge: str) -> list[dict]:
    """Run the measurements in a fresh process, or a fresh pair of ranks; every rank's rows."""
    with tempfile.TemporaryDirectory() as out:
        spec = {"runs": runs, "world": world, "merge": merge, "out": out}
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                                "MASTER_PORT")}
        env.update(METRIC_MEMORY_SPEC=json.dumps(spec), CUDA_VISIBLE_DEVICES="")
        here = str(Path(__file__).resolve().parent)
        code = (f"import sys; sys.path.insert(0, {here!r}); import metric_memory as m; from deepepochs import launch;"
                f" launch(m.rank_main, num_processes={world})")
        subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=3600, stdout=subprocess.DEVNULL)
        return [row for p in sorted(Path(out).glob("rank*.json")) for row in json.loads(p.read_text())]


def table(rows: list, sizes: list) -> str:
    """A Markdown table: peak growth per kind (rows) and samples per epoch (columns); with 2 ranks,
    rank 0 / rank 1."""
    head = "| metrics kept as | " + " | ".join(f"{n // 1000:,}k" for n in sizes) + " |"
    lines = [head, "|---" * (len(sizes) + 1) + "|"]
    for kind in KINDS:
        for world, merge in ((1, "root"), (2, "root"), (2, "everywhere")):
            got = {}
            for r in rows:
                if r["kind"] == kind and r["world"] == world and r["merge"] == merge:
                    got.setdefault(r["n"], {})[r["rank"]] = r["growth_mb"]
            if not got:
                continue
            label = kind if world == 1 else f"{kind}, 2 ranks{' (previous merge)' if merge != 'root' else ''}"
            cells = [" / ".join(f"{got[n][r]:.0f}" for r in sorted(got[n])) + " MB" if n in got else "" for n in sizes]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[60_000, 120_000, 240_000],
                        help="samples per epoch (default 60k 120k 240k)")
    parser.add_argument("--big", type=int, nargs="*", default=[1_200_000],
                        help="larger epochs for the bounded kinds only, in one process (default 1.2M)")
    parser.add_argument("--quick", action="store_true", help="10k and 20k samples: a smoke run")
    args = parser.parse_args()
    sizes = [10_000, 20_000] if args.quick else sorted(args.sizes)
    big = [] if args.quick else sorted(args.big)
    runs = [(kind, n) for kind in KINDS for n in sizes]
    alone = [(kind, n) for kind in KINDS for n in sizes + (big if kind in BOUNDED else [])]
    rows = []
    for world, merge, todo in ((1, "root", alone), (2, "root", runs),
                               (2, "everywhere", [("tensor", n) for n in sizes])):
        got = child(todo, world, merge)
        rows += got
        for r in got:
            print(f"{r['kind']:>12} N={r['n']:>9,} world={world} rank={r['rank']} merge={merge:>10}:"
                  f" +{r['growth_mb']:7.1f} MB  fit {r['fit_s']:6.2f} s  merge {r['merge_s']:.3f} s", flush=True)
    write_json(RESULTS_DIR / "metric_memory.json", {"machine": machine_info(), "rows": rows, "features": FEATURES,
                                                   "classes": CLASSES, "batch": BATCH})
    print(table(rows, sizes + big))


if __name__ == "__main__":
    main()
