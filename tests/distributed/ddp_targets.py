"""Training functions that ``tests/distributed/test_ddp.py`` runs in two processes through ``launch``.

Spawned children import their ``main`` by module and name, so the functions live here, not in the test
module. Each rank writes what it observed to ``$DEEPEPOCHS_TEST_OUT/rank<r>.pt``; the parent process
compares the files with references it computes itself (plain PyTorch and a single-process Trainer).
The data, model and optimizer builders are shared with the parent so both sides start identically.
"""

import json
import os
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from deepepochs import Callback, CheckCallback, InterpreteCallback, Trainer
from deepepochs.checkpoint.run_lock import LOCK_FILE, RunLock
from deepepochs.errors import CheckpointError, ConfigError, DistributedError, RunLockedError

__all__ = [
    "BATCH",
    "EPOCHS",
    "OUT_ENV",
    "TRAIN_N",
    "VAL_N",
    "accuracy",
    "make_data",
    "make_model",
    "make_optimizer",
    "raise_on_rank_1_during_training",
    "run_scenarios",
    "sample_count",
    "trainer_kwargs",
]

OUT_ENV = "DEEPEPOCHS_TEST_OUT"
FEATURES, CLASSES = 5, 3
TRAIN_N = 36  # even: DistributedSampler pads nothing, so the shards hold exactly the dataset
VAL_N = 37  # odd: the evaluation shards differ in length (19 and 18 samples)
BATCH = 4  # per rank; the single-process reference uses 2 * BATCH
EPOCHS = 3


# ---- shared by the workers and the parent ----------------------------------------------------------
def make_data(n: int, seed: int, index_feature: bool = False) -> TensorDataset:
    """A classification dataset; with `index_feature` the first feature is the sample's index."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=generator)
    if index_feature:
        x[:, 0] = torch.arange(n, dtype=x.dtype)
    y = torch.randint(0, CLASSES, (n,), generator=generator)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    """The same initial weights in every process (no BatchNorm: its statistics are per-rank by design)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, CLASSES))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum: the momentum buffer makes any gradient error persist across updates."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def accuracy(preds, targets):
    """Fraction of correct argmax predictions."""
    return (preds.argmax(-1) == targets).float().mean()


def sample_count(preds, targets):
    """Number of samples the metric saw: exposes duplicated or lost evaluation samples."""
    return torch.tensor(float(len(targets)))


def trainer_kwargs(**overrides) -> dict:
    """Keyword arguments of every Trainer in these tests (quiet, CPU, fp32)."""
    return {"epochs": EPOCHS, "device": "cpu", "metrics": [accuracy, sample_count], "log_batch": False,
            "show_info": False, **overrides}


# ---- in the workers ----------------------------------------------------------------------------------
def _counting_allreduce(calls: list, bucket):
    """DDP communication hook: count gradient all-reduces, then do the default one."""
    calls.append(bucket.index())
    return default_hooks.allreduce_hook(None, bucket)


def _state(model: nn.Module) -> dict:
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def _train(k: int = 1, batch_size: int = BATCH, split_batches: bool = False) -> dict:
    """Fit with validation, then test; weights, records, test metrics and gradient all-reduce count."""
    train_dl = DataLoader(make_data(TRAIN_N, 1), batch_size=batch_size)
    val_dl = DataLoader(make_data(VAL_N, 2), batch_size=6)
    model = make_model()
    kwargs = trainer_kwargs(gradient_accumulation_steps=k, split_batches=split_batches)
    with Trainer(model, F.cross_entropy, make_optimizer(model), **kwargs) as trainer:
        syncs: list = []
        trainer.model.register_comm_hook(syncs, _counting_allreduce)
        records = trainer.fit(train_dl, val_dl)
        test = trainer.test(val_dl)
        group_during_fit = dist.is_initialized()
        return {"state": _state(trainer.raw_model), "records": records, "test": test, "syncs": len(syncs),
                "world_size": trainer.world_size, "is_main": trainer.is_main_process,
                "group_during_fit": group_during_fit}


