"""Multi-GPU evaluation check: global metrics, empty shards, schedules, early stopping and checkpoints.

    torchrun --standalone --nproc-per-node=4 tests/multigpu_evaluation.py --expected-world-size 4 \
        --precision fp16 --output /tmp/deepepochs-evaluation-4-fp16

Rank 0 recomputes every metric on the whole dataset in this process (no sharding) and compares:

- `global_metrics_<patch>`: validation metrics with metric_patch 'tensor', 'mean' and 'confusion' on a
  validation set whose shards differ in length; every rank must report the same values;
- `empty_shards`: a test set with fewer samples than processes (some ranks see no batch at all);
- `plateau_scheduler`: ReduceLROnPlateau fed the global validation loss: the same LR on every rank, equal
  to a scheduler replayed on the recorded losses;
- `early_stopping`: a monitor with patience 1 on a loss that cannot improve stops every rank after the
  same epoch;
- `checkpoints`: two monitors under `<output>/checkpoints/multiple/` (best validation loss, latest
  accuracy), written by rank 0 and loaded by `test()` on every rank (weights restored afterwards), then
  a fresh Trainer with `resume='multiple'` continues to epoch 3. The epoch-2 file is also copied to
  `<output>/checkpoints/multiple/checkpoint-2.ckpt` for `tests/single_gpu_checkpoint.py`.

`--device cpu` runs the same checks with gloo for development. Without CUDA (and a CUDA device asked for)
the script prints "skipped: CUDA not available", writes a skipped result and exits 0. Rank 0 writes
`<output>/result.json`; the exit status is 1 when any check fails.
"""

import json
import os
import shutil
import sys
from pathlib import Path

import script_common
import torch
import torch.distributed as dist
from script_common import is_rank_0
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import CheckCallback, Optimizer, Trainer
from deepepochs import metrics as M

FEATURES, CLASSES, BATCH = 12, 3, 8
TOLERANCE = {"fp32": 1e-5, "fp16": 2e-2, "bf16": 5e-2}
AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
RUN_ID = "multiple"


def accuracy(preds, targets):
    return M.accuracy(preds, targets)


def f1(preds, targets):
    return M.f1(preds, targets, average="macro", num_classes=CLASSES)


# ---- shared with tests/single_gpu_checkpoint.py -------------------------------------------------------
def make_data(n: int, seed: int) -> TensorDataset:
    return script_common.classification_data(n, seed, FEATURES, CLASSES, noise=0.5)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))


def reference_metrics(model: nn.Module, dataset: TensorDataset, device, precision: str) -> dict:
    """Loss, accuracy and macro precision/recall/F1 of `model` on the whole dataset at once."""
    x, y = (t.to(device) for t in dataset.tensors)
    dtype = AMP_DTYPES.get(precision)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        logits = logits.float()
        return {"loss": float(loss), "accuracy": float(M.accuracy(logits, y)),
                "precision": float(M.precision(logits, y, num_classes=CLASSES)),
                "recall": float(M.recall(logits, y, num_classes=CLASSES)),
                "f1": float(M.f1(logits, y, num_classes=CLASSES))}
    finally:
        model.train(was_training)


