"""Where one training batch's time goes, segment by segment: deepepochs against the raw loop (the loop-overhead budget's
"what costs what"): on the tiny model the loop's own cost shows most; on the MLP (`--model mlp`) what
grows with the model shows (the finite check's pass over the gradients).

Both loops are timed with the same clock reads around the work they share: the model's forward, the loss
function, backward, the optimizer's step and zero_grad. deepepochs is also timed around every call the
compiled micro-batch makes (`deepepochs.engine.compiled`): each registry guard and action, each step piece
(`steps.read_batch`, `forward`, `loss_value`, `backpropagate`, `step_patches`, `select_update`,
`count_batch`), the compiled function itself (its own lines: the state moves and the recorded edge), and,
inside the actions, the gradient finite check and the generator copy at the commit point. Each row is a
call's own time: an action's row leaves out the timed calls it makes (the optimizer step of
`step_optimizer`, zero_grad, the generator copy of `remember_position`, the finite check of
`unscale_gradients`), which have rows of their own. A batch's time is the interval from one batch hand-out
to the next; what no timed call covers is the loops' own code between them (deepepochs: the batch loop).

The process runs with glibc's malloc thresholds pinned (`GLIBC_TUNABLES`, set by re-executing itself
when they are not): with the default dynamic thresholds, the second-built model copy sits at the top of
the heap, which glibc trims and grows again every batch, so the torch calls of whichever loop trains that
copy run slower and page-fault (measured with the raw loop in both places: the same excess, 360/784 minor
page faults per backward/step). Minor page faults per batch are counted for each loop (`getrusage`), so a
run whose allocator still trims shows it.

The clock reads and wrappers cost both loops something (deepepochs more: it has more timed calls), so the
totals here run a little above `loop_overhead.py`'s; the segments are what to compare. Each figure is the
median over all batches of all rounds (every round runs one epoch of each loop, in a random order). The
wrappers reach into internals (`steps.call_model`, the registry, `compiled.bind`, `generators.random_state`,
`torch_private.grads_finite_on_host`), so this script follows the package's implementation.

    python benchmarks/batch_segments.py [--model tiny|mlp] [--rounds N] [--batches N] [--output FILE]
    (both models are part of `make bench`)
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import RESULTS_DIR, machine_info, median, quiet_stdout, write_json  # noqa: E402
from loop_overhead import MODELS, adam, make_batches  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import deepepochs  # noqa: E402
from deepepochs import torch_private  # noqa: E402
from deepepochs.engine import actions, compiled, generators, steps  # noqa: E402

clock = time.perf_counter_ns
#: glibc's malloc thresholds, pinned (64 MiB): no heap trim or mmap threshold change between batches.
PINNED_MALLOC = "glibc.malloc.trim_threshold=67108864:glibc.malloc.mmap_threshold=67108864"
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
    """Stamp deepepochs' calls: the registry's guards and actions and the step pieces the compiled
    micro-batch calls (looked up when a task starts), the compiled micro-batch itself, and the finite check
    and generator copy inside the actions; returns an undo."""
    saved = [(steps, "call_model"), (torch_private, "backward_seeded"), (generators, "random_state"),
             (torch_private, "grads_finite_on_host"), (compiled, "bind"),
             *((steps, name) for name in compiled.STEP_HELPERS)]
    old = [getattr(owner, name) for owner, name in saved]
    registry = [(table, dict(table)) for table in (actions.ACTIONS, actions.GUARDS)]
    steps.call_model = timed("forward", steps.call_model)
    torch_private.backward_seeded = timed("backward", torch_private.backward_seeded)  # the training backward
    generators.random_state = timed("generator copy (remember_position)", generators.random_state)
    torch_private.grads_finite_on_host = timed("finite check (unscale_gradients)", torch_private.grads_finite_on_host)
    for name in compiled.STEP_HELPERS:
        setattr(steps, name, timed(f"step {name}", getattr(steps, name)))
    for kind, table in (("action", actions.ACTIONS), ("guard", actions.GUARDS)):
        for name, fn in list(table.items()):
            table[name] = timed(f"{kind} {name}", fn)
    bind = compiled.bind

    def timed_bind(ctx):
        return {source: timed("compiled micro-batch (its own lines)", fn) for source, fn in bind(ctx).items()}

    compiled.bind = timed_bind

    def undo():
        for (owner, name), value in zip(saved, old):
            setattr(owner, name, value)
        for table, entries in registry:
            table.clear()
            table.update(entries)

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
#: deepepochs' own rows, grouped: the two per-update guarantees, then by the kind of call (label prefix).
GUARANTEES = ["finite check (unscale_gradients)", "generator copy (remember_position)"]
KINDS = ["action ", "guard ", "step ", "compiled micro-batch"]


def _own_order(labels) -> list[str]:
    """deepepochs' own rows in reading order: the guarantees, then actions, guards, step pieces and the
    generated function's own lines, each group by name."""
    rest = [label for label in labels if label not in GUARANTEES]
    grouped = [g for g in GUARANTEES if g in labels]
    for kind in KINDS:
        grouped += sorted(label for label in rest if label.startswith(kind))
    return grouped + sorted(label for label in rest if label not in grouped)