class _WithUnusedBranch(nn.Module):
    """`make_model()` plus a head the forward never uses: DDP needs find_unused_parameters=True."""

    def __init__(self):
        super().__init__()
        self.used = make_model()
        self.unused = nn.Linear(FEATURES, CLASSES)

    def forward(self, x):
        return self.used(x)


def _unused_parameters() -> dict:
    """Training a model with an unused parameter, with ddp_kwargs={'find_unused_parameters': True}."""
    model = _WithUnusedBranch()
    unused_before = _state(model.unused)
    kwargs = trainer_kwargs(metrics=None, ddp_kwargs={"find_unused_parameters": True})
    with Trainer(model, F.cross_entropy, make_optimizer(model), **kwargs) as trainer:
        trainer.fit(DataLoader(make_data(TRAIN_N, 1), batch_size=BATCH))
        return {"used": _state(model.used), "unused_before": unused_before, "unused": _state(model.unused),
                "find_unused_parameters": trainer.model.find_unused_parameters}


def _error_of(run) -> dict | None:
    try:
        run()
    except (ConfigError, DistributedError) as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return None


def _split_batches_error() -> dict | None:
    """split_batches with a batch size the world size does not divide."""
    model = make_model()
    with Trainer(model, F.cross_entropy, make_optimizer(model), **trainer_kwargs(split_batches=True)) as t:
        return _error_of(lambda: t.fit(DataLoader(make_data(TRAIN_N, 1), batch_size=5)))


def _uneven_training_error() -> dict | None:
    """A user sampler giving rank 0 two batches and rank 1 one: an error at fit(), not a hang."""
    dataset = make_data(TRAIN_N, 1)
    indices = list(range(8 if os.environ["RANK"] == "0" else 4))
    model = make_model()
    with Trainer(model, F.cross_entropy, make_optimizer(model), **trainer_kwargs()) as trainer:
        return _error_of(lambda: trainer.fit(DataLoader(dataset, batch_size=BATCH, sampler=indices)))


def _save_failure_on_rank_0(out: Path) -> dict:
    """Rank 0 cannot write its checkpoint (a folder of the user's stands where the file goes; a ckpt_dir
    that cannot be made at all is refused before training, by the run lock): every rank raises
    CheckpointError at that epoch's end, none trains on into a collective rank 0 never joins; a later fit
    of the same trainer with a writable folder works on both."""
    blocked = out / "blocked"
    monitor = CheckCallback("loss", on_stage="train", ckpt_dir=blocked)

    class Block(Callback):
        def on_before_epoch(self, trainer, *args):
            target = monitor.path(trainer)
            if os.environ["RANK"] == "0" and monitor.ckpt_dir == blocked and not target.exists():
                target.mkdir(parents=True)
                (target / "notes.txt").write_text("the user's own file, where the checkpoint should go")

    model = make_model()
    with Trainer(model, F.cross_entropy, make_optimizer(model),
                 **trainer_kwargs(callbacks=[monitor, Block()], epochs=2)) as t:
        try:
            t.fit(DataLoader(make_data(TRAIN_N, 1), batch_size=BATCH))
            error = None
        except CheckpointError as exc:
            error = str(exc)
        monitor.ckpt_dir = out / "writable"
        records = t.fit(DataLoader(make_data(TRAIN_N, 1), batch_size=BATCH))
        return {"error": error, "completed": t.loop.completed_epochs, "records": records,
                "written": monitor.path(t).is_file()}


def _run_lock_on_rank_0(out: Path) -> dict:
    """Another process holds run `run`'s checkpoint folder (rank 0 itself, through a second descriptor): the
    fit raises RunLockedError on both ranks, the same message, before training; once the folder is free both
    ranks fit, and during that fit the lock file names rank 0 (the one process that locks)."""
    folder = out / "locked"
    other = RunLock([folder / "run"], "run")
    if os.environ["RANK"] == "0":
        assert other.try_acquire() == (None, [])
    seen = []

    class Look(Callback):
        def on_before_epoch(self, trainer, *args):
            seen.append(json.loads((folder / "run" / LOCK_FILE).read_text())["pid"])

    monitor = CheckCallback("loss", on_stage="train", ckpt_dir=folder)
    model = make_model()
    with Trainer(model, F.cross_entropy, make_optimizer(model),
                 **trainer_kwargs(callbacks=[monitor, Look()], epochs=2, running_id="run")) as t:
        try:
            t.fit(DataLoader(make_data(TRAIN_N, 1), batch_size=BATCH))
            error = None
        except RunLockedError as exc:
            error = str(exc)
        other.release()
        t.fit(DataLoader(make_data(TRAIN_N, 1), batch_size=BATCH))
        return {"error": error, "pid": os.getpid(), "seen": seen, "completed": t.loop.completed_epochs,
                "left": (folder / "run" / LOCK_FILE).exists()}


