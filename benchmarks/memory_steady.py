"""A long fit with default settings holds steady memory.

Trains the seed's quick-start model (Linear(16, 2)) for `--epochs` x `--batches` training batches (20k by
default) with validation every epoch, sampling the process RSS every `--every` batches from a Callback.
Memory may rise during the first epoch (allocator pools, optimizer state, TensorPatch's documented
per-epoch growth when metrics are on); after that, the RSS at each epoch end must stay flat.

    python benchmarks/memory_steady.py                 # ~20k batches, writes results/memory_steady.json
    python benchmarks/memory_steady.py --epochs 2 --batches 50   # smoke test
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import RESULTS_DIR, machine_info, quiet_stdout, write_json  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from deepepochs import Callback, Trainer  # noqa: E402
from deepepochs.metrics import accuracy  # noqa: E402

MB = 1024 * 1024


def rss_bytes() -> int:
    """Current resident set size (Linux /proc), or the peak from getrusage elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class Cycle:
    """`length` batches drawn in turn from a small pool, so 20k batches need no 20k tensors."""

    def __init__(self, pool: list, length: int):
        self.pool, self.length = pool, length

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        pool, n = self.pool, len(self.pool)
        for i in range(self.length):
            yield pool[i % n]


class MemorySampler(Callback):
    """Samples RSS every `every` training batches and at every epoch end (with the live object count)."""

    def __init__(self, every: int):
        self.every = every
        self.batches = 0
        self.samples: list[tuple[int, float]] = []  # (global batch, RSS MB)
        self.epochs: list[dict] = []

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        self.batches += 1
        if self.batches % self.every == 0:
            self.samples.append((self.batches, rss_bytes() / MB))

    def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx):
        gc.collect()
        self.epochs.append({"epoch": epoch_idx, "batches": self.batches, "rss_mb": rss_bytes() / MB,
                            "gc_objects": len(gc.get_objects()), "history_len": len(trainer.history["train"]
                                                                                    .get("loss", []))})


def slope_mb_per_1k(samples: list[tuple[int, float]]) -> float:
    """Least-squares slope of RSS against batches, in MB per 1000 batches."""
    if len(samples) < 2:
        return 0.0
    xs = [b for b, _ in samples]
    ys = [m for _, m in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return 0.0
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var * 1000


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Steady memory: RSS over a long deepepochs fit")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batches", type=int, default=2000, help="training batches per epoch")
    parser.add_argument("--val-batches", type=int, default=100)
    parser.add_argument("--every", type=int, default=200, help="sample RSS every N training batches")
    parser.add_argument("--metrics", action="store_true",
                        help="also compute accuracy (metric_patch='tensor': grows within an epoch by design)")
    parser.add_argument("--limit-mb", type=float, default=5.0,
                        help="allowed RSS growth between the first and the last epoch end")
    parser.add_argument("--output", default=str(RESULTS_DIR / "memory_steady.json"), help="'' for none")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    pool = [(torch.randn(32, 16), torch.randint(0, 2, (32,))) for _ in range(64)]
    for x, y in pool:
        y.copy_((x[:, 0] > 0).long())
    train, val = Cycle(pool, args.batches), Cycle(pool, args.val_batches)
    sampler = MemorySampler(args.every)
    model = nn.Linear(16, 2)
    gc.collect()
    rss_start = rss_bytes() / MB
    start = time.perf_counter()
    with quiet_stdout():  # default console output, sent to a non-TTY stream
        trainer = Trainer(model, F.cross_entropy, torch.optim.Adam(model.parameters(), lr=1e-3),
                          epochs=args.epochs, device="cpu", callbacks=[sampler],
                          metrics=[accuracy] if args.metrics else None)
        trainer.fit(train, val)
        trainer.close()
    elapsed = time.perf_counter() - start
    epochs = sampler.epochs
    first, last = epochs[0], epochs[-1]
    growth = last["rss_mb"] - first["rss_mb"]
    after_first = [s for s in sampler.samples if s[0] > first["batches"]]
    result = {
        "benchmark": "memory_steady", "machine": machine_info(), "settings": vars(args),
        "total_batches": sampler.batches, "elapsed_s": elapsed,
        "rss_before_fit_mb": rss_start, "rss_peak_mb": max([m for _, m in sampler.samples] or [0.0]),
        "epoch_ends": epochs, "growth_after_first_epoch_mb": growth,
        "gc_objects_growth_after_first_epoch": last["gc_objects"] - first["gc_objects"],
        "slope_mb_per_1k_batches_after_first_epoch": slope_mb_per_1k(after_first),
        "samples": sampler.samples, "steady": growth <= args.limit_mb,
    }
    print(f"{sampler.batches} training batches in {elapsed:.1f} s; RSS before fit {rss_start:.1f} MB,"
          f" peak {result['rss_peak_mb']:.1f} MB")
    print("| epoch | batches | RSS MB | live Python objects |\n|---:|---:|---:|---:|")
    for e in epochs:
        print(f"| {e['epoch']} | {e['batches']} | {e['rss_mb']:.1f} | {e['gc_objects']} |")
    print(f"RSS growth from epoch {first['epoch']} end to epoch {last['epoch']} end: {growth:+.2f} MB"
          f" (slope {result['slope_mb_per_1k_batches_after_first_epoch']:+.3f} MB / 1k batches;"
          f" objects {result['gc_objects_growth_after_first_epoch']:+d});"
          f" steady memory {'met' if result['steady'] else 'NOT met'} (limit {args.limit_mb} MB)")
    if args.output:
        write_json(args.output, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
