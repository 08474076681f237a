"""Instructions per training batch, counted by callgrind: the raw loop, deepepochs, pytorch-ignite and
Lightning on the same model, data, initial weights and optimizer settings.

A wall clock on a shared 2-core machine moves by more than a loop's own cost between two runs; an
instruction count does not: callgrind counts the same instructions whatever else the machine does. So
this script judges the loop's cost in instructions (`loop_overhead.py` and `wall_clock.py` time it).

How it counts:

- every loop runs in its own process, under `valgrind --tool=callgrind --instr-atstart=no
  --collect-atstart=no`, so nothing one loop did (allocator state, caches, imports) is seen by another;
- the process builds its loop (`loop_overhead.VARIANTS`: the same classes `make bench` times), warms it up
  with one fit of each length, uninstrumented, then switches instrumentation on;
- around each measured fit, and only there, it switches collection on and off through callgrind's
  client requests (`callgrind_client.c`, compiled with gcc and loaded with ctypes: Python cannot issue a
  client request itself), then dumps the counters and reads the total back;
- it measures fits of n1 and n2 batches, alternating, `repeats` times; (instructions of the n2-batch fit -
  those of the n1-batch fit) / (n2 - n1) is the cost of one batch, with every per-fit cost (a framework's
  set-up, the epoch's end, an iterator's creation) cancelled;
- one thread (`torch.set_num_threads(1)`), console output to `os.devnull`, Python's hash seed fixed, the
  cyclic garbage collector run before each measured fit and off inside it (for every loop alike).

Workloads: the tiny model (Linear 16->2, batch 32) fed by a `DataLoader(TensorDataset)` and by a list of
pre-batched tensors; the MLP (784-512-512-10, batch 128) fed by a DataLoader; on the tiny model with a
DataLoader also `fuse_steps=False` and k=4 gradient accumulation (against the raw k=4 loop, and the raw
k=4 loop seeding backward with 1/k as deepepochs does).

    python benchmarks/instructions.py                    # every workload (~10 min here), writes JSON
    python benchmarks/instructions.py --workloads tiny_loader --loops raw,deepepochs
    python benchmarks/instructions.py --quick            # a smoke run: few batches, one repeat
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import RESULTS_DIR, machine_info, median, print_verdicts, quiet_stdout, write_json  # noqa: E402

#: Budget, in instructions per batch against the raw loop of the same run: the tiny model with a
#: DataLoader at most this ratio; pre-batched and the MLP below pytorch-ignite's ratio.
TINY_LOADER_LIMIT = 1.020

#: name: (model, feed, loops, n1, n2). n1 and n2 are multiples of 4 (the k=4 loops update every 4 batches).
WORKLOADS = {
    "tiny_loader": ("tiny", "loader", ["raw", "deepepochs", "ignite", "lightning", "deepepochs_every_edge",
                                       "raw_acc4", "raw_acc4_seeded", "deepepochs_acc4", "deepepochs_clock"], 16, 48),
    "tiny_tensors": ("tiny", "tensors", ["raw", "deepepochs", "ignite", "lightning"], 16, 48),
    "mlp_loader": ("mlp", "loader", ["raw", "deepepochs", "ignite", "lightning"], 2, 4),
}
QUICK_SIZES = (4, 8)
TITLES = {"tiny_loader": "tiny (Linear 16→2, batch 32), DataLoader",
          "tiny_tensors": "tiny (Linear 16→2, batch 32), pre-batched tensors",
          "mlp_loader": "MLP 784-512-512-10, batch 128, DataLoader"}


# ---- the worker: one loop in one process under callgrind --------------------------------------------
class Counter:
    """Callgrind's counters through the compiled client-request shim: `measure(fn)` runs `fn` with
    collection on and returns the instructions it executed."""

    def __init__(self, shim: str, profile: str):
        self.lib = ctypes.CDLL(shim)
        self.profile, self.dumps = profile, 0
        if not self.lib.on_valgrind():
            raise RuntimeError("the worker must run under valgrind --tool=callgrind (see main)")

    def instrument(self) -> None:
        self.lib.instrument()

    def measure(self, fn, label: str) -> int:
        lib = self.lib
        lib.zero_stats()
        lib.toggle_collect()
        fn()
        lib.toggle_collect()
        lib.dump_stats(label.encode())
        self.dumps += 1
        path = f"{self.profile}.{self.dumps}"
        with open(path) as f:
            total = next(int(line.split()[1]) for line in f if line.startswith("totals:"))
        os.remove(path)
        return total


class Prebatched:
    """A re-iterable sequence of ready-made batches (a plain list would be taken by Lightning for a list of
    loaders)."""

    def __init__(self, batches: list):
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


def feed(model_name: str, kind: str, n: int, pool: list):
    """The first `n` batches of `pool`: as a DataLoader over a TensorDataset (`loader`) or `Prebatched`."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    batches = pool[:n]
    if kind == "tensors":
        return Prebatched(batches)
    x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    return DataLoader(TensorDataset(x, y), batch_size=len(batches[0][0]))