def _tiny_test_set() -> dict:
    """Test on one sample: rank 1's shard is empty and holds no metric patch at all."""
    model = make_model()
    with Trainer(model, F.cross_entropy, make_optimizer(model), **trainer_kwargs()) as trainer:
        dataset = make_data(VAL_N, 2)
        return trainer.test(DataLoader(TensorDataset(*dataset[:1]), batch_size=5))


class IndexedOutputs(nn.Module):
    """`make_model()` whose forward also returns each sample's index (first feature): a nested output."""

    def __init__(self):
        super().__init__()
        self.net = make_model()

    def forward(self, x):
        return {"logits": self.net(x), "index": x[:, 0].round().long()}


def _predict() -> dict:
    """predict over VAL_N samples (odd: uneven shards) and over one sample (rank 1's shard is empty);
    each rank's return value, and a fit afterwards still runs."""
    model = IndexedOutputs()
    loss = lambda out, y: F.cross_entropy(out["logits"], y)  # noqa: E731
    with Trainer(model, loss, make_optimizer(model), **trainer_kwargs(metrics=None, epochs=1)) as trainer:
        dataset = make_data(VAL_N, 2, index_feature=True)
        full = trainer.predict(DataLoader(dataset, batch_size=6))
        one = trainer.predict(DataLoader(TensorDataset(*dataset[:1]), batch_size=5))
        fitted = trainer.fit(DataLoader(make_data(TRAIN_N, 1), batch_size=BATCH))
    return {"full": full, "one": one, "fit_epochs": len(fitted["train"]["loss"])}


def _find_lr() -> dict:
    """find_lr over two ranks: the rates and losses each rank saw, and whether the weights came back."""
    model = make_model()
    before = _state(model)
    with Trainer(model, F.cross_entropy, make_optimizer(model), **trainer_kwargs(metrics=None)) as trainer:
        result = trainer.find_lr(DataLoader(make_data(TRAIN_N, 1), batch_size=BATCH), min_lr=1e-3, max_lr=10.0,
                                 num_steps=12, plot=False)
        restored = all(torch.equal(before[k], v) for k, v in trainer.raw_model.state_dict().items())
        fitted = trainer.fit(DataLoader(make_data(TRAIN_N, 1), batch_size=BATCH), epochs=1)
    return {"lrs": result.lrs, "losses": result.losses, "restored": restored,
            "fit_epochs": len(fitted["train"]["loss"])}


class _FailBeforeUpdate(Callback):
    """Raises on every rank once, before the update of training batch 3 (after its forward and backward)."""

    def __init__(self):
        self.armed = True

    def on_before_optimize(self, trainer, optimize_index):
        if self.armed and trainer.loop.batch_idx == 3:
            self.armed = False
            raise RuntimeError("failed before the update on every rank")


def _batchnorm_refit() -> dict:
    """A BatchNorm model (DDP broadcasts rank 0's buffers before each forward): a callback raises before
    the update of batch 3, the refit finishes; and the same run never interrupted. Every tensor of each,
    buffers included."""
    def fit(callbacks):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(FEATURES, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, CLASSES))
        with Trainer(model, F.cross_entropy, make_optimizer(model),
                     **trainer_kwargs(metrics=None, callbacks=callbacks)) as trainer:
            data = DataLoader(make_data(TRAIN_N, 1), batch_size=BATCH)
            try:
                trainer.fit(data)
            except RuntimeError:
                trainer.fit(data)
            return _state(trainer.raw_model)

    return {"refit": fit([_FailBeforeUpdate()]), "whole": fit([])}


