"""Multi-GPU training check: DDP results against a global reference that rank 0 recomputes in-process.

    torchrun --standalone --nproc-per-node=4 tests/multigpu_training.py --expected-world-size 4 \
        --precision fp16 --output /tmp/deepepochs-training-4-fp16.json

Each case trains a fresh Trainer on the same data in the same order (shuffle=False, per-rank batch b) and
rank 0 then replays the run with plain PyTorch on one device with the global batch w*b: one forward per
accumulation window over all its samples, autocast and a GradScaler as the precision asks. Compared:
final weights, per-epoch training loss, the learning rate; and across ranks: weights, GradScaler scale
and learning rate must be identical. Cases:

- `plain`: one update per batch, a ragged last batch;
- `accumulation`: gradient_accumulation_steps=2 with a short tail window;
- `step_scheduler`: accumulation with a step-wise StepLR (it advances once per update);
- `retry_unsynced_microbatch`: every rank raises after the backward of an inner (no_sync) micro-batch;
  the window is discarded and the next fit() re-runs it, so the weights equal an uninterrupted run;
- `retry_before_update`: the same with the exception raised just before an update.

`--device cpu` runs the same checks with gloo for development. Without CUDA (and a CUDA device asked for)
the script prints "skipped: CUDA not available", writes a skipped result and exits 0. Rank 0 writes the
JSON file given by `--output`; the exit status is 1 when any check fails.
"""

import json
import os
import sys
from pathlib import Path

import script_common
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, Optimizer, Trainer

FEATURES, CLASSES, BATCH, EPOCHS = 16, 4, 8, 3
# fp16/bf16 round differently in one big batch than in w shards, so those references are approximate.
TOLERANCE = {"fp32": 1e-5, "fp16": 1e-2, "bf16": 5e-2}
AMP_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def parse_args():
    return script_common.parse_args("multigpu_training", __doc__, {
        "--output": {"required": True, "help": "JSON file to write (rank 0)"},
        "--expected-world-size": {"type": int, "default": None},
        "--device": {"default": "cuda", "help": "cuda (one GPU per process) or cpu (gloo)"},
    })


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def make_data(world_size: int) -> TensorDataset:
    """4 full batches and a 2-sample batch per rank: no padding, a ragged last batch, a tail window."""
    return script_common.classification_data(world_size * (4 * BATCH + 2), 1, FEATURES, CLASSES, noise=0.5)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, CLASSES))


def make_optimizer(model, scheduled: bool):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if not scheduled:
        return opt, None
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return opt, scheduler


class RaiseOnce(Callback):
    """Raises once, on every rank at the same point, at epoch 2 (`where`: 'unsynced' or 'update')."""

    def __init__(self, where: str):
        self.where = where
        self.fired = False

    def _maybe_raise(self, trainer):
        if not self.fired and trainer.loop.epoch == 2:
            self.fired = True
            raise RuntimeError(f"injected failure ({self.where})")

    def on_after_backward(self, trainer, loss):
        # batch 3 is the first micro-batch of the second window: its backward did not all-reduce
        if self.where == "unsynced" and trainer.loop.batch_idx == 3:
            self._maybe_raise(trainer)

    def on_before_optimize(self, trainer, optimize_index):
        if self.where == "update" and trainer.loop.batch_idx == 4:
            self._maybe_raise(trainer)


CASES = {
    "plain": {"k": 1, "scheduled": False, "fail": None},
    "accumulation": {"k": 2, "scheduled": False, "fail": None},
    "step_scheduler": {"k": 2, "scheduled": True, "fail": None},
    "retry_unsynced_microbatch": {"k": 2, "scheduled": False, "fail": "unsynced"},
    "retry_before_update": {"k": 2, "scheduled": False, "fail": "update"},
}