def worker(workload: str, loop: str, shim: str, profile: str, repeats: int, quick: bool) -> dict:
    """Count one loop's instructions per batch on `workload` (this process runs under callgrind)."""
    import loop_overhead as lo
    import torch

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    model_name, kind, _, n1, n2 = WORKLOADS[workload]
    if quick:
        n1, n2 = QUICK_SIZES
    factory, features, classes, batch_size = lo.MODELS[model_name]
    counter = Counter(shim, profile)
    torch.manual_seed(0)
    model = factory()
    pool = lo.make_batches(features, classes, batch_size, n2)
    data = {n: feed(model_name, kind, n, pool) for n in (n1, n2)}
    with quiet_stdout():
        runner = lo.VARIANTS[loop](model)
    prepare = getattr(runner, "prepare", lambda: None)

    def fit(n):
        with quiet_stdout():
            runner.epoch(data[n])

    for n in (n1, n2):  # warm-up, uninstrumented: first-call caches, the optimizer's state, lazy imports
        with quiet_stdout():
            prepare()
        fit(n)
    counter.instrument()
    fits = []
    for r in range(repeats):
        for n in (n1, n2):
            with quiet_stdout():
                prepare()
            gc.collect()
            gc.disable()
            try:
                fits.append((n, counter.measure(lambda n=n: fit(n), f"{loop} {n} batches, repeat {r}")))
            finally:
                gc.enable()
    getattr(runner, "close", lambda: None)()
    per_batch = [(b - a) / (n2 - n1) for (_, a), (_, b) in zip(fits[::2], fits[1::2])]
    return {"workload": workload, "loop": loop, "n1": n1, "n2": n2, "fits": fits, "per_batch_repeats": per_batch,
            "per_batch": median(per_batch)}


# ---- the driver: one valgrind process per loop, then the table ---------------------------------------
def build_shim(folder: str) -> str:
    header = Path("/usr/include/valgrind/callgrind.h")
    if not header.exists():
        raise SystemExit(f"{header} is missing: install valgrind (apt-get install valgrind), whose package has it")
    out = os.path.join(folder, "callgrind_client.so")
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", out, str(HERE / "callgrind_client.c")], check=True)
    return out


def reference(loop: str) -> str | None:
    """The loop a loop's ratio is taken against."""
    from loop_overhead import VARIANTS

    return VARIANTS[loop].reference


def table(results: dict) -> str:
    """One line per workload and loop: instructions per batch, the ratio and difference to its reference."""
    lines = ["| workload | loop | instructions per batch | ratio (vs) | difference per batch | repeats |",
             "|---|---|---:|---:|---:|---|"]
    for workload, loops in results.items():
        for loop, row in loops.items():
            ref = row.get("reference")
            ratio = f"{row['ratio']:.4f}× ({ref})" if "ratio" in row else "—"
            diff = f"{row['difference']:+,.0f}" if "difference" in row else "—"
            reps = ", ".join(f"{v:,.0f}" for v in row["per_batch_repeats"])
            lines.append(f"| {TITLES.get(workload, workload)} | {loop} | {row['per_batch']:,.0f} | {ratio} | {diff} |"
                         f" {reps} |")
    return "\n".join(lines)


def summary(results: dict) -> str:
    """The docs' table: per workload the raw loop, then each library's ratio (and its difference)."""
    cols = [("deepepochs", "deepepochs"), ("ignite", "pytorch-ignite"), ("lightning", "Lightning")]
    lines = ["| workload | raw loop, instructions per batch | " + " | ".join(h for _, h in cols) + " |",
             "|---|---:|" + "---:|" * len(cols)]
    for workload, loops in results.items():
        raw = loops.get("raw")
        cells = []
        for loop, _ in cols:
            row = loops.get(loop)
            cells.append("—" if row is None or "ratio" not in row else
                         f"{row['ratio']:.3f}× ({row['difference'] / 1000:+,.1f}k)")
        lines.append(f"| {TITLES.get(workload, workload)} | {raw['per_batch']:,.0f} | " + " | ".join(cells) + " |"
                     if raw else f"| {workload} | — | " + " | ".join(cells) + " |")
    extra = results.get("tiny_loader", {})
    for loop, what in (("deepepochs_every_edge", "`fuse_steps=False`"),
                       ("deepepochs_clock", "the update clock (`max_updates`, `val_every_n_updates`)"),
                       ("deepepochs_acc4", "k=4 against the raw k=4 loop"),
                       ("raw_acc4_seeded", "the raw k=4 loop seeding backward with 1/k, against the raw k=4 loop")):
        row = extra.get(loop)
        if row is not None and "ratio" in row:
            lines.append(f"\n- tiny, DataLoader, {what}: {row['ratio']:.3f}× ({row['difference'] / 1000:+,.1f}k)")
    return "\n".join(lines)


