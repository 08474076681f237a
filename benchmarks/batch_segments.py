"""Where one training batch's time goes, segment by segment: deepepochs against the raw loop (PERF-1's
"what costs what", on the tiny model where the loop's own cost shows most).

Both loops are timed with the same clock reads around the work they share: the model's forward, the loss
function, backward, the optimizer's step and zero_grad. deepepochs is also timed around each hop of the
machine (`LoopMachine.walk`, with that edge's guards and actions; the fused edge's `start_walk` and
`land`), and, inside those hops, around the gradient finite check and the generator copy at the commit
point. Each row is a call's own time: a hop's row leaves out the timed calls its actions make (the
optimizer step of `apply_update`, zero_grad and the generator copy of `finish_update`, the finite check of
`optimize`), which have rows of their own. A batch's time is the interval from one batch hand-out to the
next; what no timed call covers is the loops' own code between them (deepepochs: the step layer, the
loss read as a float, task meters, batch split, hook lookups).

The clock reads and wrappers cost both loops something (deepepochs more: it has more timed calls), so the
totals here run a little above `loop_overhead.py`'s; the segments are what to compare. Each figure is the
median over all batches of all rounds (every round runs one epoch of each loop, in a random order). The
wrappers reach into internals (`steps.call_model`, `LoopMachine.walk`, `actions.random_state`,
`torch_private.grads_finite_on_host`), so this script follows the package's implementation.

    python benchmarks/batch_segments.py [--rounds 40] [--batches 200] [--output FILE]   (also part of `make bench`)
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import RESULTS_DIR, machine_info, median, quiet_stdout, write_json  # noqa: E402
from loop_overhead import adam, make_batches, tiny_model  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import deepepochs  # noqa: E402
from deepepochs import torch_private  # noqa: E402
from deepepochs.engine import actions, steps  # noqa: E402
from deepepochs.fsm.machine import LoopMachine  # noqa: E402

clock = time.perf_counter_ns
#: (label, start ns, end ns) of every timed call of the running loop; label "batch" marks a hand-out.
STAMPS: list[tuple[str, int, int]] = []


def timed(label: str, fn):
    """`fn` with its calls stamped under `label`."""
    def call(*args, **kwargs):
        start = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            STAMPS.append((label, start, clock()))

    return call


class Handouts:
    """A re-iterable sequence of batches (so deepepochs knows its length, as with a list) that stamps each
    hand-out as "batch"."""

    def __init__(self, batches: list):
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        for batch in self.batches:
            now = clock()
            STAMPS.append(("batch", now, now))
            yield batch


def raw_loop(model, data) -> None:
    """The raw loop of `loop_overhead.Raw`, its shared calls stamped as deepepochs' are."""
    opt = adam(model)
    forward, loss_fn = timed("forward", model), timed("loss function", F.cross_entropy)
    backward, step = timed("backward", torch.autograd.backward), timed("optimizer step", opt.step)
    zero_grad = timed("zero_grad", opt.zero_grad)

    def epoch():
        for x, y in data:
            zero_grad(set_to_none=True)
            backward(loss_fn(forward(x), y))
            step()

    return epoch


def deepepochs_loop(model, data):
    """`Trainer.fit` for one more epoch per call, console off, with the shared calls and the hops stamped."""
    opt = adam(model)
    with quiet_stdout():
        trainer = deepepochs.Trainer(model, timed("loss function", F.cross_entropy), opt, device="cpu",
                                     log_batch=False, show_info=False)
    opt.step, opt.zero_grad = timed("optimizer step", opt.step), timed("zero_grad", opt.zero_grad)
    epochs = [0]

    def epoch():
        epochs[0] += 1
        with quiet_stdout():
            trainer.fit(data, epochs=epochs[0])

    return epoch