def run_case(case: dict, device: str, precision: str) -> dict:
    """Train under the Trainer; return this rank's final state and records."""
    world_size = world_size_from_env()
    dataset = make_data(world_size)
    model = make_model()
    opt, scheduler = make_optimizer(model, case["scheduled"])
    wrapped = Optimizer(opt, scheduler, sched_on="step") if scheduler is not None else opt
    callbacks = [RaiseOnce(case["fail"])] if case["fail"] else []
    trainer = Trainer(model, F.cross_entropy, wrapped, epochs=EPOCHS, device=device, precision=precision,
                      gradient_accumulation_steps=case["k"], callbacks=callbacks, log_batch=False,
                      show_info=False)
    try:
        interrupted = False
        try:
            trainer.fit(DataLoader(dataset, batch_size=BATCH))
        except RuntimeError as exc:
            if "injected failure" not in str(exc):
                raise
            interrupted = True
            trainer.fit(DataLoader(dataset, batch_size=BATCH))  # continues with the discarded window
        state = {
            "weights": torch.cat([p.detach().float().flatten() for p in trainer.raw_model.parameters()]).cpu(),
            "scale": float(trainer.scaler.get_scale()) if trainer.scaler is not None else None,
            "lr": opt.param_groups[0]["lr"],
            "losses": trainer.history["train"]["loss"],  # every epoch, across both fit() calls
            "interrupted": interrupted,
            "device": str(trainer.device),
            "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        }
        if trainer.world_size > 1:
            states = [None] * trainer.world_size
            dist.all_gather_object(states, state)
        else:
            states = [state]
    finally:
        trainer.close()
    return {"states": states, "world_size": trainer.world_size}


def reference(case: dict, device: torch.device, precision: str, world_size: int) -> dict:
    """One process, global batch w*BATCH, plain PyTorch; one window = k global batches."""
    dataset = make_data(world_size)
    x_all, y_all = (t.to(device) for t in dataset.tensors)
    model = make_model().to(device)
    opt, scheduler = make_optimizer(model, case["scheduled"])
    dtype = AMP_DTYPES.get(precision)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    global_batch, window = world_size * BATCH, world_size * BATCH * case["k"]
    losses = []
    for _ in range(EPOCHS):
        total, count = 0.0, 0
        for start in range(0, len(x_all), window):
            x, y = x_all[start:start + window], y_all[start:start + window]
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(model(x), y)  # mean over the window = sum(n_i * loss_i) / N
            total += float(loss.detach()) * len(y)
            count += len(y)
            (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()
        losses.append(total / count)
    assert global_batch * case["k"] == window
    return {
        "weights": torch.cat([p.detach().float().flatten() for p in model.parameters()]).cpu(),
        "scale": float(scaler.get_scale()) if scaler else None,
        "lr": opt.param_groups[0]["lr"],
        "losses": losses,
    }


def compare(result: dict, ref: dict, precision: str) -> dict:
    states = result["states"]
    first = states[0]
    tolerance = TOLERANCE[precision]
    weight_diff = float((first["weights"] - ref["weights"]).abs().max())
    loss_diff = max(abs(a - b) for a, b in zip(first["losses"], ref["losses"]))
    checks = {
        "weights_match_reference": weight_diff <= tolerance,
        "train_losses_match_reference": loss_diff <= tolerance * 10,
        "lr_matches_reference": abs(first["lr"] - ref["lr"]) <= 1e-12,
        "ranks_hold_equal_weights": all(torch.equal(s["weights"], first["weights"]) for s in states),
        "ranks_share_lr": len({s["lr"] for s in states}) == 1,
        "ranks_share_grad_scale": len({s["scale"] for s in states}) == 1,
        "device_per_local_rank": all(s["device"] == f"cuda:{s['local_rank']}" for s in states)
        if first["device"].startswith("cuda") else True,
        "epochs_completed": len(first["losses"]) == EPOCHS,
    }
    return {"checks": checks, "max_weight_diff": weight_diff, "max_loss_diff": loss_diff,
            "lr": first["lr"], "reference_lr": ref["lr"], "scale": first["scale"],
            "interrupted_and_retried": first["interrupted"], "devices": [s["device"] for s in states]}


def write(path: Path, payload: dict) -> None:
    if os.environ.get("RANK", "0") == "0":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2))


def main() -> int:
    args = parse_args()
    output = Path(args.output)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("skipped: CUDA not available")
        write(output, {"status": "skipped", "reason": "CUDA not available"})
        return 0
    world_size = world_size_from_env()
    cases = {}
    for name, case in CASES.items():
        result = run_case(case, args.device, args.precision)
        if os.environ.get("RANK", "0") == "0":
            device = torch.device(result["states"][0]["device"])
            cases[name] = compare(result, reference(case, device, args.precision, world_size),
                                  args.precision)
            if case["fail"]:
                cases[name]["checks"]["failure_was_injected"] = cases[name]["interrupted_and_retried"]
    if os.environ.get("RANK", "0") != "0":
        return 0
    checks = [ok for case in cases.values() for ok in case["checks"].values()]
    world_ok = args.expected_world_size in (None, world_size)
    passed = all(checks) and world_ok
    write(output, {"status": "passed" if passed else "failed", "world_size": world_size,
                   "expected_world_size": args.expected_world_size, "precision": args.precision,
                   "checks_passed": sum(checks) + world_ok, "checks_total": len(checks) + 1, "cases": cases})
    print(f"multigpu_training: {'passed' if passed else 'failed'} ({sum(checks) + world_ok}/{len(checks) + 1}"
          f" checks, world size {world_size}, {args.precision})")
    for name, case in cases.items():
        failed = [check for check, ok in case["checks"].items() if not ok]
        print(f"  {name}: {'ok' if not failed else 'FAILED ' + ', '.join(failed)}"
              f" (max weight diff {case['max_weight_diff']:.2e})")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
