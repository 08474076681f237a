"""The wall clock against the instruction count: the loops interleaved finely in one process.

Blocks of a few dozen batches, the raw loop, deepepochs and pytorch-ignite alternating (a random order per
round), many rounds: drift of a shared machine then hits the loops of one round alike. Within a block the
time per batch is the median interval between batch hand-outs after the first few (`common.Stamped`: a
fit()'s fixed cost is left out); each round gives a ratio to the raw loop's block of the same round. The
median ratio over rounds, with its interquartile range, is compared with the instruction ratio of
`instructions.py` (read from `results/instructions.json` when present): a wall ratio above the instruction
ratio by more than the spread means time spent without instructions (cache misses, page faults, the
allocator).

    python benchmarks/wall_clock.py [--model tiny|mlp] [--feed loader|tensors] [--rounds N] [--block N]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import FEEDS, RESULTS_DIR, machine_info, median, quantile, quiet_stdout, write_json  # noqa: E402
from loop_overhead import MODELS, VARIANTS, available_variants, make_batches  # noqa: E402

LOOPS = ["raw", "deepepochs", "ignite"]
WORKLOAD = {("tiny", "loader"): "tiny_loader", ("tiny", "tensors"): "tiny_tensors", ("mlp", "loader"): "mlp_loader"}


def instruction_ratios(model: str, feed: str) -> dict:
    """Each loop's instruction ratio to the raw loop from the last `instructions.py` run, if any."""
    path = RESULTS_DIR / "instructions.json"
    workload = WORKLOAD.get((model, feed))
    if workload is None or not path.exists():
        return {}
    rows = json.loads(path.read_text())["results"].get(workload, {})
    return {loop: row["ratio"] for loop, row in rows.items() if "ratio" in row}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="wall-clock ratios of finely interleaved loops")
    parser.add_argument("--model", default="tiny", choices=list(MODELS))
    parser.add_argument("--feed", default="loader", choices=list(FEEDS))
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--block", type=int, default=32, help="batches per block")
    parser.add_argument("--output", default=str(RESULTS_DIR / "wall_clock.json"), help="JSON file ('' for none)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    loops, skipped = available_variants(LOOPS)
    factory, features, classes, batch_size = MODELS[args.model]
    torch.manual_seed(0)
    model = factory()
    stamped = FEEDS[args.feed](make_batches(features, classes, batch_size, args.block))
    runners = {name: VARIANTS[name](model) for name in loops}  # one model copy: see loop_overhead.run_model
    for runner in runners.values():  # warm-up
        with quiet_stdout():
            runner.epoch(stamped.data)
    per_batch = {name: [] for name in loops}
    rng = random.Random(0)
    gc.collect()
    gc.disable()
    try:
        for _ in range(args.rounds):
            for name in rng.sample(loops, len(loops)):
                stamped.reset()
                with quiet_stdout():
                    runners[name].epoch(stamped.data)
                per_batch[name].append(median(stamped.intervals_us(skip=3)))
    finally:
        gc.enable()
    instr = instruction_ratios(args.model, args.feed)
    rows = {}
    for name in loops:
        if name == "raw":
            continue
        ratios = [a / b for a, b in zip(per_batch[name], per_batch["raw"])]
        rows[name] = {"median_ratio": median(ratios), "q25": quantile(ratios, 0.25), "q75": quantile(ratios, 0.75),
                      "instruction_ratio": instr.get(name), "rounds": ratios}
    print(f"## Wall clock, {args.model} fed by {args.feed}: {args.rounds} rounds of {args.block}-batch blocks\n")
    print(f"raw loop: {median(per_batch['raw']):.0f} µs per batch (median over rounds)\n")
    print("| loop | wall ratio (median) | interquartile range | instruction ratio |")
    print("|---|---:|---:|---:|")
    for name, row in rows.items():
        ins = f"{row['instruction_ratio']:.3f}×" if row["instruction_ratio"] else "—"
        print(f"| {name} | {row['median_ratio']:.3f}× | {row['q25']:.3f}–{row['q75']:.3f} | {ins} |")
    if args.output:
        write_json(args.output, {"benchmark": "wall_clock", "machine": machine_info(), "settings": vars(args),
                                 "skipped": skipped, "us_per_batch": per_batch, "ratios": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
