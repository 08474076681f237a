"""Loop overhead: deepepochs against a raw PyTorch loop (and Ignite / Lightning when installed).

Every variant trains the same model (one copy per block, shared by all variants, so that their tensors
sit in the same memory) with its own optimizer of the same settings on the same list of pre-batched
(x, y) tensors (so no DataLoader cost), on the CPU with one thread. In every round each
variant runs one epoch (a fit() call or the raw loop), in a random order, so drift of a shared machine
hits all variants alike; time per batch = epoch time / batches. The rounds are split into blocks, and
each block builds all variants on a fresh model copy (memory placement alone can shift one copy's speed
by several percent, which is why the variants share it); garbage is collected between blocks, not during
the timed rounds (see run_model). The table reports medians over rounds and
ratios to the variant's raw reference: wall time, and process CPU time paired per round with a bootstrap
95% interval: the whole-epoch figure, one fit() call's fixed costs included. Per batch (PERF-1's
quantity): each round's median interval between batch hand-outs after the first five, paired with the raw
loop's in the same round (robust to a stray slow batch and to per-fit costs); for a loop that updates every
k batches (gradient accumulation) the intervals are averaged over runs of k batches first, so each holds
one update as the time per batch does; "p5" is the 5th percentile of those intervals pooled over all
rounds (a batch that nothing else on the machine slowed down). The
fixed cost of one fit() is the epoch's time beyond batches x its mean interval, over the raw loop's.

    python benchmarks/loop_overhead.py            # full run (a couple of minutes), writes JSON
    python benchmarks/loop_overhead.py --quick    # seconds; for smoke tests
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import logging
import random
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import RESULTS_DIR, Stamped, machine_info, median, quantile, quiet_stdout, write_json  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import deepepochs  # noqa: E402

#: PERF-1 limits per batch on the tiny model: console off (aim 1.03), default console, every edge.
PERF1_OFF, PERF1_DEFAULT, PERF1_EVERY_EDGE = 1.05, 1.10, 1.15


# ---- models and data ------------------------------------------------------------------------------
def tiny_model() -> nn.Module:
    """The seed README's quick-start model: a raw step is a few hundred µs, so overhead shows most."""
    return nn.Linear(16, 2)


def mlp_model() -> nn.Module:
    return nn.Sequential(nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


MODELS = {
    # name: (factory, input features, classes, batch size)
    "tiny": (tiny_model, 16, 2, 32),
    "mlp": (mlp_model, 128, 10, 64),
}


def make_batches(features: int, classes: int, batch_size: int, count: int) -> list:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch_size, features, generator=g),
             torch.randint(0, classes, (batch_size,), generator=g)) for _ in range(count)]


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-3)


# ---- variants: setup() is untimed, epoch(data) runs one timed epoch --------------------------------
class Raw:
    """The honest reference: zero_grad(set_to_none=True), forward, loss, backward, step."""

    reference = None
    window = 1  # batches per update: the per-batch statistic is taken over runs of this many batches
    note = "plain PyTorch loop"

    def __init__(self, model):
        self.model, self.opt = model, adam(model)

    def epoch(self, data):
        model, opt = self.model, self.opt
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()


class RawAccumulate(Raw):
    """Raw loop with 4 micro-batches per update (equal batches, so each loss is divided by 4)."""

    k = window = 4
    note = "plain PyTorch, 4 micro-batches per update"

    def epoch(self, data):
        model, opt, k = self.model, self.opt, self.k
        last = len(data) - 1
        for i, (x, y) in enumerate(data):
            loss = F.cross_entropy(model(x), y) / k
            loss.backward()
            if (i + 1) % k == 0 or i == last:
                opt.step()
                opt.zero_grad(set_to_none=True)


