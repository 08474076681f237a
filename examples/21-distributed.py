"""Training on several processes from a plain script with `launch(main)`: DDP, or FSDP2 with `--strategy fsdp`.

Every process runs `main()`: it builds the same data, model, optimizer and Trainer as a one-process
script. The Trainer notices the distributed environment, joins the process group (gloo on CPU, NCCL on
CUDA), wraps the model in DDP, shards the plain DataLoaders, and reports global metrics; only rank 0
prints. `launch` returns rank 0's result to the caller.

Run from the repository root:
    python examples/21-distributed.py                      # one process per GPU, one CPU process without GPUs
    python examples/21-distributed.py --num-processes 2    # two processes (e.g. two CPU processes)
    torchrun --nproc-per-node=2 examples/21-distributed.py # torchrun decides the process count
    CUDA_VISIBLE_DEVICES="" torchrun --master-addr=127.0.0.1 --master-port=29500 --nproc-per-node=2 \
        examples/21-distributed.py                         # two CPU processes under torchrun

    torchrun --nproc-per-node=2 examples/21-distributed.py --strategy fsdp  # parameters sharded (FSDP2)

Options: `--epochs N` (default 5), `--small` (2 epochs), `--num-processes N` (ignored under torchrun),
`--strategy ddp|fsdp` (default ddp: `Trainer(strategy=...)`; one process trains alone either way).
"""

import argparse
import os

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Trainer, launch, set_seed
from deepepochs.metrics import accuracy

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # torch < 2.6 has no FSDP2: strategy='fsdp' is unavailable there
    FSDPModule = ()

# Children started by launch() re-import this file without its command line, so main() reads the epoch
# count from the environment, where the parent put it before launching.
_EPOCHS_ENV = "DEEPEPOCHS_EXAMPLE_EPOCHS"
_STRATEGY_ENV = "DEEPEPOCHS_EXAMPLE_STRATEGY"


def main():
    set_seed(42)
    x = torch.randn(256, 16)
    y = (x[:, 0] > 0).long()
    train_dl = DataLoader(TensorDataset(x[:192], y[:192]), batch_size=32, shuffle=True)
    val_dl = DataLoader(TensorDataset(x[192:], y[192:]), batch_size=32)
    model = nn.Linear(16, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    epochs = int(os.environ.get(_EPOCHS_ENV, "5"))
    strategy = os.environ.get(_STRATEGY_ENV, "ddp")
    trainer = Trainer(model, F.cross_entropy, opt, epochs=epochs, metrics=[accuracy], log_batch=False,
                      strategy=strategy)
    try:
        trainer.fit(train_dl, val_dl)
        results = trainer.test(val_dl)
        results["world_size"] = trainer.world_size
        results["sharded"] = isinstance(trainer.raw_model, FSDPModule)  # FSDP shards the model in place
        return results
    finally:
        trainer.close()


def _parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=None, help="epochs to train (default 5)")
    parser.add_argument("--small", action="store_true", help="a quick run: 2 epochs")
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp",
                        help="ddp (a replica per process) or fsdp (parameters sharded); default ddp")
    parser.add_argument("--num-processes", type=int, default=None,
                        help="processes to start (default: one per GPU, or 1 without GPUs)")
    # Tolerant: torchrun and IDEs may pass arguments of their own.
    args, unknown = parser.parse_known_args()
    if unknown:
        print(f"ignoring unknown arguments: {' '.join(unknown)}")
    return args


if __name__ == "__main__":
    args = _parse_args()
    os.environ[_EPOCHS_ENV] = str(args.epochs or (2 if args.small else 5))
    os.environ[_STRATEGY_ENV] = args.strategy
    results = launch(main, num_processes=args.num_processes)
    if results is not None:  # rank 0's result; under torchrun the other ranks get None
        print(f"test results (world size {results['world_size']}): {results}")
