"""Smoke check of the Python entry point: `launch(main)` starts the processes and returns rank 0's result.

    python tests/smoke_launch.py --num-processes=2 --expected-world-size=2 --device=cpu \
        --output /tmp/deepepochs-launch-cpu
    python tests/smoke_launch.py --expected-world-size=4 --device=cuda --precision=fp16 \
        --output /tmp/deepepochs-launch-cuda

Without `--num-processes` launch starts one process per visible GPU (one CPU process without GPUs).
Checks:

- the world size is the expected one, every rank runs in its own process on its own device
  (`cuda:<local rank>` on CUDA);
- the global validation metrics equal rank 0's recomputation on the whole validation set, and every
  rank ends with the same weights (and the same GradScaler scale under fp16);
- each rank's Trainer released the process group it created when it closed;
- launch returned rank 0's result, and the caller's OMP_NUM_THREADS and SIGINT/SIGTERM handlers are
  as they were before the call.

Writes `<output>/result.json` and exits 1 when a check fails. A CUDA device without CUDA prints
"skipped: CUDA not available", writes a skipped result and exits 0.
"""

import json
import os
import signal
import sys
from pathlib import Path

import script_common
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Trainer, launch, set_seed
from deepepochs.metrics import accuracy

FEATURES, CLASSES = 10, 2
TOLERANCE = {"fp32": 1e-5, "fp16": 2e-2, "bf16": 5e-2}
# main() runs in fresh processes that do not see this script's command line: the parent hands the
# options over in the environment, which spawned children inherit.
_ENV_DEVICE, _ENV_PRECISION = "DEEPEPOCHS_SMOKE_DEVICE", "DEEPEPOCHS_SMOKE_PRECISION"


def make_data(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=generator)
    return TensorDataset(x, (x[:, 0] - x[:, 1] > 0).long())


def reference_metrics(model: nn.Module, dataset: TensorDataset, device, precision: str) -> dict:
    """Loss and accuracy on the whole dataset at once, without the trainer."""
    x, y = (t.to(device) for t in dataset.tensors)
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    model.eval()
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(x)
            return {"loss": float(F.cross_entropy(logits, y)), "accuracy": float(accuracy(logits.float(), y))}
    finally:
        model.train()


def main() -> dict:
    """One rank's training; returns what the parent checks (rank 0's dict reaches the caller)."""
    device = os.environ.get(_ENV_DEVICE) or None
    precision = os.environ.get(_ENV_PRECISION, "fp32")
    set_seed(0)
    val_ds = make_data(75, 2)  # 75 samples: the validation shards differ in length
    train_dl = DataLoader(make_data(256, 1), batch_size=16, shuffle=True)
    val_dl = DataLoader(val_ds, batch_size=16)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, CLASSES))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = Trainer(model, F.cross_entropy, opt, epochs=2, device=device, metrics=[accuracy],
                      precision=precision, log_batch=False)
    try:
        records = trainer.fit(train_dl, val_dl)
        last_val = {name: values[-1] for name, values in records["val"].items()}
        reference = reference_metrics(trainer.raw_model, val_ds, trainer.device, precision)
        flat = torch.cat([p.detach().float().flatten() for p in trainer.raw_model.parameters()]).cpu()
        scale = float(trainer.scaler.get_scale()) if trainer.scaler is not None else None
        report = {"rank": int(os.environ.get("RANK", "0")), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                  "pid": os.getpid(), "device": str(trainer.device), "weights": flat, "scale": scale}
        reports = [report]
        if trainer.world_size > 1:
            reports = [None] * trainer.world_size
            dist.all_gather_object(reports, report)
        world_size = trainer.world_size
    finally:
        trainer.close()
    spread = max(float((r["weights"] - reports[0]["weights"]).abs().max()) for r in reports)
    return {
        "world_size": world_size,
        "ranks": [{key: value for key, value in r.items() if key != "weights"} for r in reports],
        "weight_spread": spread,
        "validation": {name: {"trainer": last_val[name], "reference": value}
                       for name, value in reference.items()},
        "group_released": not (dist.is_available() and dist.is_initialized()),
        "returned_by_rank": int(os.environ.get("RANK", "0")),
    }


def parse_args():
    return script_common.parse_args("smoke_launch", __doc__, {
        "--output": {"required": True, "help": "folder for result.json"},
        "--num-processes": {"type": int, "default": None,
                            "help": "processes to start (default: one per visible GPU, or 1 without GPUs)"},
        "--expected-world-size": {"type": int, "default": None},
        "--device": {"default": None, "help": "cpu, cuda (default: CUDA if available)"},
    })


def run() -> int:
    args = parse_args()
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    if args.device is not None and args.device.startswith("cuda") and not torch.cuda.is_available():
        print("skipped: CUDA not available")
        (output / "result.json").write_text(json.dumps({"status": "skipped", "reason": "CUDA not available"}))
        return 0
    os.environ[_ENV_DEVICE] = args.device or ""
    os.environ[_ENV_PRECISION] = args.precision
    omp_before = os.environ.get("OMP_NUM_THREADS")
    handlers_before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    result = launch(main, num_processes=args.num_processes)

    tolerance = TOLERANCE[args.precision]
    world_size = result["world_size"]
    ranks = result["ranks"]
    cuda = ranks[0]["device"].startswith("cuda")
    checks = {
        "expected_world_size": args.expected_world_size in (None, world_size),
        "one_process_per_rank": len({r["pid"] for r in ranks}) == world_size,
        "device_per_local_rank": all(r["device"] == (f"cuda:{r['local_rank']}" if cuda else "cpu")
                                     for r in ranks),
        "global_validation_matches_reference": all(
            abs(v["trainer"] - v["reference"]) <= tolerance for v in result["validation"].values()),
        "ranks_hold_equal_weights": result["weight_spread"] <= 1e-6,
        "ranks_share_the_grad_scale": len({r["scale"] for r in ranks}) == 1,
        "process_group_released": result["group_released"],
        "result_of_rank_0": result["returned_by_rank"] == 0,
        "omp_num_threads_restored": os.environ.get("OMP_NUM_THREADS") == omp_before,
        "signal_handlers_restored": all(signal.getsignal(s) is h for s, h in handlers_before.items()),
    }
    summary = {"status": "passed" if all(checks.values()) else "failed", "checks": checks,
               "device": args.device, "precision": args.precision, "num_processes": args.num_processes,
               **result}
    # Under torchrun every rank gets here with its own result; rank 0 writes.
    if os.environ.get("RANK", "0") == "0":
        (output / "result.json").write_text(json.dumps(summary, indent=2))
        print(f"smoke_launch: {summary['status']} (world size {world_size}, {ranks[0]['device']},"
              f" {args.precision})")
        for name, ok in checks.items():
            print(f"  {'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(run())
