"""Training functions that ``tests/distributed/test_fsdp.py`` runs in two processes through ``launch`` with
``Trainer(strategy='fsdp')``.

The data, model and optimizer come from ``ddp_targets`` (the parent computes its references from the same
builders). Each rank writes what it observed to ``$DEEPEPOCHS_TEST_OUT/rank<r>.pt``; weights are read with
torch's own ``get_model_state_dict(full_state_dict=True)`` on every rank, not with deepepochs' code.
"""

import math
import os
import shutil
import warnings
from pathlib import Path

import ddp_targets as T
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.nn import functional as F
from torch.utils.data import DataLoader

from deepepochs import (
    AnalyzeCallback,
    CheckCallback,
    GradClipCallback,
    LogCallback,
    SnapshotCallback,
    Trainer,
    consolidate,
    torch_private,
)
from deepepochs.errors import DeepEpochsWarning

__all__ = ["ANALYZE_RUN_ID", "BAD_SAMPLE", "CLIP", "FAULT_EPOCH", "FSDP_KWARGS", "RUN_ID", "SNAPSHOT_RUN_ID",
           "TWO_OPTIMIZERS_RUN_ID", "data_with", "resume_on_three", "run_scenarios", "two_optimizers", "uneven_batches",
           "val_loader"]

FSDP_KWARGS = {"min_params": 20}  # both Linear layers of make_model() get their own fully_shard, then the root
CLIP = 0.05  # GradClipCallback's max norm: far below the gradients' norms here, so every update is clipped
FAULT_EPOCH = 2
BAD_SAMPLE = 5  # a sample of rank 1's first batch (DataOrder without shuffling: rank r takes r, r + 2, ...)
RUN_ID = "fsdp-save"
SNAPSHOT_RUN_ID = "fsdp-snapshot"
TWO_OPTIMIZERS_RUN_ID = "fsdp-two-optimizers"
ANALYZE_RUN_ID = "fsdp-analyze"


def val_loader() -> DataLoader:
    """37 samples in batches of 6: rank 0's shard has 4 batches (19 samples), rank 1's 3 (18 samples)."""
    return DataLoader(T.make_data(T.VAL_N, 2), batch_size=6)


def _train_loader() -> DataLoader:
    return DataLoader(T.make_data(T.TRAIN_N, 1), batch_size=T.BATCH)


def _full_state(model) -> dict:
    """Every parameter and buffer gathered whole on every rank (torch's API, not deepepochs')."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().cpu().clone() for k, v in state.items()}


class _CountingReduceScatter:
    """Counts FSDP's gradient reduce-scatters (`torch.distributed.reduce_scatter_single`, what FSDP2 calls)."""

    def __init__(self):
        self.calls = 0
        self.original = dist.reduce_scatter_single

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.original(*args, **kwargs)


def _trainer(k: int = 1, **overrides) -> Trainer:
    model = T.make_model()
    kwargs = T.trainer_kwargs(gradient_accumulation_steps=k, strategy="fsdp", fsdp_kwargs=FSDP_KWARGS)
    kwargs.update(overrides)
    return Trainer(model, F.cross_entropy, T.make_optimizer(model), **kwargs)


def _train(k: int = 1, clip: bool = False) -> dict:
    """Fit with validation, test and predict; weights, records and how many reduce-scatters ran."""
    counter = _CountingReduceScatter()
    dist_module = dist
    with _trainer(k, callbacks=[GradClipCallback(CLIP, norm_type=2)] if clip else []) as trainer:
        dist_module.reduce_scatter_single = counter
        try:
            records = trainer.fit(_train_loader(), val_loader())
        finally:
            dist_module.reduce_scatter_single = counter.original
        groups = sum(1 for m in trainer.raw_model.modules()
                     if isinstance(m, FSDPModule) and any(True for _ in m.parameters(recurse=False)))
        sharded = [m for m in trainer.raw_model.modules() if isinstance(m, FSDPModule)]
        return {"state": _full_state(trainer.raw_model), "records": records, "test": trainer.test(val_loader()),
                "predict": trainer.predict(val_loader()), "reduce_scatters": counter.calls,
                "param_groups": groups, "fsdp_modules": len(sharded), "policy": type(trainer._dist).__name__}


def _train_without_private_drop() -> dict:
    """k=3 with torch_private's FSDP probe answering False: the fallback syncs every micro-batch."""
    probe = torch_private.fsdp_unsynced_grads_private
    torch_private.fsdp_unsynced_grads_private = lambda model: False
    try:
        return _train(3)
    finally:
        torch_private.fsdp_unsynced_grads_private = probe


