"""Throughput benchmark: a 9-layer convnet (~5.2M parameters) on 224x224 synthetic images.

Drives deepepochs' `Trainer` (or, with `--raw`, a plain PyTorch loop at the same settings) through
`--warmup` + `--steps` training steps and times each measured step from the end of the previous one to the
end of this one, so the window holds data collation on the CPU, the host-to-device copy, forward, backward,
the optimizer step and the per-batch statistics. On CUDA the timer synchronises the device at each
measured step boundary (never during warm-up). Images are generated once and cached on the CPU.

Weak scaling under torchrun: every rank runs `--batch-size` images per step; global throughput is all
samples divided by the slowest rank's measured time.

    python benchmarks/multigpu_benchmark.py --precision fp16 --output /tmp/bench-1-fp16.json
    python benchmarks/multigpu_benchmark.py --precision fp16 --raw --output /tmp/bench-1-fp16-raw.json
    torchrun --standalone --nproc-per-node=4 benchmarks/multigpu_benchmark.py --expected-world-size 4 \\
        --precision bf16 --output /tmp/bench-4-bf16.json
    python benchmarks/multigpu_benchmark.py --device cpu --steps 3 --warmup 1 --batch-size 2 --image-size 64
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import machine_info, median  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, RandomSampler, TensorDataset  # noqa: E402

DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def convnet(classes: int = 1000) -> nn.Module:
    """Eight 3x3 conv layers (BatchNorm, ReLU, four 2x2 max-pools) and a linear head: 9 weight layers."""
    widths = [3, 32, 64, 128, 128, 256, 256, 512, 512]
    pool_after = {1, 3, 5, 7}  # 0-based conv index
    layers: list[nn.Module] = []
    for i, (cin, cout) in enumerate(zip(widths[:-1], widths[1:])):
        layers += [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]
        if i in pool_after:
            layers.append(nn.MaxPool2d(2))
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(widths[-1], classes)]
    return nn.Sequential(*layers)


def dist_env() -> tuple[int, int, int]:
    """(rank, local rank, world size) from torchrun's environment (0, 0, 1 without it)."""
    return (int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)),
            int(os.environ.get("WORLD_SIZE", 1)))


def synthetic_loader(args, rank: int, pin: bool) -> DataLoader:
    """`warmup + steps` batches drawn with replacement from a pool of images cached on the CPU."""
    g = torch.Generator().manual_seed(1234 + rank)
    pool = max(args.batch_size * 4, 64)
    images = torch.randn(pool, 3, args.image_size, args.image_size, generator=g)
    labels = torch.randint(0, args.classes, (pool,), generator=g)
    sampler = RandomSampler(TensorDataset(images, labels), replacement=True,
                            num_samples=(args.warmup + args.steps) * args.batch_size, generator=g)
    # A user sampler: deepepochs uses it as given (no automatic sharding), so each rank runs every step.
    return DataLoader(TensorDataset(images, labels), batch_size=args.batch_size, sampler=sampler,
                      num_workers=0, pin_memory=pin, drop_last=True)


class StepTimer:
    """Timestamps the end of every step; synchronises CUDA only once warm-up is over."""

    def __init__(self, warmup: int, device: torch.device):
        self.warmup = warmup
        self.sync = device.type == "cuda"
        self.device = device
        self.step = 0
        self.last = None
        self.times: list[float] = []
        self.measure_start = None

    def end_step(self) -> None:
        self.step += 1
        if self.step < self.warmup:
            return
        if self.sync:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        if self.step == self.warmup:  # the measured window opens at the end of the last warm-up step
            if self.sync:
                torch.cuda.reset_peak_memory_stats(self.device)
            self.measure_start = now
        else:
            self.times.append(now - self.last)
        self.last = now


def run_raw(args, model, loader, device, timer, world_size):
    """The reference: zero_grad, autocast forward + loss, (scaled) backward, step."""
    if world_size > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                                    else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    dtype = DTYPES[args.precision]
    scaler = torch.amp.GradScaler(device.type) if args.precision == "fp16" else None
    non_blocking = device.type == "cuda"
    loss_sum = torch.zeros((), device=device)
    model.train()
    for x, y in loader:
        x, y = x.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking)
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        loss_sum += loss.detach()  # the per-batch statistics the trainer keeps as well
        timer.end_step()
    return float(loss_sum)


