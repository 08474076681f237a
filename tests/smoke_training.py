"""Smoke check of a small training run: 3 epochs, global validation, checkpoint temporarily loaded by test.

Works in one process, under torchrun (CPU processes with gloo, or one process per GPU with NCCL) and on
CUDA with mixed precision:

    python tests/smoke_training.py --output /tmp/deepepochs-smoke-python
    torchrun --master-addr=127.0.0.1 --master-port=29500 --nproc-per-node=2 tests/smoke_training.py \
        --output /tmp/deepepochs-smoke-ddp
    python tests/smoke_training.py --device cuda --precision fp16 --output /tmp/deepepochs-smoke-cuda

Checks, each against a reference computed here rather than by the trainer:

- the validation metrics of the last epoch equal the metrics of the final weights on the *whole*
  validation set (rank 0 recomputes them in this process, with no sharding);
- every rank holds the same weights after training;
- `test()` evaluates the monitor's saved checkpoint (its metrics equal a recomputation from the file's
  weights) and gives the trained weights back afterwards;
- `close()` releases the process group the trainer created.

Writes `<output>/result.json` (rank 0) and exits 1 when a check fails. A CUDA device without CUDA prints
"skipped: CUDA not available", writes a skipped result and exits 0.
"""

import json
import sys
from pathlib import Path

import script_common
import torch
import torch.distributed as dist
from script_common import is_rank_0
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import CheckCallback, Trainer, set_seed
from deepepochs.metrics import accuracy

FEATURES, CLASSES = 12, 3
TOLERANCE = {"fp32": 1e-5, "fp16": 2e-2, "bf16": 5e-2}  # metric differences from autocast reductions


def parse_args():
    return script_common.parse_args("smoke_training", __doc__, {
        "--output": {"required": True, "help": "folder for result.json and checkpoints"},
        "--device": {"default": None, "help": "cpu, cuda, cuda:N (default: CUDA if available)"},
        "--epochs": {"type": int, "default": 3},
    })


def write_result(output: Path, result: dict) -> None:
    if is_rank_0():
        output.mkdir(parents=True, exist_ok=True)
        (output / "result.json").write_text(json.dumps(result, indent=2))


def make_data(n: int, seed: int) -> TensorDataset:
    return script_common.classification_data(n, seed, FEATURES, CLASSES, noise=0.3)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))


def reference_metrics(model: nn.Module, dataset: TensorDataset, device, precision: str) -> dict:
    """Loss and accuracy of `model` on the whole dataset at once, computed without the trainer."""
    x, y = (t.to(device) for t in dataset.tensors)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        return {"loss": float(loss), "accuracy": float(accuracy(logits.float(), y))}
    finally:
        model.train(was_training)


def close_enough(actual: dict, expected: dict, tolerance: float) -> dict:
    """Per metric: both values, the difference and whether it is within `tolerance`."""
    out = {}
    for name, value in expected.items():
        diff = abs(actual[name] - value)
        out[name] = {"trainer": actual[name], "reference": value, "diff": diff, "ok": diff <= tolerance}
    return out


def parameters_agree_across_ranks(model: nn.Module) -> float:
    """Largest difference between this rank's parameters and rank 0's (0.0 in one process)."""
    flat = torch.cat([p.detach().float().flatten() for p in model.parameters()])
    if not (dist.is_available() and dist.is_initialized()):
        return 0.0
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    diff = (flat - reference).abs().max().reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff)


def main() -> int:
    args = parse_args()
    output = Path(args.output)
    if args.device is not None and args.device.startswith("cuda") and not torch.cuda.is_available():
        print("skipped: CUDA not available")
        write_result(output, {"status": "skipped", "reason": "CUDA not available", "device": args.device})
        return 0

    set_seed(0)
    train_ds, val_ds, test_ds = make_data(240, 1), make_data(101, 2), make_data(57, 3)
    train_dl = DataLoader(train_ds, batch_size=16, shuffle=True)
    val_dl = DataLoader(val_ds, batch_size=16)
    test_dl = DataLoader(test_ds, batch_size=16)
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    # mode="max" keeps the epoch with the *highest* validation loss (normally the first): test() then
    # evaluates weights that differ from the trained ones, so loading and restoring them is observable.
    checker = CheckCallback("loss", on_stage="val", mode="max", ckpt_dir=output / "checkpoints")
    trainer = Trainer(model, F.cross_entropy, opt, epochs=args.epochs, device=args.device,
                      metrics=[accuracy], callbacks=[checker], precision=args.precision,
                      running_id="smoke", log_batch=False)
    tolerance = TOLERANCE[args.precision]
    try:
        records = trainer.fit(train_dl, val_dl)
        device = trainer.device
        last_val = {name: values[-1] for name, values in records["val"].items()}
        val_check = close_enough(last_val, reference_metrics(trainer.raw_model, val_ds, device,
                                                             args.precision), tolerance)
        weight_spread = parameters_agree_across_ranks(trainer.raw_model)

        trained = [p.detach().clone() for p in trainer.raw_model.parameters()]
        test = trainer.test(test_dl)
        restored = all(torch.equal(a, p.detach()) for a, p in zip(trained, trainer.raw_model.parameters()))
        best = make_model().to(device)
        saved = torch.load(checker.path(trainer), map_location=device, weights_only=True)
        best.load_state_dict(saved["model"])
        test_check = close_enough(test, reference_metrics(best, test_ds, device, args.precision), tolerance)
        world_size = trainer.world_size
    finally:
        trainer.close()
    group_released = not (dist.is_available() and dist.is_initialized())

    checks = {
        "global_validation_matches_reference": all(c["ok"] for c in val_check.values()),
        "ranks_hold_equal_weights": weight_spread <= 1e-6,
        "test_uses_saved_checkpoint": all(c["ok"] for c in test_check.values()),
        "weights_restored_after_test": restored,
        "process_group_released": group_released,
        "epochs_completed": len(records["train"]["loss"]) == args.epochs,
    }
    result = {
        "status": "passed" if all(checks.values()) else "failed",
        "checks": checks,
        "world_size": world_size,
        "device": str(device),
        "precision": args.precision,
        "records": records,
        "validation": val_check,
        "test": test_check,
        "checkpoint_epoch": saved.get("epoch"),
        "weight_spread": weight_spread,
    }
    write_result(output, result)
    if is_rank_0():
        print(f"smoke_training: {result['status']} (world size {world_size}, {device}, {args.precision})")
        for name, ok in checks.items():
            print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
