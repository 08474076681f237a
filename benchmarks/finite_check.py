"""What the non-finite gradient check costs per update, against the update it guards.

deepepochs checks every gradient for inf/NaN before every update (`engine.finite.window_finite`, which
on the CPU calls `torch_private.grads_finite_on_host`). Its cost grows with the model (one pass over the
gradients), so it is measured here on a plain PyTorch update, without the rest of the library: zero_grad,
forward, loss, backward, the check, Adam's step; MLP 784-512-512-10 at batch 128 (and the tiny model),
one thread. Each round runs a few updates of every variant in a random order, so load on a shared machine
hits them alike; the figures are medians over rounds:

- "check µs": the check's own time, clocked inside the update (after backward, as the library calls it:
  the gradients have just been written and the interpreter's caches are cold);
- "update µs": the whole update's CPU time (median over rounds of each round's median);
- "paired cost": the CPU time from the end of backward to the end of the step (the check, then Adam's
  step) less the same round's step without a check. This is what the check really adds: the
  gradients backward just wrote are read from memory, not the cache (a first read of the MLP's largest
  gradient takes ~2.5x a second one here), so the check's pass brings them into the cache for the
  step, which then reads them faster. Leaving forward and backward out keeps most of a shared machine's
  noise out of the difference. Its share is of the update without a check.

Variants: `none` (no check), `deepepochs` (the library's check as it runs for this model: summed gradients
for large ones, see `torch_private.sums_pay_off`), `fused` (the fused private pass, the path for small
gradients), `isfinite` (one public `isfinite(g).all()` per gradient: the obvious way, for scale).

    python benchmarks/finite_check.py [--rounds 60] [--updates 3] [--models mlp,tiny] [--output FILE]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import RESULTS_DIR, machine_info, median, quantile, write_json  # noqa: E402
from loop_overhead import MODELS, adam, make_batches  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from deepepochs import torch_private  # noqa: E402

clock = time.perf_counter_ns
#: The update and the step are timed in the thread's CPU time: a ~15 ms update on a shared machine is often
#: descheduled part-way, which wall time would count; the check (~0.1 ms) is timed by the wall clock.
cpu_clock = time.thread_time_ns


def _isfinite_each(grads) -> bool:
    return all(bool(torch.isfinite(g).all()) for g in grads)


def checks(params) -> dict:
    """name -> check(grads) -> bool, for gradients shaped like `params`."""
    summed = torch_private.sums_pay_off(params)
    return {
        "none": lambda grads: True,
        "deepepochs": lambda grads: torch_private.grads_finite_on_host(grads, summed),
        "fused": lambda grads: torch_private.grads_finite_on_host(grads, False),
        "isfinite": _isfinite_each,
    }


def measure(model_name: str, rounds: int, updates: int) -> list[dict]:
    """Per variant: medians over rounds of the update's time, the check's own time and the paired cost."""
    factory, features, classes, batch_size = MODELS[model_name]
    torch.manual_seed(0)
    model = factory()
    params = list(model.parameters())
    opt = adam(model)
    batches = make_batches(features, classes, batch_size, 8)
    variants = checks(params)

    def update(check, x, y):
        """One update: (its CPU µs, the check's wall µs, CPU µs from the end of backward to the end of the
        step)."""
        start = cpu_clock()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        before_cpu, before = cpu_clock(), clock()
        if not check([p.grad for p in params]):
            raise FloatingPointError("a benchmark gradient is not finite")
        after = clock()
        opt.step()
        end = cpu_clock()
        return (end - start) / 1000, (after - before) / 1000, (end - before_cpu) / 1000

    for i in range(10):  # warm-up: Adam's state, first-call caches
        update(variants["none"], *batches[i % len(batches)])
    per_round = {name: {"update": [], "check": [], "tail": []} for name in variants}
    order, rng, n = list(variants), random.Random(0), 0
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            times = [update(variants[name], *batches[(n := n + 1) % len(batches)]) for _ in range(updates)]
            for i, key in enumerate(("update", "check", "tail")):
                per_round[name][key].append(median(t[i] for t in times))
    base = per_round["none"]["update"]
    rows = []
    for name, found in per_round.items():
        diffs = [a - b for a, b in zip(found["tail"], per_round["none"]["tail"])]
        rows.append({
            "model": model_name, "variant": name, "params": sum(p.numel() for p in params),
            "tensors": len(params), "rounds": rounds, "updates_per_round": updates,
            "update_us": median(found["update"]), "check_us": median(found["check"]),
            "check_p10_us": quantile(found["check"], 0.1), "check_and_step_us": median(found["tail"]),
            "paired_cost_us": median(diffs), "paired_cost_pct": 100 * median(diffs) / median(base),
            "check_pct": 100 * median(found["check"]) / median(base),
        })
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| model | check | update µs | check µs (p10) | check / update | paired cost µs (check + step"
             " less step) | paired cost / update |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["variant"] == "none":
            lines.append(f"| {r['model']} ({r['params']:,} parameters, {r['tensors']} tensors) | none |"
                         f" {r['update_us']:.0f} | — | — | — | — |")
            continue
        lines.append(f"| {r['model']} | {r['variant']} | {r['update_us']:.0f} | {r['check_us']:.1f}"
                     f" ({r['check_p10_us']:.1f}) | {r['check_pct']:.2f} % | {r['paired_cost_us']:+.1f} |"
                     f" {r['paired_cost_pct']:+.2f} % |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="the non-finite gradient check's cost per update")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--updates", type=int, default=3, help="updates per variant per round")
    parser.add_argument("--models", default="mlp,tiny", help=f"comma-separated subset of {list(MODELS)}")
    parser.add_argument("--output", default=str(RESULTS_DIR / "finite_check.json"), help="JSON file ('' for none)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in (m for m in args.models.split(",") if m):
        if name not in MODELS:
            parser.error(f"unknown model {name!r}; choose from {list(MODELS)}")
        rows += measure(name, args.rounds, args.updates)
    info = machine_info()
    print(f"## Non-finite gradient check per update: {info['cpu']}, torch {info['torch']}, 1 thread,"
          f" Adam, {args.rounds} rounds x {args.updates} updates; medians over rounds\n")
    print(format_table(rows))
    if args.output:
        write_json(args.output, {"benchmark": "finite_check", "machine": info, "settings": vars(args),
                                 "results": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