def run_deepepochs(args, model, loader, device, timer, world_size):
    from deepepochs import Callback, Trainer

    class Timing(Callback):
        def on_after_train_batch(self, trainer, metrics, batch_idx):
            timer.end_step()

    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    trainer = Trainer(model, F.cross_entropy, opt, epochs=1, device=device, callbacks=[Timing()],
                      precision=args.precision, log_batch=False, show_info=args.verbose)
    try:
        if trainer.world_size != world_size:
            raise SystemExit(f"deepepochs sees world size {trainer.world_size}, the environment {world_size}")
        records = trainer.fit(loader)
        return gather(dict(loss=records["train"]["loss"][-1]))[0]["loss"], trainer
    except BaseException:
        trainer.close()
        raise


def gather(obj) -> list:
    """`obj` of every rank (a list of one without a process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def peak_memory(device) -> dict:
    if device.type == "cuda":
        return {"peak_allocated_mb": torch.cuda.max_memory_allocated(device) / 2**20,
                "peak_reserved_mb": torch.cuda.max_memory_reserved(device) / 2**20}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_rss_mb": (peak if sys.platform == "darwin" else peak * 1024) / 2**20}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="deepepochs throughput benchmark (9-layer convnet)")
    p.add_argument("--device", default="cuda", help="'cuda' (default; one GPU per rank) or 'cpu'")
    p.add_argument("--precision", choices=list(DTYPES), default="fp32")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--expected-world-size", type=int, default=None,
                   help="fail unless WORLD_SIZE equals this (catches a wrong torchrun command)")
    p.add_argument("--raw", action="store_true", help="run the plain PyTorch reference loop instead")
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls/convolutions (off by default)")
    p.add_argument("--output", default="", help="JSON file written by rank 0")
    p.add_argument("--verbose", action="store_true", help="show deepepochs' run header and epoch line")
    args = p.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rank, local_rank, world_size = dist_env()
    if args.expected_world_size is not None and args.expected_world_size != world_size:
        print(f"error: expected world size {args.expected_world_size}, but WORLD_SIZE is {world_size}",
              file=sys.stderr)
        return 2
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            print("skipped: CUDA not available")
            return 0
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device(args.device)
    # TF32 off unless asked: fp32 numbers then mean real fp32 arithmetic on Ampere and newer.
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    torch.backends.cudnn.allow_tf32 = args.tf32
    torch.backends.cudnn.benchmark = True
    if args.raw and world_size > 1:
        import torch.distributed as dist

        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(0)
    model = convnet(args.classes).to(device)
    params = sum(p.numel() for p in model.parameters())
    if rank == 0:
        loop = "raw PyTorch" if args.raw else "deepepochs"
        print(f"{loop} | model: 9-layer convnet, {params:,} parameters | {args.precision} |"
              f" batch {args.batch_size}/rank x {world_size} | image {args.image_size} |"
              f" warmup {args.warmup} + {args.steps} steps | device {device.type} | TF32 {args.tf32}",
              flush=True)
    loader = synthetic_loader(args, rank, pin=device.type == "cuda")
    timer = StepTimer(args.warmup, device)
    fit_start = time.perf_counter()
    trainer = None
    if args.raw:
        final_loss = run_raw(args, model, loader, device, timer, world_size)
    else:
        final_loss, trainer = run_deepepochs(args, model, loader, device, timer, world_size)
    fit_s = time.perf_counter() - fit_start
    times = timer.times
    measured = sum(times)
    mine = {"rank": rank, "step_times_s": times, "measured_s": measured,
            "throughput": args.batch_size * len(times) / measured if measured else float("nan"),
            "median_step_s": median(times) if times else float("nan"), "fit_s": fit_s, **peak_memory(device)}
    ranks = gather(mine)
    if trainer is not None:
        trainer.close()
    elif args.raw and world_size > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    if rank != 0:
        return 0
    slowest = max(r["measured_s"] for r in ranks)
    steps = len(times)
    result = {
        "benchmark": "multigpu_throughput", "loop": "raw" if args.raw else "deepepochs",
        "machine": machine_info(), "settings": vars(args), "world_size": world_size, "params": params,
        "global_batch": args.batch_size * world_size, "measured_steps": steps,
        "global_throughput": args.batch_size * world_size * steps / slowest if slowest else float("nan"),
        "final_train_loss": final_loss, "ranks": ranks,
    }
    print(f"global throughput: {result['global_throughput']:.1f} images/s | median step"
          f" {median([r['median_step_s'] for r in ranks]) * 1e3:.2f} ms | fit {fit_s:.1f} s | "
          + ", ".join(f"{k}: {v:.0f}" for k, v in mine.items() if k.startswith("peak")))
    if args.output:
        path = Path(args.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