def run(rounds: int, batches: int, model_name: str = "tiny") -> dict:
    factory, features, classes, batch_size = MODELS[model_name]
    data = Handouts(make_batches(features, classes, batch_size, batches))
    torch.manual_seed(0)
    init = factory()
    loops = {"raw": raw_loop(init, data), "deepepochs": None}
    de_model = factory()
    de_model.load_state_dict(init.state_dict())
    loops["deepepochs"] = deepepochs_loop(de_model, data)
    found = {name: collections.defaultdict(list) for name in loops}
    for _ in range(rounds):
        for name in random.sample(list(loops), len(loops)):
            undo = patch_deepepochs() if name == "deepepochs" else None
            STAMPS.clear()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            try:
                loops[name]()
            finally:
                if undo is not None:
                    undo()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            found[name]["minor page faults (per batch)"].append(faults / len(data))
            for label, values in segments(STAMPS).items():
                found[name][label].extend(values)
    labels = ORDER + _own_order([label for label in found["deepepochs"] if label not in ORDER
                                 and label not in ("loop code between", "batch (hand-out to hand-out)",
                                                   "minor page faults (per batch)")])
    labels += ["loop code between", "batch (hand-out to hand-out)", "minor page faults (per batch)"]
    return {label: {name: (median(found[name][label]) if found[name].get(label) else None) for name in loops}
            for label in labels}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="one training batch's time, segment by segment")
    parser.add_argument("--model", default="tiny", choices=list(MODELS),
                        help="tiny (Linear 16->2, batch 32) or mlp (784-512-512-10, batch 128)")
    parser.add_argument("--rounds", type=int, default=None, help="default: 40 (tiny), 8 (mlp)")
    parser.add_argument("--batches", type=int, default=None, help="batches per epoch; default: 200 (tiny), 30 (mlp)")
    parser.add_argument("--output", default=None,
                        help="JSON file ('' for none; default results/batch_segments.json, _mlp for the MLP)")
    args = parser.parse_args(argv)
    if argv is None and os.environ.get("GLIBC_TUNABLES") != PINNED_MALLOC:  # pin the allocator: re-execute
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "GLIBC_TUNABLES": PINNED_MALLOC})
    tiny = args.model == "tiny"
    rounds = args.rounds if args.rounds is not None else (40 if tiny else 8)
    batches = args.batches if args.batches is not None else (200 if tiny else 30)
    output = args.output if args.output is not None else str(
        RESULTS_DIR / ("batch_segments.json" if tiny else f"batch_segments_{args.model}.json"))
    torch.set_num_threads(1)
    table = run(rounds, batches, args.model)
    info = machine_info()
    print(f"## One {args.model} training batch, segment by segment ({info['date']}): {info['cpu']}, torch"
          f" {info['torch']}, 1 thread, {rounds} rounds x {batches} batches; medians, µs")
    print()
    print("| segment | raw loop | deepepochs | difference |")
    print("|---|---:|---:|---:|")
    own = 0.0
    for label, values in table.items():
        raw, de = values["raw"], values["deepepochs"]
        cells = [f"{v:.1f}" if v is not None else "—" for v in (raw, de)]
        diff = f"{de - (raw or 0.0):+.1f}" if de is not None else ""
        if raw is None and de is not None:
            own += de
        print(f"| {label} | {cells[0]} | {cells[1]} | {diff} |")
    print(f"\ndeepepochs' own calls (the rows without a raw figure) sum to {own:.1f} µs per batch; each timed call"
          " also pays its wrapper's clock reads (~1 µs), so the sum runs above loop_overhead.py's own cost.")
    if output:
        write_json(output, {"machine": info, "model": args.model, "rounds": rounds, "batches": batches,
                            "median_us": table, "own_calls_us": own})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