def _fault_mid_window() -> dict:
    """k=3: both ranks raise inside the 2nd micro-batch of a window (after its backward) in epoch 2; the
    fit is called again and completes. The weights must equal an uninterrupted run's."""
    raised = []
    with _trainer(3, fuse_steps=False) as trainer:

        def probe(dest):
            loop = trainer.loop
            if (dest == "step_backward" and not raised and loop.epoch == FAULT_EPOCH and loop.window_pos == 2
                    and loop.batch_idx == 2):
                raised.append((loop.epoch, loop.batch_idx))
                raise RuntimeError("injected fault mid-window")

        trainer.machine.probe = probe
        error = None
        try:
            trainer.fit(_train_loader(), val_loader())
        except RuntimeError as exc:
            error = str(exc).splitlines()[0]
        trainer.machine.probe = None
        records = trainer.fit(_train_loader(), val_loader())
        return {"error": error, "raised": raised, "state": _full_state(trainer.raw_model), "records": records}


def _save_then_resume(out: Path) -> dict:
    """Save epoch-end checkpoints with 2 processes (2 of 3 epochs), test with the best one, then resume the
    copy of the run's folder with 2 processes to epoch 3, and its consolidated single file likewise. The parent
    resumes the same folder in 1 process."""
    best_dir, last_dir = out / "best", out / "last"
    best = CheckCallback("loss", on_stage="val", mode="min", ckpt_dir=best_dir)
    last = CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=last_dir)
    with _trainer(epochs=2, callbacks=[best, last], running_id=RUN_ID) as trainer:
        trainer.fit(_train_loader(), val_loader())
        saved = _full_state(trainer.raw_model)
        test = trainer.test(val_loader())  # with the best file's weights, then the final ones back
        after_test = _full_state(trainer.raw_model)
        if trainer.is_main_process:  # for the two resumes: the files as they are after epoch 2
            shutil.copytree(last_dir, out / "resume-2")
            shutil.copytree(last_dir, out / "resume-1")
            shutil.copytree(last_dir, out / "ddp")
            # what a save killed before its commit leaves: a shard folder the checkpoint.pt does not name
            stray = out / "resume-2" / RUN_ID / "train-loss.latest.ckpt" / "shards-000000000000"
            stray.mkdir()
            (stray / "__0_0.distcp").write_bytes(b"partial")
            # and as one file (what a one-process or DDP run writes), for a 2-process FSDP resume from a file
            consolidate(last.path(trainer), out / "from-file" / RUN_ID / last.file_name)
    # Rank 1 builds the next Trainer only once rank 0 does: the group's rendezvous waits for the copies.
    resumed = CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=out / "resume-2")
    with _trainer(epochs=3, callbacks=[resumed], resume=RUN_ID) as trainer:
        records = trainer.fit(_train_loader(), val_loader())
        resumed_state = _full_state(trainer.raw_model)
        resumed_folder = sorted(p.name for p in resumed.path(trainer).iterdir())
    # a DDP trainer (whole replicas) resumes the sharded folder: every rank reads the full tensors
    ddp_monitor = CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=out / "ddp")
    with _trainer(epochs=3, strategy="ddp", fsdp_kwargs=None, resume=RUN_ID, callbacks=[ddp_monitor]) as trainer:
        trainer.fit(_train_loader(), val_loader())
        ddp_state = {k: v.detach().cpu().clone() for k, v in trainer.raw_model.state_dict().items()}
        ddp_saved_as_file = ddp_monitor.path(trainer).is_file()  # its epoch-3 save replaced the folder
    from_file = CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=out / "from-file")
    with _trainer(epochs=3, callbacks=[from_file], resume=RUN_ID) as trainer:
        from_file_records = trainer.fit(_train_loader(), val_loader())
        return {"saved": saved, "test": test, "after_test": after_test, "best_file": str(best.path(trainer)),
                "last_file": str(last.path(trainer)), "resumed": resumed_state, "resumed_records": records,
                "resumed_folder": resumed_folder, "ddp_resumed": ddp_state,
                "ddp_saved_as_file": ddp_saved_as_file, "from_file": _full_state(trainer.raw_model),
                "from_file_records": from_file_records, "from_file_saved_as_folder": from_file.path(trainer).is_dir()}


