"""Loop overhead: deepepochs against a raw PyTorch loop (and Ignite / Lightning when installed).

Every variant trains the same model (one copy per block, shared by all variants, so that their tensors
sit in the same memory) with its own optimizer of the same settings on the same batches, on the CPU
with one thread. Two feeds (`--feeds`): the batches through one `DataLoader(TensorDataset(x, y),
batch_size)`, as users feed data, or as a list of pre-batched (x, y) tensors (no DataLoader cost); see
`common.FEEDS`. In every round each
variant runs one epoch (a fit() call or the raw loop), in a random order, so drift of a shared machine
hits all variants alike; time per batch = epoch time / batches. The rounds are split into blocks, and
each block builds all variants on a fresh model copy (memory placement alone can shift one copy's speed
by several percent, which is why the variants share it); garbage is collected between blocks, not during
the timed rounds (see run_model). The table reports medians over rounds and
ratios to the variant's raw reference: wall time, and process CPU time paired per round with a bootstrap
95% interval: the whole-epoch figure, one fit() call's fixed costs included. Per batch (the loop-overhead budget's
quantity): each round's median interval between batch hand-outs after the first five, paired with the raw
loop's in the same round (robust to a stray slow batch and to per-fit costs); for a loop that updates every
k batches (gradient accumulation) the intervals are averaged over runs of k batches first, so each holds
one update as the time per batch does; "p5" is the 5th percentile of those intervals pooled over all
rounds (a batch that nothing else on the machine slowed down). The
fixed cost of one fit() is the epoch's time beyond batches x its mean interval, over the raw loop's.

    python benchmarks/loop_overhead.py            # full run (~4 min of CPU), prints the summary, writes JSON
    python benchmarks/loop_overhead.py --quick    # seconds; for smoke tests
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import logging
import os
import random
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import FEEDS, RESULTS_DIR, machine_info, median, print_verdicts, quantile, quiet_stdout, write_json  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

import deepepochs  # noqa: E402

#: The performance budget, per batch against the raw loop of the same run: tiny model fed by a
#: DataLoader, console off; MLP; `fuse_steps=False`; k=4 accumulation against the raw k=4 loop; the
#: default console over console off; the slack allowed over pytorch-ignite on the MLP.
TINY_LIMIT, MLP_LIMIT, EVERY_EDGE_LIMIT, ACC_LIMIT = 1.10, 1.02, 1.20, 1.03
CONSOLE_SLACK, MLP_IGNITE_SLACK = 0.02, 0.005
PROFILED_LIMIT = 1.05  # a profiled fit per batch, over deepepochs without the profiler


# ---- models and data ------------------------------------------------------------------------------
def tiny_model() -> nn.Module:
    """The seed README's quick-start model: a raw step is a few hundred µs, so overhead shows most."""
    return nn.Linear(16, 2)


def mlp_model() -> nn.Module:
    """The issue's MLP (784-512-512-10, MNIST-sized): the part of the loop's cost that grows with the model
    (a pass over the gradients) shows here."""
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))


