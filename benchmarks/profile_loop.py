"""Where deepepochs' per-batch overhead goes on the tiny model (a diagnostic for the loop-overhead budget).

1. Ablations: CPU time per batch of the raw loop, of deepepochs, of deepepochs taking every edge
   (`fuse_steps=False`, the path callbacks and custom steps take), and of deepepochs with one piece of
   the machine replaced by a cheaper stand-in (in this process only, by patching attributes; nothing on
   disk changes). The saving of each stand-in is what that piece costs. Every round runs all variants in
   a random order; CPU time of the thread is used because it is robust to other load on a shared machine.
2. The fixed cost of one fit() call (a 1-batch fit minus a 1-batch raw loop) and its cold-trigger part.
3. cProfile of one deepepochs epoch: the package's own functions by internal time, and the torch calls
   they make directly (ops the raw loop does not do).

The stand-ins reach into internals (LoopMachine.fire/fire_cold), so this script follows the package's
implementation and may need updating when it changes.

    python benchmarks/profile_loop.py [--rounds 41] [--batches 100]
"""

from __future__ import annotations

import argparse
import collections
import copy
import cProfile
import gc
import io
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import median, quiet_stdout  # noqa: E402
from loop_overhead import Raw, adam, make_batches, tiny_model  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import deepepochs  # noqa: E402


def make_trainer(model, **kwargs):
    with quiet_stdout():
        return deepepochs.Trainer(model, F.cross_entropy, adam(model), device="cpu", log_batch=False,
                                  show_info=False, **kwargs)


def fast_fire(machine):
    """`LoopMachine.fire` reduced to the table lookup, the guard and the actions: no flight record, no
    probe, no invalid-trigger message (what a minimal compiled dispatch costs)."""
    table, model = machine.table, machine.model

    def fire(trigger):
        source = model.state
        for pred, dest, actions, error in table[(source, trigger)]:
            if pred is None or pred():
                if error is not None:
                    error()
                model.state = dest
                for action in actions:
                    action()
                return dest
        raise AssertionError("guards are not total")

    return fire


def _fast_fire(trainer):
    trainer.machine.fire = fast_fire(trainer.machine)


def _cold_on_table(trainer):
    """The cold triggers (fit, epoch, stage, task) on the compiled table instead of `transitions`."""
    trainer.machine.fire_cold = fast_fire(trainer.machine)


# name: (Trainer keyword arguments, a change made to the built trainer)
ABLATIONS = collections.OrderedDict([
    ("every edge (fuse_steps=False)", ({"fuse_steps": False}, None)),
    ("every edge, fire() without flight record and probe", ({"fuse_steps": False}, _fast_fire)),
    ("cold triggers on the compiled table, not transitions", ({}, _cold_on_table)),
])


class Variant:
    def __init__(self, model, ablation=({}, None)):
        kwargs, change = ablation
        self.trainer = make_trainer(model, **kwargs)
        self.epochs = 0
        if change is not None:
            change(self.trainer)

    def epoch(self, data):
        self.epochs += 1
        with quiet_stdout():
            self.trainer.fit(data, epochs=self.epochs)


def ablations(rounds: int, batches: int) -> dict[str, list[float]]:
    """CPU µs per batch of each variant, one value per round (every round runs all, in random order)."""
    torch.manual_seed(0)
    init = tiny_model()
    data = make_batches(16, 2, 32, batches)
    runners = {"raw": Raw(copy.deepcopy(init)), "deepepochs": Variant(copy.deepcopy(init))}
    for name, ablation in ABLATIONS.items():
        runners[name] = Variant(copy.deepcopy(init), ablation)
    cpu = {name: [] for name in runners}
    for runner in runners.values():
        runner.epoch(data)  # warm-up
    names = list(runners)
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            gc.collect()
            start = time.thread_time()  # this thread's CPU time: robust to other jobs on the machine
            runners[name].epoch(data)
            cpu[name].append((time.thread_time() - start) / len(data) * 1e6)
    return cpu