class RawAccumulateSeeded(RawAccumulate):
    """The k=4 raw loop seeding backward with 1/k (`loss.backward(seed)`) instead of dividing the loss, as
    deepepochs' fused window loop does: the same gradients, two autograd ops fewer per micro-batch. Its
    ratio to raw_acc4 is what that alone saves, so deepepochs_acc4's ratio over it is the loop's own cost."""

    reference = "raw_acc4"
    note = "plain PyTorch, 4 micro-batches per update, backward seeded with 1/4"

    def epoch(self, data):
        model, opt, k = self.model, self.opt, self.k
        seed = torch.tensor(1.0 / k)
        last = len(data) - 1
        for i, (x, y) in enumerate(data):
            F.cross_entropy(model(x), y).backward(seed)
            if (i + 1) % k == 0 or i == last:
                opt.step()
                opt.zero_grad(set_to_none=True)


class RawFp16(Raw):
    """Raw loop under CPU float16 autocast with torch.amp.GradScaler('cpu')."""

    note = "plain PyTorch, fp16 autocast + CPU GradScaler"

    def __init__(self, model):
        super().__init__(model)
        self.scaler = torch.amp.GradScaler("cpu")

    def epoch(self, data):
        model, opt, scaler = self.model, self.opt, self.scaler
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


class DeepEpochs:
    """deepepochs.Trainer.fit for one more epoch per call (the trainer is built once, untimed)."""

    reference = "raw"
    window = 1
    kwargs: dict = {"log_batch": False, "show_info": False}
    note = "console off (log_batch=False, show_info=False; epoch lines to devnull)"

    def __init__(self, model):
        self.epochs = 0
        with quiet_stdout():  # the console binds sys.stdout when it is created: keep it on devnull
            self.trainer = deepepochs.Trainer(model, F.cross_entropy, adam(model), device="cpu",
                                              **self.kwargs)

    def epoch(self, data):
        self.epochs += 1
        self.trainer.fit(data, epochs=self.epochs)

    def close(self):
        self.trainer.close()


class DeepEpochsDefault(DeepEpochs):
    kwargs = {}
    note = "default console (batch + epoch lines, run header) to a non-TTY stream"


class DeepEpochsEveryEdge(DeepEpochs):
    kwargs = {"log_batch": False, "show_info": False, "fuse_steps": False}
    note = "console off, fuse_steps=False (every edge recorded and probed)"


class DeepEpochsAccumulate(DeepEpochs):
    reference = "raw_acc4"
    window = 4
    kwargs = {"log_batch": False, "show_info": False, "gradient_accumulation_steps": 4}
    note = "console off, gradient_accumulation_steps=4"


class DeepEpochsFp16(DeepEpochs):
    reference = "raw_fp16"
    kwargs = {"log_batch": False, "show_info": False, "precision": "fp16"}
    note = "console off, precision='fp16' (CPU autocast + GradScaler)"


class DeepEpochsSnapshotsArmed(DeepEpochs):
    """A SnapshotCallback listening for SIGTERM only: the `snapshot` trigger fires at every commit point,
    a snapshot is written at each epoch's end (one file per fit() here, in the fixed cost)."""

    note = "console off, SnapshotCallback(on_signals=('SIGTERM',)): armed, nothing due mid-epoch"
    snapshot = {"on_signals": ("SIGTERM",)}

    def __init__(self, model):
        self.folder = tempfile.mkdtemp(prefix="deepepochs-bench-")
        self.kwargs = {**DeepEpochs.kwargs,
                       "callbacks": [deepepochs.SnapshotCallback(self.folder, **self.snapshot)]}
        super().__init__(model)

    def close(self):
        super().close()
        shutil.rmtree(self.folder, ignore_errors=True)


class DeepEpochsSnapshotEveryUpdate(DeepEpochsSnapshotsArmed):
    note = "console off, SnapshotCallback(every_n_updates=1): a snapshot file per update"
    snapshot = {"on_signals": ("SIGTERM",), "every_n_updates": 1}


class Ignite:
    """pytorch-ignite's create_supervised_trainer with its defaults (it reads loss.item() per batch)."""

    reference = "raw"
    note = "create_supervised_trainer, defaults"

    def __init__(self, model):
        from ignite.engine import create_supervised_trainer

        self.engine = create_supervised_trainer(model, adam(model), F.cross_entropy, device="cpu")

    def epoch(self, data):
        self.engine.run(data, max_epochs=1)