def patch_deepepochs():
    """Stamp deepepochs' calls (the module attributes its hot path looks up at call time); returns an undo."""
    walk, start_walk, land = LoopMachine.walk, LoopMachine.start_walk, LoopMachine.land
    saved = [(steps, "call_model"), (torch.autograd, "backward"), (actions, "random_state"),
             (torch_private, "grads_finite_on_host"), (LoopMachine, "walk"), (LoopMachine, "start_walk"),
             (LoopMachine, "land")]
    old = [getattr(owner, name) for owner, name in saved]
    steps.call_model = timed("forward", steps.call_model)
    torch.autograd.backward = timed("backward", torch.autograd.backward)
    actions.random_state = timed("generator copy (finish_update)", actions.random_state)
    torch_private.grads_finite_on_host = timed("finite check (optimize)", torch_private.grads_finite_on_host)

    def hop(self, trigger):
        start = clock()
        try:
            return walk(self, trigger)
        finally:
            STAMPS.append((f"hop {trigger}", start, clock()))

    LoopMachine.walk = hop
    LoopMachine.start_walk = timed("fused edge: start_walk + land", start_walk)
    LoopMachine.land = timed("fused edge: start_walk + land", land)

    def undo():
        for (owner, name), value in zip(saved, old):
            setattr(owner, name, value)

    return undo


def segments(stamps, skip: int = 5) -> dict[str, list[float]]:
    """Per batch (after the first `skip` of an epoch): µs in each label's own code (a timed call's time
    less the timed calls inside it, e.g. a hop's less the optimizer step its action makes), the interval to
    the next hand-out, and what no timed call covered ("loop code between")."""
    out = collections.defaultdict(list)
    marks = [i for i, (label, _, _) in enumerate(stamps) if label == "batch"]
    for a, b in zip(marks[skip:], marks[skip + 1:]):
        interval = (stamps[b][1] - stamps[a][1]) / 1000
        own = collections.Counter()
        open_calls: list[tuple[str, int, int]] = []  # the enclosing calls of the one at hand, outermost first
        for label, start, end in sorted(stamps[a + 1:b], key=lambda s: (s[1], -s[2])):
            while open_calls and open_calls[-1][2] <= start:
                open_calls.pop()
            own[label] += (end - start) / 1000
            if open_calls:
                own[open_calls[-1][0]] -= (end - start) / 1000
            open_calls.append((label, start, end))
        for label, us in own.items():
            out[label].append(us)
        out["loop code between"].append(interval - sum(own.values()))
        out["batch (hand-out to hand-out)"].append(interval)
    return out


ORDER = ["forward", "loss function", "backward", "optimizer step", "zero_grad"]


def run(rounds: int, batches: int) -> dict:
    data = Handouts(make_batches(16, 2, 32, batches))
    init = tiny_model()
    loops = {"raw": raw_loop(init, data), "deepepochs": None}
    de_model = tiny_model()
    de_model.load_state_dict(init.state_dict())
    loops["deepepochs"] = deepepochs_loop(de_model, data)
    found = {name: collections.defaultdict(list) for name in loops}
    for _ in range(rounds):
        for name in random.sample(list(loops), len(loops)):
            undo = patch_deepepochs() if name == "deepepochs" else None
            STAMPS.clear()
            try:
                loops[name]()
            finally:
                if undo is not None:
                    undo()
            for label, values in segments(STAMPS).items():
                found[name][label].extend(values)
    labels = ORDER + sorted(label for label in found["deepepochs"] if label not in ORDER
                            and label not in ("loop code between", "batch (hand-out to hand-out)"))
    labels += ["loop code between", "batch (hand-out to hand-out)"]
    return {label: {name: (median(found[name][label]) if found[name].get(label) else None) for name in loops}
            for label in labels}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="one training batch's time, segment by segment")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--batches", type=int, default=200, help="batches per epoch")
    parser.add_argument("--output", default=str(RESULTS_DIR / "batch_segments.json"), help="JSON file ('' for none)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    table = run(args.rounds, args.batches)
    info = machine_info()
    print(f"## One tiny-model training batch, segment by segment: {info['cpu']}, torch {info['torch']},"
          f" 1 thread, {args.rounds} rounds x {args.batches} batches; medians, µs")
    print()
    print("| segment | raw loop | deepepochs | difference |")
    print("|---|---:|---:|---:|")
    for label, values in table.items():
        raw, de = values["raw"], values["deepepochs"]
        cells = [f"{v:.1f}" if v is not None else "—" for v in (raw, de)]
        diff = f"{de - (raw or 0.0):+.1f}" if de is not None else ""
        print(f"| {label} | {cells[0]} | {cells[1]} | {diff} |")
    if args.output:
        write_json(args.output, {"machine": info, "rounds": args.rounds, "batches": args.batches,
                                 "median_us": table})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