def profile(batches: int) -> str:
    torch.manual_seed(0)
    model = tiny_model()
    trainer = make_trainer(model)
    data = make_batches(16, 2, 32, batches)
    with quiet_stdout():
        trainer.fit(data[:20], epochs=1)
        prof = cProfile.Profile()
        prof.enable()
        trainer.fit(data, epochs=2)
        prof.disable()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    stats.sort_stats("tottime").print_stats(r"deepepochs[/\\]", 25)
    # Torch functions called directly from deepepochs' modules (not via the user's model or optimizer).
    direct = collections.Counter()
    for func, (_cc, _nc, _tt, _ct, callers) in stats.stats.items():
        name = func[2]
        if "deepepochs" in func[0]:
            continue
        for caller, (_ccc, _calls, tottime, _cum) in callers.items():
            if "deepepochs" in caller[0] and ("torch" in func[0] or name.startswith(("<method", "<built-in"))):
                direct[(f"{Path(caller[0]).name}:{caller[2]}", name)] += tottime / batches * 1e6
    lines = ["torch / builtin calls made directly by deepepochs (µs per batch, under cProfile):"]
    lines += [f"  {where:45s} {what:55s} {us:7.2f}" for (where, what), us in direct.most_common(15)]
    return out.getvalue() + "\n".join(lines)


def fit_cost(rounds: int) -> tuple[float, float]:
    """The fixed cost of one `fit()` call: µs of a 1-batch fit minus a 1-batch raw loop, and the part of it
    spent in cold triggers (`fire_cold`, through `transitions`); medians over `rounds`, automatic garbage
    collection off (a collection before a fit leaves the caches cold and doubles the figure)."""
    torch.manual_seed(0)
    init = tiny_model()
    data = make_batches(16, 2, 32, 1)
    raw, variant = Raw(copy.deepcopy(init)), Variant(copy.deepcopy(init))
    machine = variant.trainer.machine
    fire_cold, cold_time = machine.fire_cold, [0.0]

    def timed(trigger):
        start = time.perf_counter()
        try:
            return fire_cold(trigger)
        finally:
            cold_time[0] += time.perf_counter() - start

    machine.fire_cold = timed
    fits, colds = [], []
    gc.collect()
    gc.disable()
    try:
        for _ in range(rounds + 3):
            start = time.perf_counter()
            raw.epoch(data)
            raw_us = (time.perf_counter() - start) * 1e6
            cold_time[0] = 0.0
            start = time.perf_counter()
            variant.epoch(data)
            fits.append((time.perf_counter() - start) * 1e6 - raw_us)
            colds.append(cold_time[0] * 1e6)
    finally:
        gc.enable()
    return median(fits[3:]), median(colds[3:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="deepepochs hot-path breakdown on the tiny model")
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--no-cprofile", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cpu = ablations(args.rounds, args.batches)
    raw, full = cpu["raw"], cpu["deepepochs"]
    print(f"tiny model, {args.batches} batches per epoch, {args.rounds} rounds; CPU time of this thread;"
          " ratios and savings are medians of per-round pairs\n")
    print("| variant | µs/batch | ratio to raw | µs/batch saved vs deepepochs |")
    print("|---|---:|---:|---:|")
    for name, values in cpu.items():
        ratio = median([v / r for v, r in zip(values, raw)])
        saved = "" if name in ("raw", "deepepochs") else f"{median([f - v for f, v in zip(full, values)]):+.1f}"
        print(f"| {name} | {median(values):.1f} | {ratio:.3f} | {saved} |")
    print(f"\ndeepepochs overhead: {median([f - r for f, r in zip(full, raw)]):.1f} µs per batch (paired median)")
    per_fit, cold = fit_cost(args.rounds)
    print(f"one fit() call costs {per_fit:.0f} µs beyond its batches, {cold:.0f} µs of it in cold triggers"
          f" (transitions); spread over {args.batches} batches: {per_fit / args.batches:.1f} µs per batch")
    if not args.no_cprofile:
        print()
        print(profile(args.batches * 4))
    return 0


if __name__ == "__main__":
    sys.exit(main())