def budget(results: dict) -> list[dict]:
    out = []

    def ratio(workload, loop):
        row = results.get(workload, {}).get(loop)
        return None if row is None or "ratio" not in row else row["ratio"]

    for loop, what in (("deepepochs", "tiny, DataLoader"), ("deepepochs_clock", "tiny, DataLoader, update clock")):
        de = ratio("tiny_loader", loop)
        if de is not None:
            out.append({"budget": f"{what} <= {TINY_LOADER_LIMIT}x the raw loop", "value": de,
                        "limit": TINY_LOADER_LIMIT, "met": de <= TINY_LOADER_LIMIT})
    for workload in ("tiny_tensors", "mlp_loader"):
        de, ig = ratio(workload, "deepepochs"), ratio(workload, "ignite")
        if de is not None and ig is not None:
            out.append({"budget": f"{workload} below pytorch-ignite", "value": de, "limit": ig, "met": de < ig})
    return out


def run_one(workload: str, loop: str, shim: str, folder: str, repeats: int, quick: bool) -> dict:
    profile = os.path.join(folder, f"{workload}-{loop}.callgrind")
    result = os.path.join(folder, f"{workload}-{loop}.json")
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
           f"--callgrind-out-file={profile}", sys.executable, str(Path(__file__).resolve()), "--worker",
           workload, loop, "--shim", shim, "--profile", profile, "--result", result, "--repeats", str(repeats)]
    if quick:
        cmd.append("--quick")
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{workload} {loop} failed under callgrind (exit {done.returncode}):\n"
                           + done.stdout[-4000:])
    with open(result) as f:
        return json.load(f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="instructions per training batch under callgrind")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {list(WORKLOADS)}")
    parser.add_argument("--loops", default="", help="comma-separated subset of each workload's loops (default all)")
    parser.add_argument("--repeats", type=int, default=2, help="measured (n1, n2) pairs per loop")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4 and 8 batches, one repeat")
    parser.add_argument("--jobs", type=int, default=2,
                        help="loops counted at once, each in its own process (counts do not depend on it)")
    parser.add_argument("--output", default=str(RESULTS_DIR / "instructions.json"), help="JSON file ('' for none)")
    parser.add_argument("--worker", nargs=2, metavar=("WORKLOAD", "LOOP"), help=argparse.SUPPRESS)
    parser.add_argument("--shim", help=argparse.SUPPRESS)
    parser.add_argument("--profile", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        out = worker(*args.worker, args.shim, args.profile, args.repeats, args.quick)
        with open(args.result, "w") as f:
            json.dump(out, f)
        return 0
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    if args.quick:
        args.repeats = 1
    workloads = [w for w in args.workloads.split(",") if w]
    for w in workloads:
        if w not in WORKLOADS:
            parser.error(f"unknown workload {w!r}; choose from {list(WORKLOADS)}")
    from loop_overhead import available_variants  # imports torch and deepepochs: not before the worker needs them

    wanted = {name for name in args.loops.split(",") if name}
    t0 = time.perf_counter()
    results: dict = {}
    skipped: dict = {}
    jobs = []
    for workload in workloads:
        results[workload] = {}
        loops, missing = available_variants([loop for loop in WORKLOADS[workload][2] if not wanted or loop in wanted])
        skipped.update(missing)
        jobs += [(workload, loop) for loop in loops]
    with tempfile.TemporaryDirectory(prefix="deepepochs-callgrind-") as folder:
        shim = build_shim(folder)

        def count(job):
            start = time.perf_counter()
            try:
                row = run_one(*job, shim, folder, args.repeats, args.quick)
            except RuntimeError as e:  # reported, and the other loops still counted
                print(e, file=sys.stderr)
                return {"failed": str(e)[-2000:]}
            print(f"{job[0]} {job[1]}: {row['per_batch']:,.0f} instructions per batch"
                  f" ({time.perf_counter() - start:.0f} s)", file=sys.stderr)
            return row

        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for (workload, loop), row in zip(jobs, pool.map(count, jobs)):
                if "failed" in row:
                    skipped[f"{workload} {loop}"] = row["failed"]
                else:
                    results[workload][loop] = row
    for loops in results.values():
        for loop, row in loops.items():
            ref = reference(loop)
            row["reference"] = ref
            if ref in loops:
                row["ratio"] = row["per_batch"] / loops[ref]["per_batch"]
                row["difference"] = row["per_batch"] - loops[ref]["per_batch"]
    verdict = budget(results)
    info = machine_info()
    print(f"## Instructions per batch (callgrind; {info['date']}; torch {info['torch']}, 1 thread, Adam)\n")
    print(summary(results))
    print_verdicts(verdict, 4, "Every loop", table(results), skipped)
    if args.output:
        versions = {}
        for name in ("ignite", "lightning"):
            try:
                versions[name] = __import__(name).__version__
            except ImportError:
                versions[name] = None
        write_json(args.output, {"benchmark": "instructions", "machine": info, "peers": versions,
                                 "settings": {k: v for k, v in vars(args).items() if k not in (
                                     "worker", "shim", "profile", "result")},
                                 "workloads": {w: dict(zip(("model", "feed", "loops", "n1", "n2"), WORKLOADS[w]))
                                               for w in workloads},
                                 "summary": summary(results), "budget": verdict, "skipped": skipped,
                                 "results": results, "elapsed_s": time.perf_counter() - t0})
    return 0


if __name__ == "__main__":
    sys.exit(main())