def two_optimizers(model) -> list:
    """SGD with momentum on the first layer, Adam on the last: two optimizers of different state layouts."""
    return [torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9),
            torch.optim.Adam(model[2].parameters(), lr=0.01)]


def _two_optimizers(out: Path) -> dict:
    """Two optimizers under FSDP for 2 epochs; a sharded checkpoint of both at each epoch's end."""
    model = T.make_model()
    monitor = CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=out / "two-optimizers")
    kwargs = T.trainer_kwargs(strategy="fsdp", fsdp_kwargs=FSDP_KWARGS, epochs=2, callbacks=[monitor],
                              running_id=TWO_OPTIMIZERS_RUN_ID)
    with Trainer(model, F.cross_entropy, two_optimizers(model), **kwargs) as trainer:
        trainer.fit(_train_loader())
        return {"state": _full_state(trainer.raw_model), "file": str(monitor.path(trainer))}


def resume_on_three() -> int:
    """Three processes load the 2-process run's epoch-2 checkpoint (a copy at `<out>/resume-3`): each rank
    reads its third of every parameter from shards cut in halves; then they train epoch 3. Rank 0 saves the
    gathered weights after loading and after training to `<out>/three.pt`."""
    out = Path(os.environ[T.OUT_ENV])
    with _trainer(epochs=3) as trainer:
        trainer.load_checkpoint(out / "resume-3" / RUN_ID / "train-loss.latest.ckpt")
        loaded = _full_state(trainer.raw_model)
        records = trainer.fit(_train_loader(), val_loader())
        state = _full_state(trainer.raw_model)
        if trainer.is_main_process:
            torch.save({"loaded": loaded, "state": state, "records": records}, out / "three.pt")
        return trainer._dist.rank


def _snapshot_then_resume(out: Path) -> dict:
    """Mid-epoch snapshots at every 4th update of the run (every rank writes its shards); both ranks fail at
    epoch 2 batch 4, one update after the snapshot of epoch 2 batch 3 (update 8); a new 2-process Trainer
    resumes from it to the end. The parent resumes a copy of the same snapshot in 1 process."""
    snapshots = out / "snapshots"
    kwargs = {"running_id": SNAPSHOT_RUN_ID, "fuse_steps": False}
    with _trainer(callbacks=[SnapshotCallback(snapshots, every_n_updates=4, on_signals=())], **kwargs) as trainer:

        def probe(dest):
            if dest == "step_forward" and trainer.loop.epoch == 2 and trainer.loop.batch_idx == 4:
                raise RuntimeError("injected fault after a mid-epoch snapshot")

        trainer.machine.probe = probe
        try:
            trainer.fit(_train_loader(), val_loader())
        except RuntimeError as exc:
            error = str(exc).splitlines()[0]
        if trainer.is_main_process:
            shutil.copytree(snapshots, out / "snapshots-1")
        # rank 0 wrote the files: another rank may get here before rank 0 finished writing the last one
        kept = (sorted(p.name + "/" * p.is_dir() for p in (snapshots / SNAPSHOT_RUN_ID).glob("*.ckpt"))
                if trainer.is_main_process else None)
        if trainer.is_main_process:  # what a sharded snapshot killed before its commit leaves
            (snapshots / SNAPSHOT_RUN_ID / "snapshot-u000000009.ckpt" / "shards-000000000000").mkdir(parents=True)
    with _trainer(callbacks=[SnapshotCallback(snapshots, every_n_updates=4, on_signals=())], resume=True,
                  **kwargs) as trainer:
        records = trainer.fit(_train_loader(), val_loader())
        folder = snapshots / SNAPSHOT_RUN_ID
        after = sorted(p.name for p in folder.glob("*.ckpt")) if trainer.is_main_process else None
        return {"error": error, "kept": kept, "resumed": _full_state(trainer.raw_model), "records": records,
                "after_resume": after}


def data_with(value: float, index: int = BAD_SAMPLE):
    """The training data with every feature of sample `index` set to `value` (NaN, or too large for fp16)."""
    data = T.make_data(T.TRAIN_N, 1)
    data.tensors[0][index] = value
    return data


def _skipped_updates() -> dict:
    """fp32 with nonfinite='skip': sample 5 (rank 1's first batch) is NaN, so the first global window of each
    epoch has a NaN loss on rank 1 only; both ranks must skip that update. fp16: sample 5 overflows fp16
    on rank 1; the GradScaler's inf check over the sharded gradients must agree on both ranks too."""
    out = {}
    with _trainer(nonfinite="skip") as trainer:
        trainer.fit(DataLoader(data_with(math.nan), batch_size=T.BATCH))
        out["fp32"] = _full_state(trainer.raw_model)
    with _trainer(precision="fp16") as trainer:
        records = trainer.fit(DataLoader(data_with(1e6), batch_size=T.BATCH))
        out["fp16"] = {"state": _full_state(trainer.raw_model), "scale": trainer.scaler.get_scale(),
                       "records": records}
    return out


