"""Per-rank parameter and optimizer-state memory under FSDP against DDP.

Two CPU processes (`deepepochs.launch`, gloo) train a ~50M-parameter MLP with Adam for a few batches, once
with `strategy='ddp'` and once with `strategy='fsdp'`. After training every rank reports the bytes of the
parameters and optimizer state it holds (for FSDP's DTensors, the local shard), and its peak
RSS. With w processes FSDP should hold about 1/w of DDP's parameter + optimizer-state bytes (gradients are
dropped after each update, `set_to_none`, so none are held between updates). Then each rank saves a
checkpoint (`deepepochs.checkpoint.save`) and reports the bytes it wrote: under DDP rank 0 writes the one
file of full states; under FSDP every rank writes its own shards (about 1/w each, nothing gathered).

    python benchmarks/fsdp_memory.py                 # writes results/fsdp_memory.json
    python benchmarks/fsdp_memory.py --width 256     # smoke test (small model)
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from common import RESULTS_DIR, machine_info, write_json  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from deepepochs import Trainer, checkpoint, launch  # noqa: E402

MB = 1024 * 1024
WIDTH_ENV, LAYERS_ENV, STRATEGY_ENV = "FSDP_BENCH_WIDTH", "FSDP_BENCH_LAYERS", "FSDP_BENCH_STRATEGY"
SAVE_ENV = "FSDP_BENCH_SAVE_DIR"


def _local_bytes(tensor) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's shard on this rank
    return local.numel() * local.element_size()


def measure() -> list:
    """Every rank builds the model, trains 4 batches and reports what it holds; rank 0 returns all ranks'
    figures (`launch` returns rank 0's value)."""
    width, layers = int(os.environ[WIDTH_ENV]), int(os.environ[LAYERS_ENV])
    strategy = os.environ[STRATEGY_ENV]
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    kwargs = {"fsdp_kwargs": {"min_params": width * width // 2}} if strategy == "fsdp" else {}
    trainer = Trainer(model, F.mse_loss, opt, epochs=1, device="cpu", strategy=strategy, log_batch=False,
                      show_info=False, **kwargs)
    x = torch.randn(16, width)
    try:
        trainer.fit(DataLoader(TensorDataset(x, x), batch_size=2))
        params = sum(_local_bytes(p) for p in model.parameters())
        states = sum(_local_bytes(v) for group in trainer.opt[0].opt.state.values() for v in group.values()
                     if isinstance(v, torch.Tensor))
        mine = {"rank": trainer._dist.rank, "strategy": strategy, "parameters": layers * (width * width + width),
                "param_mb": params / MB, "optimizer_state_mb": states / MB,
                "param_plus_state_mb": (params + states) / MB,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
        path = Path(os.environ[SAVE_ENV]) / strategy / "bench.ckpt"
        checkpoint.save(trainer, path)
        trainer._dist.all_gather_object(None)  # rank 0 has committed: every rank sees the finished save
        mine["checkpoint_written_mb"] = (
            sum(f.stat().st_size for f in path.glob(f"shards-*/__{trainer._dist.rank}_*.distcp")) if path.is_dir()
            else path.stat().st_size if trainer._dist.is_main else 0) / MB
        mine["peak_rss_after_save_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        return trainer._dist.all_gather_object(mine)  # before close(): it ends the process group
    finally:
        trainer.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048, help="units per layer (2048 x 12 layers: ~50M params)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--output", default=str(RESULTS_DIR / "fsdp_memory.json"), help="'' for none")
    args = parser.parse_args(argv)
    os.environ[WIDTH_ENV], os.environ[LAYERS_ENV] = str(args.width), str(args.layers)
    rows = []
    os.environ[SAVE_ENV] = tempfile.mkdtemp(prefix="fsdp-bench-")
    try:
        for strategy in ("ddp", "fsdp"):
            os.environ[STRATEGY_ENV] = strategy
            rows += launch(measure, num_processes=args.processes)
    finally:
        shutil.rmtree(os.environ[SAVE_ENV], ignore_errors=True)
    by = {s: [r for r in rows if r["strategy"] == s] for s in ("ddp", "fsdp")}
    ratio = (sum(r["param_plus_state_mb"] for r in by["fsdp"]) / len(by["fsdp"])) / (
        sum(r["param_plus_state_mb"] for r in by["ddp"]) / len(by["ddp"]))
    print(f"## Per-rank memory, {rows[0]['parameters'] / 1e6:.1f}M parameters, Adam, {args.processes} CPU processes\n")
    print("| strategy | rank | parameters MB | optimizer state MB | params + state MB | peak RSS MB |"
          " checkpoint written MB | peak RSS after save MB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['strategy']} | {r['rank']} | {r['param_mb']:.1f} | {r['optimizer_state_mb']:.1f} |"
              f" {r['param_plus_state_mb']:.1f} | {r['peak_rss_mb']:.0f} | {r['checkpoint_written_mb']:.1f} |"
              f" {r['peak_rss_after_save_mb']:.0f} |")
    print(f"\nFSDP / DDP, parameters + optimizer state per rank: {ratio:.3f} (1/w = {1 / args.processes:.3f})")
    if args.output:
        write_json(args.output, {"benchmark": "fsdp_memory", "machine": machine_info(), "settings": vars(args),
                                 "results": rows, "fsdp_over_ddp": ratio})
    return 0


if __name__ == "__main__":
    sys.exit(main())