def interprete_metrics() -> dict:
    """Per-sample metrics for InterpreteCallback: a continuous one, and one with many ties (the label)."""
    return {"loss": lambda p, y: F.cross_entropy(p, y, reduction="none"), "label": lambda p, y: y.float()}


def _interprete_top_samples() -> dict:
    """The samples InterpreteCallback keeps under DDP (k=5, mode='max'), as (value, sample index) lists, and
    the confusion matrix the 'loss' watcher counted (confusion=True)."""
    watchers = {name: InterpreteCallback(metric, k=5, confusion=name == "loss")
                for name, metric in interprete_metrics().items()}
    model = make_model()
    kwargs = trainer_kwargs(callbacks=list(watchers.values()))
    with Trainer(model, F.cross_entropy, make_optimizer(model), **kwargs) as trainer:
        trainer.test(DataLoader(make_data(VAL_N, 2, index_feature=True), batch_size=6))
    out = {name: [(value, int(x[0].round())) for value, _, _, x in w.top_samples()]
           for name, w in watchers.items()}
    out["confusion"] = watchers["loss"].confusion_matrix("test").tolist()
    return out


class _RecordIndices(Callback):
    """Records the sample indices (first feature) of every training batch, per epoch."""

    def __init__(self):
        self.seen: dict = {}

    def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
        self.seen.setdefault(trainer.loop.epoch, []).extend(batch_x[:, 0].round().long().tolist())


def _shuffled_indices() -> dict:
    """shuffle=True: the indices each rank trains on, per epoch."""
    recorder = _RecordIndices()
    dl = DataLoader(make_data(16, 3, index_feature=True), batch_size=BATCH, shuffle=True)
    model = make_model()
    kwargs = trainer_kwargs(epochs=2, metrics=None, callbacks=[recorder])
    with Trainer(model, F.cross_entropy, make_optimizer(model), **kwargs) as trainer:
        trainer.fit(dl)
    return recorder.seen


class _RankDependentInit(Callback):
    """Re-initialises every parameter to `rank + 1` before the fit: ranks disagree until broadcast."""

    def on_before_fit(self, trainer, epochs):
        with torch.no_grad():
            for parameter in trainer.raw_model.parameters():
                parameter.fill_(dist.get_rank() + 1.0)


def _broadcast_after_init_callbacks() -> list:
    """After a fit with lr=0 every parameter must hold rank 0's value, 1.0."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    kwargs = trainer_kwargs(epochs=1, metrics=None, callbacks=[_RankDependentInit()])
    with Trainer(model, F.cross_entropy, opt, **kwargs) as trainer:
        trainer.fit(DataLoader(make_data(8, 1), batch_size=BATCH))
        return sorted({float(v) for p in trainer.raw_model.parameters() for v in p.detach().flatten()})


def _main_process_first(out: Path) -> dict:
    """Rank 0 writes a file inside the block (slowly); the other ranks must find it when they enter."""
    marker = out / "prepared.txt"
    model = make_model()
    with Trainer(model, F.cross_entropy, make_optimizer(model), **trainer_kwargs()) as trainer:
        with trainer.main_process_first():
            if trainer.is_main_process:
                time.sleep(0.5)
                marker.write_text("ready")
                return {"found": True}
            return {"found": marker.exists()}


def _user_group_survives_close(out: Path) -> dict:
    """A process group the caller initialised is used by the Trainer and left alive by close()."""
    dist.init_process_group("gloo", init_method=f"file://{out / 'user-group-store'}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    try:
        model = make_model()
        with Trainer(model, F.cross_entropy, make_optimizer(model), **trainer_kwargs(epochs=1)) as trainer:
            trainer.fit(DataLoader(make_data(8, 1), batch_size=BATCH))
            world_size = trainer.world_size
        return {"world_size": world_size, "alive_after_close": dist.is_initialized()}
    finally:
        dist.destroy_process_group()


def _unsplit_data_warnings() -> dict:
    """The warnings about training data not split, per kind of training data: a list of batches (two fits of
    one trainer), a plain DataLoader (sharded by deepepochs) and one with the caller's DistributedSampler."""
    data = make_data(TRAIN_N, 1)
    kinds = {
        "list of batches": lambda: [data[i:i + BATCH] for i in range(0, TRAIN_N, BATCH)],
        "plain DataLoader": lambda: DataLoader(data, batch_size=BATCH, shuffle=True),
        "DistributedSampler": lambda: DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data)),
    }
    out = {}
    for kind, make in kinds.items():
        model = make_model()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with Trainer(model, F.cross_entropy, make_optimizer(model), **trainer_kwargs(epochs=1)) as trainer:
                trainer.fit(make())
                trainer.fit(make(), epochs=2)
        out[kind] = [str(w.message) for w in caught if "not split" in str(w.message)]
    return out