MODELS = {
    # name: (factory, input features, classes, batch size)
    "tiny": (tiny_model, 16, 2, 32),
    "mlp": (mlp_model, 784, 10, 128),
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


class DeepEpochsProfiled(DeepEpochs):
    note = "console off, ProfileCallback() (every state timed; its summary to devnull)"

    def __init__(self, model):
        self.kwargs = {**DeepEpochs.kwargs, "callbacks": [deepepochs.ProfileCallback()]}
        super().__init__(model)


class DeepEpochsUpdateClock(DeepEpochs):
    """Training by updates: the update clock asks at every committed update whether a validation point or the
    budget is due (neither is, inside the measured batches: the points fall every 10**6 updates)."""

    kwargs = {"log_batch": False, "show_info": False, "max_updates": 10**9}
    note = "console off, the update clock: max_updates=10**9, fit(val_every_n_updates=10**6)"
    val = [(torch.zeros(4, 16), torch.zeros(4, dtype=torch.long))]  # never read: no point falls due

    def epoch(self, data):
        self.epochs += 1
        self.trainer.fit(data, self.val, epochs=self.epochs, val_every_n_updates=10**6)


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
    "deepepochs_profiled": DeepEpochsProfiled,
    "deepepochs_clock": DeepEpochsUpdateClock,
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
              gc_each_epoch: bool = False, feed: str = "tensors") -> list[dict]:
    """`rounds` interleaved rounds, split into `blocks`; each block builds every variant afresh (optimizer,
    trainer) on one new model copy that all of them train: where a copy's tensors land in memory can shift
    its speed by several percent for a whole block, so variants on separate copies would differ by that
    (measured here: up to 3 % between two copies under identical loops) and no number of rounds would
    average it out.

    The cyclic garbage collector runs between blocks, before the untimed warm-up epochs, and is off during
    the timed rounds. A `gc.collect()` walks every tracked object and leaves the CPU caches cold, so the
    epoch after it pays a start-up cost that grows with the code it runs (a 1-batch deepepochs fit takes
    ~2.0 ms after one instead of ~0.9 ms here); `gc_each_epoch=True` restores the older protocol that
    collected before every timed epoch.

    `feed`: "tensors" hands every loop the same list of pre-batched tensors; "loader" the same batches
    through one `DataLoader(TensorDataset, batch_size)` (`common.FEEDS`)."""
    factory, features, classes, batch_size = MODELS[model_name]
    torch.manual_seed(0)
    init = factory()
    stamped = FEEDS[feed](make_batches(features, classes, batch_size, batches))
    data = stamped.data
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
                        stamped.reset()
                        start, start_cpu = time.perf_counter(), time.process_time()
                        runner.epoch(data)
                        elapsed, elapsed_cpu = time.perf_counter() - start, time.process_time() - start_cpu
                    wall[name].append(elapsed / len(data) * 1e6)
                    cpu[name].append(elapsed_cpu / len(data) * 1e6)
                    steady[name].append(stamped.steady_us())
                    fixed[name].append(elapsed * 1e6 - len(data) * steady[name][-1])
                    per_batch = stamped.intervals_us(window=getattr(VARIANTS[name], "window", 1))
                    typical[name].append(median(per_batch))
                    intervals[name] += per_batch
        for runner in runners.values():
            getattr(runner, "close", lambda: None)()
    rows = []
    for name in variants:
        ref = VARIANTS[name].reference
        row = {
            "model": model_name, "feed": feed, "variant": name, "reference": ref, "note": VARIANTS[name].note,
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
            row["own_us_per_batch"] = median(a - b for a, b in zip(typical[name], typical[ref]))
            row["ref_us_per_batch"] = median(typical[ref])
            row["fixed_us_over_ref"] = median(a - b for a, b in zip(fixed[name], fixed[ref]))
            row["paired_ratio"] = paired_ratio(wall[name], wall[ref])[0]
            row["paired_cpu_ratio"], row["paired_cpu_ci_low"], row["paired_cpu_ci_high"] = paired_ratio(
                cpu[name], cpu[ref])
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    """Every row of the run with all its figures (the JSON holds the per-round values too)."""
    lines = ["| model | feed | variant | wall µs/batch | whole epochs: paired CPU ratio (95% CI)"
             " | per batch: paired median-interval ratio (95% CI) | own µs/batch | p5 ratio"
             " | fixed µs per fit over ref |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]

    def paired(row, key):
        if key not in row:
            return "—"
        return f"{row[key]:.3f} ({row[key[:-6] + '_ci_low']:.3f}–{row[key[:-6] + '_ci_high']:.3f})"

    for row in rows:
        ref = f" (vs {row['reference']})" if row["reference"] not in (None, "raw") else ""
        p5 = f"{row['p5_ratio']:.3f}" if "p5_ratio" in row else "—"
        fixed = f"{row['fixed_us_over_ref']:.0f}" if "fixed_us_over_ref" in row else "—"
        own = f"{row['own_us_per_batch']:+.1f}" if "own_us_per_batch" in row else "—"
        lines.append(f"| {row['model']} | {row['feed']} | {row['variant']}{ref} | {row['us_per_batch']:.0f} |"
                     f" {paired(row, 'paired_cpu_ratio')} | {paired(row, 'paired_batch_ratio')} | {own} | {p5} |"
                     f" {fixed} |")
    return "\n".join(lines)


#: The columns of the summary table: (variant, header).
SUMMARY_COLUMNS = [("deepepochs", "deepepochs, console off"), ("deepepochs_console", "default console"),
                   ("deepepochs_every_edge", "`fuse_steps=False`"), ("deepepochs_acc4", "k=4 (vs raw k=4)"),
                   ("ignite", "pytorch-ignite"), ("lightning", "Lightning")]
MODEL_TITLES = {"tiny": "tiny (Linear 16→2, batch 32)", "mlp": "MLP 784-512-512-10, batch 128"}
FEED_TITLES = {"loader": "DataLoader", "tensors": "pre-batched tensors"}


def summary_table(rows: list[dict]) -> str:
    """One line per model and feed: the raw loop's µs per batch, then each variant's paired per-batch ratio
    (deepepochs' own µs per batch beside its console-off ratio). The table for docs/benchmarks.md and the
    README."""
    groups: dict = {}
    for row in rows:
        groups.setdefault((row["model"], row["feed"]), {})[row["variant"]] = row
    columns = [(v, h) for v, h in SUMMARY_COLUMNS if any(v in g for g in groups.values())]
    lines = ["| model | data | raw loop µs/batch | " + " | ".join(h for _, h in columns) + " |",
             "|---|---|---:|" + "---:|" * len(columns)]
    for (model, feed), found in groups.items():
        raw = found.get("raw")
        cells = []
        for variant, _ in columns:
            row = found.get(variant)
            if row is None or "paired_batch_ratio" not in row:
                cells.append("—")
            elif variant == "deepepochs":
                cells.append(f"{row['paired_batch_ratio']:.3f}× ({row['own_us_per_batch']:+.0f} µs)")
            else:
                cells.append(f"{row['paired_batch_ratio']:.3f}×")
        raw_us = f"{median(raw['rounds_steady']):.0f}" if raw else "—"
        lines.append(f"| {MODEL_TITLES.get(model, model)} | {FEED_TITLES.get(feed, feed)} | {raw_us} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def budget_verdict(rows: list[dict]) -> list[dict]:
    """The performance budget, judged on the paired per-batch ratios of this run (each round's median
    batch-to-batch interval over the raw loop's in the same round; a fit() call's fixed cost is reported
    apart). Returns one record per budget line that this run measured."""
    by = {(r["model"], r["feed"], r["variant"]): r for r in rows if "paired_batch_ratio" in r}
    out = []

    def ratio(model, feed, variant):
        row = by.get((model, feed, variant))
        return None if row is None else row["paired_batch_ratio"]

    def add(what, value, limit, met):
        out.append({"budget": what, "value": value, "limit": limit, "met": bool(met)})

    for feed in FEED_TITLES:
        de, ig, li = (ratio("tiny", feed, v) for v in ("deepepochs", "ignite", "lightning"))
        if de is not None and feed == "loader":
            add("tiny, DataLoader, console off <= 1.10x", de, TINY_LIMIT, de <= TINY_LIMIT)
        if de is not None and ig is not None:
            add(f"tiny, {FEED_TITLES[feed]}, console off below pytorch-ignite", de, ig, de < ig)
        con = ratio("tiny", feed, "deepepochs_console")
        if de is not None and con is not None:
            add(f"tiny, {FEED_TITLES[feed]}, default console <= console off + 0.02", con, de + CONSOLE_SLACK,
                con <= de + CONSOLE_SLACK)
        profiled = ratio("tiny", feed, "deepepochs_profiled")
        if de is not None and profiled is not None:
            add(f"tiny, {FEED_TITLES[feed]}, ProfileCallback <= 1.05x console off", profiled / de, PROFILED_LIMIT,
                profiled / de <= PROFILED_LIMIT)
        every = ratio("tiny", feed, "deepepochs_every_edge")
        if every is not None:
            add(f"tiny, {FEED_TITLES[feed]}, fuse_steps=False <= 1.20x", every, EVERY_EDGE_LIMIT,
                every <= EVERY_EDGE_LIMIT)
        acc = ratio("tiny", feed, "deepepochs_acc4")
        if acc is not None:
            add(f"tiny, {FEED_TITLES[feed]}, k=4 <= 1.03x", acc, ACC_LIMIT, acc <= ACC_LIMIT)
        if de is not None and li is not None:
            add(f"tiny, {FEED_TITLES[feed]}, Lightning behind", li, de, li > de)
        de, ig, li = (ratio("mlp", feed, v) for v in ("deepepochs", "ignite", "lightning"))
        if de is not None:
            add(f"MLP, {FEED_TITLES[feed]}, console off <= 1.02x", de, MLP_LIMIT, de <= MLP_LIMIT)
        if de is not None and ig is not None:
            add(f"MLP, {FEED_TITLES[feed]}, <= pytorch-ignite + 0.005", de, ig + MLP_IGNITE_SLACK,
                de <= ig + MLP_IGNITE_SLACK)
        if de is not None and li is not None:
            add(f"MLP, {FEED_TITLES[feed]}, Lightning behind", li, de, li > de)
    return out


def snapshot_costs(rows: list[dict]) -> dict:
    """What SnapshotCallback adds on the tiny model, per batch (= per update: k=1): armed with nothing due,
    and writing a file at every update (reported, no budget; snapshots off is the loop-overhead budget's case)."""
    tiny = {row["variant"]: row for row in rows if row["model"] == "tiny" and row["feed"] == "tensors"}
    base = tiny.get("deepepochs")
    out = {}
    for variant in ("deepepochs_snapshots_armed", "deepepochs_snapshot_every_update"):
        if base is not None and variant in tiny:
            row = tiny[variant]
            out[variant] = {"us_per_batch_over_deepepochs": row["steady_us_per_batch"] - base["steady_us_per_batch"],
                            "paired_batch_ratio": row["paired_batch_ratio"],
                            "fixed_us_per_fit_over_raw": row["fixed_us_over_ref"]}
    return out


#: Variants measured by default: all budget lines on the tiny model, the main ones on the MLP (its
#: batches cost ~15 ms on a 2-core box, so each variant adds a minute per feed). The others (fp16, the
#: seeded k=4 loop, snapshots) run with --variants.
DEFAULT_VARIANTS = {
    "tiny": ["raw", "deepepochs", "deepepochs_console", "deepepochs_every_edge", "deepepochs_profiled", "raw_acc4",
             "deepepochs_acc4", "ignite", "lightning"],
    "mlp": ["raw", "deepepochs", "deepepochs_console", "raw_acc4", "deepepochs_acc4", "ignite", "lightning"],
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="deepepochs loop overhead against a raw PyTorch loop")
    parser.add_argument("--rounds", type=int, default=40, help="interleaved rounds, tiny model")
    parser.add_argument("--mlp-rounds", type=int, default=12, help="interleaved rounds, MLP")
    parser.add_argument("--blocks", type=int, default=4,
                        help="rebuild every variant (fresh model copies) this many times per model")
    parser.add_argument("--tiny-batches", type=int, default=100, help="batches per epoch, tiny model")
    parser.add_argument("--mlp-batches", type=int, default=24, help="batches per epoch, MLP")
    parser.add_argument("--models", default="tiny,mlp", help=f"comma-separated subset of {list(MODELS)}")
    parser.add_argument("--feeds", default="loader,tensors",
                        help="comma-separated: loader (a DataLoader over a TensorDataset, as users feed data),"
                             " tensors (a list of pre-batched tensors)")
    parser.add_argument("--variants", default="",
                        help=f"comma-separated subset of {list(VARIANTS)} (default: {DEFAULT_VARIANTS})")
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
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")  # Lightning on a DataLoader
    requested = [v for v in args.variants.split(",") if v]
    unknown = [v for v in requested if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    models = [m for m in args.models.split(",") if m]
    for model in models:
        if model not in MODELS:
            parser.error(f"unknown model {model!r}; choose from {list(MODELS)}")
    feeds = [f for f in args.feeds.split(",") if f]
    for feed in feeds:
        if feed not in FEEDS:
            parser.error(f"unknown feed {feed!r}; choose from {list(FEEDS)}")
    rows, skipped = [], {}
    t0 = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    for model in models:
        for feed in feeds:
            variants, skipped_now = available_variants(requested or DEFAULT_VARIANTS[model])
            skipped.update(skipped_now)
            batches = args.tiny_batches if model == "tiny" else args.mlp_batches
            rounds = args.rounds if model == "tiny" else args.mlp_rounds
            print(f"measuring {model} fed by {feed}: {len(variants)} variants x {rounds} rounds ({args.blocks}"
                  f" blocks) x {batches} batches", file=sys.stderr)
            rows += run_model(model, variants, rounds, batches, args.blocks, args.gc_each_epoch, feed)
    info = machine_info()
    info["load_average_at_start"] = load
    verdict = budget_verdict(rows)
    loaded = f"; load average {load:.1f} at the start" if load is not None else ""
    print(f"## Loop overhead ({info['date']}): {info['cpu']}, {info['cpu_count']} cores{loaded}, torch"
          f" {info['torch']}, 1 thread, Adam\n")
    print("Per batch against a plain PyTorch loop in the same run, interleaved rounds (each round's median"
          " batch-to-batch interval over the raw loop's, median over rounds); deepepochs' own µs per batch"
          " beside its ratio. Reproduce with `make bench`.\n")
    print(summary_table(rows))
    print_verdicts(verdict, 3, "Every figure", format_table(rows), skipped)
    payload = {"benchmark": "loop_overhead", "machine": info, "settings": vars(args), "skipped": skipped,
               "summary": summary_table(rows), "budget": verdict, "results": rows}
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