class Lightning:
    """lightning.Trainer.fit for one epoch (a new L.Trainer per epoch, built untimed; optimizer kept)."""

    reference = "raw"
    note = "no logger, checkpointing, progress bar or model summary"

    def __init__(self, model):
        import lightning as L

        for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning"):
            logging.getLogger(name).setLevel(logging.ERROR)
        opt = adam(model)

        class Module(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = model

            def training_step(self, batch, batch_idx):
                x, y = batch
                return F.cross_entropy(self.net(x), y)

            def configure_optimizers(self):
                return opt

        self.L, self.module, self.trainer = L, Module(), None

    def prepare(self):
        """Untimed, before each epoch: a fresh L.Trainer (fit() runs max_epochs once per trainer)."""
        self.trainer = self.L.Trainer(
            accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)

    def epoch(self, data):
        self.trainer.fit(self.module, train_dataloaders=data)


VARIANTS = {
    "raw": Raw,
    "deepepochs": DeepEpochs,
    "deepepochs_console": DeepEpochsDefault,
    "deepepochs_every_edge": DeepEpochsEveryEdge,
    "raw_acc4": RawAccumulate,
    "deepepochs_acc4": DeepEpochsAccumulate,
    "raw_acc4_seeded": RawAccumulateSeeded,
    "raw_fp16": RawFp16,
    "deepepochs_fp16": DeepEpochsFp16,
    "deepepochs_snapshots_armed": DeepEpochsSnapshotsArmed,
    "deepepochs_snapshot_every_update": DeepEpochsSnapshotEveryUpdate,
    "ignite": Ignite,
    "lightning": Lightning,
}
PEERS = {"ignite": "ignite", "lightning": "lightning"}


def available_variants(requested) -> tuple[list[str], dict]:
    skipped = {}
    names = []
    for name in requested:
        module = PEERS.get(name)
        if module is not None:
            try:
                __import__(module)
            except ImportError as e:
                skipped[name] = f"not installed ({e.msg}); pip install -e '.[bench]'"
                continue
        names.append(name)
    return names, skipped


# ---- the measurement ------------------------------------------------------------------------------
@contextlib.contextmanager
def gc_paused():
    """Automatic cyclic garbage collection off inside (see run_model)."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def paired_ratio(values: list[float], refs: list[float], seed: int = 0) -> tuple[float, float, float]:
    """Median of per-round ratios (each round runs every variant once, in random order, so the two runs of
    a pair are close in time) and its bootstrap 95% interval."""
    ratios = [a / b for a, b in zip(values, refs)]
    rng = random.Random(seed)
    boot = sorted(median(rng.choices(ratios, k=len(ratios))) for _ in range(1000))
    return median(ratios), boot[25], boot[974]


def run_model(model_name: str, variants: list[str], rounds: int, batches: int, blocks: int,
              gc_each_epoch: bool = False) -> list[dict]:
    """`rounds` interleaved rounds, split into `blocks`; each block builds every variant afresh (optimizer,
    trainer) on one new model copy that all of them train: where a copy's tensors land in memory can shift
    its speed by several percent for a whole block, so variants on separate copies would differ by that
    (measured here: up to 3 % between two copies under identical loops) and no number of rounds would
    average it out.

    The cyclic garbage collector runs between blocks, before the untimed warm-up epochs, and is off during
    the timed rounds. A `gc.collect()` walks every tracked object and leaves the CPU caches cold, so the
    epoch after it pays a start-up cost that grows with the code it runs (a 1-batch deepepochs fit takes
    ~2.0 ms after one instead of ~0.9 ms here); `gc_each_epoch=True` restores the older protocol that
    collected before every timed epoch."""
    factory, features, classes, batch_size = MODELS[model_name]
    torch.manual_seed(0)
    init = factory()
    data = Stamped(make_batches(features, classes, batch_size, batches))
    wall = {name: [] for name in variants}
    cpu = {name: [] for name in variants}
    steady = {name: [] for name in variants}
    fixed = {name: [] for name in variants}  # an epoch's time beyond batches x its steady time per batch
    typical = {name: [] for name in variants}  # each round's median batch-to-batch interval (per window)
    intervals = {name: [] for name in variants}
    order = list(variants)
    rng = random.Random(0)
    blocks = max(1, min(blocks, rounds))
    for block in range(blocks):
        model = copy.deepcopy(init)
        runners = {name: VARIANTS[name](model) for name in variants}
        prepare = {name: getattr(runner, "prepare", lambda: None) for name, runner in runners.items()}
        gc.collect()
        for name, runner in runners.items():  # warm-up epoch: optimizer state, first-call caches
            with quiet_stdout():
                prepare[name]()
                runner.epoch(data)
        with gc_paused():
            for _ in range(rounds // blocks + (block < rounds % blocks)):
                rng.shuffle(order)
                for name in order:
                    runner = runners[name]
                    with quiet_stdout():
                        prepare[name]()
                        if gc_each_epoch:
                            gc.collect()
                        start, start_cpu = time.perf_counter(), time.process_time()
                        runner.epoch(data)
                        elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
                    wall[name].append(elapsed / len(data) * 1e6)
                    cpu[name].append(elapsed_cpu / len(data) * 1e6)
                    steady[name].append(data.steady_us())
                    fixed[name].append(elapsed * 1e6 - len(data) * steady[name][-1])
                    per_batch = data.intervals_us(window=getattr(VARIANTS[name], "window", 1))
                    typical[name].append(median(per_batch))
                    intervals[name] += per_batch
        for runner in runners.values():
            getattr(runner, "close", lambda: None)()
    rows = []
    for name in variants:
        ref = VARIANTS[name].reference
        row = {
            "model": model_name, "variant": name, "reference": ref, "note": VARIANTS[name].note,
            "batch_size": batch_size, "batches": batches, "rounds": rounds, "blocks": blocks,
            "params": sum(p.numel() for p in init.parameters()),
            "us_per_batch": median(wall[name]), "cpu_us_per_batch": median(cpu[name]),
            "steady_us_per_batch": median(steady[name]),
            "p5_interval_us": quantile(intervals[name], 0.05),
            "fixed_us_per_epoch": median(fixed[name]),
            "rounds_us_per_batch": wall[name], "rounds_cpu_us_per_batch": cpu[name],
            "rounds_steady": steady[name],
        }
        if ref is not None and ref in wall:
            row["ratio"] = row["us_per_batch"] / median(wall[ref])
            row["cpu_ratio"] = row["cpu_us_per_batch"] / median(cpu[ref])
            row["steady_ratio"] = row["steady_us_per_batch"] / median(steady[ref])
            row["p5_ratio"] = row["p5_interval_us"] / quantile(intervals[ref], 0.05)
            row["paired_batch_ratio"], row["paired_batch_ci_low"], row["paired_batch_ci_high"] = paired_ratio(
                typical[name], typical[ref])
            row["fixed_us_over_ref"] = median(a - b for a, b in zip(fixed[name], fixed[ref]))
            row["paired_ratio"] = paired_ratio(wall[name], wall[ref])[0]
            row["paired_cpu_ratio"], row["paired_cpu_ci_low"], row["paired_cpu_ci_high"] = paired_ratio(
                cpu[name], cpu[ref])
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    lines = ["| model | variant | wall µs/batch | whole epochs: paired CPU ratio (95% CI)"
             " | per batch: paired median-interval ratio (95% CI) | p5 ratio | fixed µs per fit over ref |",
             "|---|---|---:|---:|---:|---:|---:|"]

    def paired(row, key):
        if key not in row:
            return "—"
        return f"{row[key]:.3f} ({row[key[:-6] + '_ci_low']:.3f}–{row[key[:-6] + '_ci_high']:.3f})"

    for row in rows:
        ref = f" (vs {row['reference']})" if row["reference"] not in (None, "raw") else ""
        p5 = f"{row['p5_ratio']:.3f}" if "p5_ratio" in row else "—"
        fixed = f"{row['fixed_us_over_ref']:.0f}" if "fixed_us_over_ref" in row else "—"
        lines.append(f"| {row['model']} | {row['variant']}{ref} | {row['us_per_batch']:.0f} |"
                     f" {paired(row, 'paired_cpu_ratio')} | {paired(row, 'paired_batch_ratio')} | {p5} |"
                     f" {fixed} |")
    return "\n".join(lines)


def perf1_verdict(rows: list[dict]) -> dict:
    """PERF-1 on the tiny model. Its quantity is the time per batch: judged on the paired per-batch ratio
    (each round's median batch-to-batch interval after the first five, over the raw loop's in the same
    round), which leaves out what one fit() call costs once (start, end-of-epoch metrics, the epoch line,
    the cold triggers), reported beside it in µs. The whole-epoch ratio (a fit() per 100-batch epoch, that
    fixed cost included) is judged too, and the p5 per-batch ratio shown."""
    tiny = {row["variant"]: row for row in rows if row["model"] == "tiny"}
    verdict = {}
    for variant, limit in (("deepepochs", PERF1_OFF), ("deepepochs_console", PERF1_DEFAULT),
                           ("deepepochs_every_edge", PERF1_EVERY_EDGE)):
        if variant in tiny:
            row = tiny[variant]
            verdict[variant] = {"per_batch_ratio": row["paired_batch_ratio"],
                                "per_batch_ci95": [row["paired_batch_ci_low"], row["paired_batch_ci_high"]],
                                "fixed_us_per_fit": row["fixed_us_over_ref"],
                                "whole_epoch_ratio": row["paired_cpu_ratio"],
                                "whole_epoch_ci95": [row["paired_cpu_ci_low"], row["paired_cpu_ci_high"]],
                                "wall_ratio": row["ratio"], "p5_ratio": row["p5_ratio"], "limit": limit,
                                "per_batch_met": row["paired_batch_ratio"] <= limit,
                                "whole_epoch_met": row["paired_cpu_ratio"] <= limit}
    return verdict


def snapshot_costs(rows: list[dict]) -> dict:
    """What SnapshotCallback adds on the tiny model, per batch (= per update: k=1): armed with nothing due,
    and writing a file at every update (issue 17: reported, no budget; snapshots off is PERF-1's case)."""
    tiny = {row["variant"]: row for row in rows if row["model"] == "tiny"}
    base = tiny.get("deepepochs")
    out = {}
    for variant in ("deepepochs_snapshots_armed", "deepepochs_snapshot_every_update"):
        if base is not None and variant in tiny:
            row = tiny[variant]
            out[variant] = {"us_per_batch_over_deepepochs": row["steady_us_per_batch"] - base["steady_us_per_batch"],
                            "paired_batch_ratio": row["paired_batch_ratio"],
                            "fixed_us_per_fit_over_raw": row["fixed_us_over_ref"]}
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="deepepochs loop overhead against a raw PyTorch loop")
    parser.add_argument("--rounds", type=int, default=50, help="interleaved rounds, tiny model")
    parser.add_argument("--mlp-rounds", type=int, default=15, help="interleaved rounds, MLP")
    parser.add_argument("--blocks", type=int, default=5,
                        help="rebuild every variant (fresh model copies) this many times per model")
    parser.add_argument("--tiny-batches", type=int, default=100, help="batches per epoch, tiny model")
    parser.add_argument("--mlp-batches", type=int, default=30, help="batches per epoch, MLP")
    parser.add_argument("--models", default="tiny,mlp", help="comma-separated: tiny, mlp")
    parser.add_argument("--variants", default="",
                        help=f"comma-separated subset of {list(VARIANTS)} (default: all on the tiny model;"
                             " all but the fp16 pair on the MLP, where CPU fp16 matmuls are slow)")
    parser.add_argument("--no-fsm", action="store_true", help="skip the FSM dispatch micro-benchmark")
    parser.add_argument("--gc-each-epoch", action="store_true",
                        help="gc.collect() before every timed epoch (cold caches each time; see run_model)")
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes (the numbers mean nothing)")
    parser.add_argument("--output", default=str(RESULTS_DIR / "loop_overhead.json"),
                        help="JSON file to write ('' for none)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.mlp_rounds, args.blocks, args.tiny_batches, args.mlp_batches = 2, 2, 1, 8, 4
    torch.set_num_threads(1)  # one thread: stable numbers, and the Python overhead is what we measure
    warnings.filterwarnings("ignore", module=r"(lightning|pytorch_lightning|lightning_fabric)(\.|$)")
    requested = [v for v in args.variants.split(",") if v]
    unknown = [v for v in requested if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    models = [m for m in args.models.split(",") if m]
    for model in models:
        if model not in MODELS:
            parser.error(f"unknown model {model!r}; choose from {list(MODELS)}")
    rows, skipped = [], {}
    t0 = time.perf_counter()
    for model in models:
        wanted = requested or [v for v in VARIANTS if model == "tiny" or "fp16" not in v]
        variants, skipped_now = available_variants(wanted)
        skipped.update(skipped_now)
        batches = args.tiny_batches if model == "tiny" else args.mlp_batches
        rounds = args.rounds if model == "tiny" else args.mlp_rounds
        print(f"measuring {model}: {len(variants)} variants x {rounds} rounds ({args.blocks} blocks) x"
              f" {batches} batches",
              file=sys.stderr)
        rows += run_model(model, variants, rounds, batches, args.blocks, args.gc_each_epoch)
    info = machine_info()
    print(f"## Loop overhead: {info['cpu']}, torch {info['torch']}, 1 thread\n")
    print("Per round every variant runs one epoch (one fit() call for deepepochs), in random order; ratios"
          " are medians of per-round ratios to the variant's raw loop (95% bootstrap CI). Whole epochs:"
          " process time of the epoch. Per batch: the epoch's median batch-to-batch interval after the"
          " first five. Fixed per fit: the epoch's time beyond batches x its mean interval, over the raw"
          " loop's.\n")
    print(format_table(rows))
    for name, why in skipped.items():
        print(f"\n_{name} skipped: {why}_")
    payload = {"benchmark": "loop_overhead", "machine": info, "settings": vars(args), "skipped": skipped,
               "results": rows}
    verdict = perf1_verdict(rows)
    if verdict:
        payload["perf1"] = verdict
        print("\nPERF-1 (tiny model): " + "; ".join(
            f"{k} {v['per_batch_ratio']:.3f}x per batch (95% CI {v['per_batch_ci95'][0]:.3f}-"
            f"{v['per_batch_ci95'][1]:.3f}; limit {v['limit']:.2f}x): {'met' if v['per_batch_met'] else 'NOT met'},"
            f" plus {v['fixed_us_per_fit']:.0f} µs once per fit(); whole 100-batch epochs"
            f" {v['whole_epoch_ratio']:.3f}x CPU: {'met' if v['whole_epoch_met'] else 'NOT met'}"
            for k, v in verdict.items()))
    snapshots = snapshot_costs(rows)
    if snapshots:
        payload["snapshots"] = snapshots
        print("\nSnapshots (tiny model): " + "; ".join(
            f"{k}: +{v['us_per_batch_over_deepepochs']:.1f} µs per batch over deepepochs without"
            f" ({v['paired_batch_ratio']:.3f}x the raw loop per batch)" for k, v in snapshots.items()))
    if not args.no_fsm:
        import fsm_dispatch

        fsm = fsm_dispatch.measure(n=2000 if args.quick else 20000)
        payload["fsm_dispatch"] = fsm
        print("\n## FSM dispatch (no-op guards and actions)\n")
        print(fsm_dispatch.format_table(fsm))
    payload["elapsed_s"] = time.perf_counter() - t0
    if args.output:
        write_json(args.output, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