def _analysis_and_graph(out: Path) -> dict:
    """AnalyzeCallback(mode='backward') gathers the sharded parameter gradients (every rank joins, rank 0
    writes); LogCallback(log_graph=True) skips the graph with a warning on rank 0 instead of hanging."""
    callbacks = [AnalyzeCallback(mode="backward", log_dir=out / "analyze", histograms=False),
                 LogCallback(log_dir=out / "logs", log_graph=True)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with _trainer(epochs=1, running_id=ANALYZE_RUN_ID, callbacks=callbacks) as trainer:
            trainer.fit(_train_loader())
    return {"warnings": [str(w.message) for w in caught if issubclass(w.category, DeepEpochsWarning)]}


def _mixed_precision() -> dict:
    """precision='bf16': the layers compute with bf16 parameters (gathered in bf16 by the
    MixedPrecisionPolicy), the fit runs and stays finite, the sharded fp32 weights change."""
    seen = set()
    with _trainer(precision="bf16", epochs=1) as trainer:
        first = trainer.raw_model[0]
        # a pre-hook registered after fully_shard's own runs once the layer's parameters are gathered
        handle = first.register_forward_pre_hook(lambda module, args: seen.add(str(module.weight.dtype)))
        before = _full_state(trainer.raw_model)
        records = trainer.fit(_train_loader(), val_loader())
        handle.remove()
        return {"records": records, "forward_dtypes": sorted(seen), "before": before,
                "state": _full_state(trainer.raw_model)}


class _Batches:
    """Re-iterable batches without a length (so `pad_eval` agrees batch by batch where the data ends)."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def uneven_batches(rank: int) -> list:
    """Rank 0: 3 batches (samples 0..8), rank 1: 2 batches (samples 9..14) of the validation data."""
    x, y = T.make_data(T.VAL_N, 2).tensors
    start, count = (0, 3) if rank == 0 else (9, 2)
    return [(x[i:i + 3], y[i:i + 3]) for i in range(start, start + 3 * count, 3)]


def _uneven_evaluation() -> dict:
    """test() on data whose shards differ in batch count without a length (3 and 2 batches), and on a
    one-sample DataLoader (rank 1's shard is empty): every forward meets the other rank's, nothing hangs,
    padding counts nowhere."""
    with _trainer() as trainer:
        rank = int(os.environ["RANK"])
        without_length = trainer.test(_Batches(uneven_batches(rank)))
        one_sample = trainer.test(DataLoader(torch.utils.data.Subset(T.make_data(T.VAL_N, 2), [5]), batch_size=4))
        predicted = trainer.predict(DataLoader(torch.utils.data.Subset(T.make_data(T.VAL_N, 2), [5]), batch_size=4))
        return {"state": _full_state(trainer.raw_model), "without_length": without_length, "one_sample": one_sample,
                "predict_one": predicted}


def _find_lr() -> dict:
    """find_lr under FSDP: a sweep, then the weights back as they were."""
    with _trainer() as trainer:
        before = _full_state(trainer.raw_model)
        result = trainer.find_lr(_train_loader(), min_lr=1e-3, max_lr=1.0, num_steps=5, plot=False)
        return {"losses": result.losses, "before": before, "after": _full_state(trainer.raw_model)}


def run_scenarios() -> int:
    """Every scenario in one launch (process start-up is most of the cost); results to rank<r>.pt."""
    out = Path(os.environ[T.OUT_ENV])
    results = {"k1": _train(1), "k3": _train(3), "clip": _train(1, clip=True),
               "k3_fallback": _train_without_private_drop(), "fault": _fault_mid_window(),
               "checkpoint": _save_then_resume(out / "checkpoints"), "snapshot": _snapshot_then_resume(out),
               "skipped": _skipped_updates(), "callbacks": _analysis_and_graph(out), "bf16": _mixed_precision(),
               "find_lr": _find_lr(), "uneven_eval": _uneven_evaluation(), "two_optimizers": _two_optimizers(out)}
    rank = int(os.environ["RANK"])
    torch.save(results, out / f"rank{rank}.pt")
    return rank