# ---- helpers -------------------------------------------------------------------------------------------
def gather(obj) -> list:
    """Every rank's `obj` (a list of one in a single process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def compare(actual: dict, reference: dict, tolerance: float, names=None) -> dict:
    names = [n for n in (names or reference) if n in actual]
    return {n: {"trainer": actual[n], "reference": reference[n], "ok": abs(actual[n] - reference[n]) <= tolerance}
            for n in names}


def new_trainer(args, model, opt=None, **kwargs) -> Trainer:
    opt = opt if opt is not None else torch.optim.Adam(model.parameters(), lr=1e-2)
    return Trainer(model, F.cross_entropy, opt, device=args.device, precision=args.precision,
                   log_batch=False, show_info=False, **kwargs)


def flat_weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in model.parameters()]).cpu()


# ---- cases (every rank runs them; rank 0 judges) ------------------------------------------------------
def case_global_metrics(args, patch: str) -> dict:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    train_ds, val_ds = make_data(32 * world_size, 1), make_data(10 * world_size + 1, 2)
    model = make_model()
    # ConfusionPatch takes the deepepochs.metrics functions by name (macro averages over one matrix).
    metrics = [accuracy, f1] if patch != "confusion" else [M.accuracy, M.precision, M.recall, M.f1]
    trainer = new_trainer(args, model, epochs=2, metrics=metrics, metric_patch=patch)
    try:
        records = trainer.fit(DataLoader(train_ds, batch_size=BATCH, shuffle=True),
                              DataLoader(val_ds, batch_size=BATCH))
        last = {name: values[-1] for name, values in records["val"].items()}
        reference = reference_metrics(trainer.raw_model, val_ds, trainer.device, args.precision)
        every_rank = gather(last)  # before close(): the trainer's process group ends with it
    finally:
        trainer.close()
    # A mean of per-batch F1 values is not the dataset's F1: MeanPatch is exact for accuracy only.
    names = ["loss", "accuracy"] if patch == "mean" else None
    result = compare(last, reference, TOLERANCE[args.precision], names)
    return {"metrics": result, "checks": {"metrics_match_reference": bool(result) and all(
        v["ok"] for v in result.values()) and "accuracy" in result,
        "ranks_agree": all(r == every_rank[0] for r in every_rank)}}


def case_empty_shards(args) -> dict:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    test_ds = make_data(max(1, world_size - 1), 3)
    model = make_model()
    trainer = new_trainer(args, model, epochs=1, metrics=[accuracy, f1])
    try:
        test = trainer.test(DataLoader(test_ds, batch_size=BATCH))
        reference = reference_metrics(trainer.raw_model, test_ds, trainer.device, args.precision)
        every_rank = gather(test)
    finally:
        trainer.close()
    result = compare(test, reference, TOLERANCE[args.precision], ["loss", "accuracy"])
    return {"metrics": result, "checks": {"metrics_match_reference": all(v["ok"] for v in result.values()),
                                          "ranks_agree": all(r == every_rank[0] for r in every_rank)}}


def case_plateau_scheduler(args) -> dict:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    # mode="max" on a falling loss: most epochs count as "no improvement", so the LR really changes.
    plateau = dict(mode="max", factor=0.5, patience=0)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, **plateau)
    wrapped = Optimizer(opt, scheduler, sched_on="epoch", sched_with_loss=True)
    trainer = new_trainer(args, model, wrapped, epochs=4)
    try:
        records = trainer.fit(DataLoader(make_data(32 * world_size, 1), batch_size=BATCH),
                              DataLoader(make_data(10 * world_size + 1, 2), batch_size=BATCH))
        lrs = gather(opt.param_groups[0]["lr"])
    finally:
        trainer.close()
    replay_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
    replay = torch.optim.lr_scheduler.ReduceLROnPlateau(replay_opt, **plateau)
    for loss in records["val"]["loss"]:
        replay.step(loss)
    return {"lrs": lrs, "reference_lr": replay_opt.param_groups[0]["lr"],
            "checks": {"lr_matches_replay": lrs[0] == replay_opt.param_groups[0]["lr"],
                       "ranks_agree": len(set(lrs)) == 1}}


def case_early_stopping(args, output: Path) -> dict:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # nothing changes: no epoch after the first improves
    checker = CheckCallback("loss", on_stage="val", mode="min", patience=1, ckpt_dir=output / "early-stop")
    trainer = new_trainer(args, model, opt, epochs=10, callbacks=[checker])
    try:
        records = trainer.fit(DataLoader(make_data(16 * world_size, 1), batch_size=BATCH),
                              DataLoader(make_data(10 * world_size + 1, 2), batch_size=BATCH))
        epochs_run = gather(len(records["train"]["loss"]))
    finally:
        trainer.close()
    return {"epochs_run": epochs_run, "checks": {"stopped_after_epoch_2": epochs_run[0] == 2,
                                                  "ranks_agree": len(set(epochs_run)) == 1}}


def monitors(output: Path) -> list:
    folder = output / "checkpoints"
    return [CheckCallback("loss", on_stage="val", mode="min", ckpt_dir=folder),
            CheckCallback("accuracy", on_stage="val", mode="max", save_best=False, ckpt_dir=folder)]


def case_checkpoints(args, output: Path) -> dict:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    train_dl = DataLoader(make_data(32 * world_size, 1), batch_size=BATCH, shuffle=True)
    val_dl = DataLoader(make_data(10 * world_size + 1, 2), batch_size=BATCH)
    test_ds = make_data(7 * world_size + 3, 3)
    checks = {}
    model = make_model()
    best, latest = monitors(output)
    trainer = new_trainer(args, model, epochs=2, metrics=[accuracy], callbacks=[best, latest],
                          running_id=RUN_ID)
    try:
        trainer.fit(train_dl, val_dl)
        trained = flat_weights(trainer.raw_model)
        test = trainer.test(DataLoader(test_ds, batch_size=BATCH))
        checks["weights_restored_after_test"] = torch.equal(trained, flat_weights(trainer.raw_model))
        saved = torch.load(best.path(trainer), map_location="cpu", weights_only=True)
        reference_model = make_model().to(trainer.device)
        reference_model.load_state_dict(saved["model"])
        reference = reference_metrics(reference_model, test_ds, trainer.device, args.precision)
        test_check = compare(test, reference, TOLERANCE[args.precision], ["loss", "accuracy"])
        checks["test_uses_first_monitor"] = all(v["ok"] for v in test_check.values())
        latest_file = latest.path(trainer)
        stored = torch.load(latest_file, map_location="cpu", weights_only=True)
        checks["file_records_world_size_and_epoch"] = (stored["world_size"], stored["epoch"]) == (world_size, 2)
        if is_rank_0():
            shutil.copy2(latest_file, latest_file.parent / "checkpoint-2.ckpt")
        every_rank_test = gather(test)
    finally:
        trainer.close()
    checks["test_ranks_agree"] = all(r == every_rank_test[0] for r in every_rank_test)

    # A restarted job: fresh objects, resume by running id, continue to 3 epochs.
    model = make_model()
    best, latest = monitors(output)
    trainer = new_trainer(args, model, epochs=3, metrics=[accuracy], callbacks=[best, latest],
                          running_id=RUN_ID, resume=RUN_ID)
    try:
        records = trainer.fit(train_dl, val_dl)
        resumed = {"epochs_this_fit": len(records["train"]["loss"]), "completed": trainer.loop.completed_epochs,
                   "weights": flat_weights(trainer.raw_model), "monitor": best.state_dict()}
        every_rank = gather(resumed)
    finally:
        trainer.close()
    checks["resume_continues_at_epoch_3"] = (resumed["epochs_this_fit"], resumed["completed"]) == (1, 3)
    checks["resumed_ranks_agree"] = all(torch.equal(r["weights"], every_rank[0]["weights"])
                                        and r["monitor"] == every_rank[0]["monitor"] for r in every_rank)
    return {"test": test_check, "checks": checks}


def parse_args():
    return script_common.parse_args("multigpu_evaluation", __doc__, {
        "--output": {"required": True, "help": "folder for result.json and checkpoints"},
        "--expected-world-size": {"type": int, "default": None},
        "--device": {"default": "cuda", "help": "cuda (one GPU per process) or cpu (gloo)"},
    })


def main() -> int:
    args = parse_args()
    output = Path(args.output)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("skipped: CUDA not available")
        if is_rank_0():
            output.mkdir(parents=True, exist_ok=True)
            (output / "result.json").write_text(json.dumps({"status": "skipped", "reason": "CUDA not available"}))
        return 0
    if is_rank_0() and (output / "checkpoints").exists():
        shutil.rmtree(output / "checkpoints")  # a stale run would be resumed instead of trained
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cases = {f"global_metrics_{patch}": case_global_metrics(args, patch) for patch in ("tensor", "mean", "confusion")}
    cases["empty_shards"] = case_empty_shards(args)
    cases["plateau_scheduler"] = case_plateau_scheduler(args)
    cases["early_stopping"] = case_early_stopping(args, output)
    cases["checkpoints"] = case_checkpoints(args, output)
    if not is_rank_0():
        return 0
    checks = [ok for case in cases.values() for ok in case["checks"].values()]
    world_ok = args.expected_world_size in (None, world_size)
    passed = all(checks) and world_ok
    result = {"status": "passed" if passed else "failed", "world_size": world_size, "precision": args.precision,
              "checks_passed": sum(checks) + world_ok, "checks_total": len(checks) + 1, "cases": cases}
    output.mkdir(parents=True, exist_ok=True)
    (output / "result.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"multigpu_evaluation: {result['status']} ({result['checks_passed']}/{result['checks_total']} checks,"
          f" world size {world_size}, {args.precision})")
    for name, case in cases.items():
        failed = [check for check, ok in case["checks"].items() if not ok]
        print(f"  {name}: {'ok' if not failed else 'FAILED ' + ', '.join(failed)}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