def run_scenarios() -> int:
    """All two-process scenarios in one launch (process start-up dominates the cost)."""
    out = Path(os.environ[OUT_ENV])
    rank = int(os.environ["RANK"])
    results = {"equivalence": _train(k=1)}
    results["group_destroyed_after_close"] = not dist.is_initialized()
    results["accumulation"] = _train(k=2)
    results["split_batches"] = _train(k=1, batch_size=2 * BATCH, split_batches=True)
    results["unused_parameters"] = _unused_parameters()
    results["split_batches_error"] = _split_batches_error()
    results["uneven_training_error"] = _uneven_training_error()
    results["tiny_test_set"] = _tiny_test_set()
    results["interprete"] = _interprete_top_samples()
    results["predict"] = _predict()
    results["find_lr"] = _find_lr()
    results["batchnorm_refit"] = _batchnorm_refit()
    results["shuffled_indices"] = _shuffled_indices()
    results["broadcast_values"] = _broadcast_after_init_callbacks()
    results["main_process_first"] = _main_process_first(out)
    results["user_group"] = _user_group_survives_close(out)
    results["save_failure"] = _save_failure_on_rank_0(out)
    results["run_lock"] = _run_lock_on_rank_0(out)
    results["unsplit_warnings"] = _unsplit_data_warnings()
    torch.save(results, out / f"rank{rank}.pt")
    return rank


class _FailOnRank1(Callback):
    """Raises on rank 1 after its second training batch; rank 0 goes on into the next all-reduce."""

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if dist.get_rank() == 1 and batch_idx == 1:  # 0-based: the second batch
            if OUT_ENV in os.environ:  # when it failed, so the caller can time its own error
                (Path(os.environ[OUT_ENV]) / "failed_at").write_text(repr(time.time()))
            raise RuntimeError("rank 1 failed during training on purpose")


def raise_on_rank_1_during_training() -> None:
    """A training run in which rank 1 raises mid-epoch while rank 0 keeps training."""
    model = make_model()
    kwargs = trainer_kwargs(epochs=50, metrics=None, callbacks=[_FailOnRank1()])
    with Trainer(model, F.cross_entropy, make_optimizer(model), **kwargs) as trainer:
        trainer.fit(DataLoader(make_data(TRAIN_N, 1), batch_size=BATCH))


# ---- checks shared by test_ddp.py and test_fsdp.py (run in the test process) ----------------------------
def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max(float((a[key] - b[key]).abs().max()) for key in a)


def metrics_on(state: dict, x: torch.Tensor, y: torch.Tensor) -> dict:
    """Loss, accuracy and sample count of the weights `state` on (x, y) at once, in plain PyTorch."""
    model = make_model()
    model.load_state_dict(state)
    with torch.no_grad():
        logits = model(x)
    return {"loss": float(F.cross_entropy(logits, y)), "accuracy": float(accuracy(logits, y)),
            "sample_count": float(len(y))}


def check_val_records(ranks: list, scenario: str, expected: dict, tolerance: float) -> None:
    """Every rank's validation records of `scenario` count each of the VAL_N samples once per epoch and
    equal `expected` (one process's records) within `tolerance`."""
    import pytest  # noqa: PLC0415 (the targets also run in launched processes, which need no pytest)

    for rank in ranks:
        records = rank[scenario]["records"]["val"]
        assert records["sample_count"] == [float(VAL_N)] * EPOCHS
        for name, values in expected.items():
            assert records[name] == pytest.approx(values, abs=tolerance), name
