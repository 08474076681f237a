"""Look inside the model: layer outputs and gradients with `AnalyzeCallback` (synthetic data, CPU, offline).

A deep tanh MLP with a too-small initialisation is a classic case of vanishing signals: the spread of the
layer outputs and of the gradients shrinks layer after layer. Two runs, one per mode, write per-epoch mean,
std and histograms of every leaf layer to TensorBoard; the script then reads the first epoch back and prints
the std per layer (outputs shrink going forward, gradients shrink going backward).

Run: `python examples/08-analyze.py` (or `--small` for a few seconds' run).
"""

import argparse
import tempfile

import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import AnalyzeCallback, LogCallback, Trainer, set_seed


def deep_tanh(width=32, depth=6, gain=0.5):
    """`depth` Linear+Tanh blocks initialised with a small gain (the signal shrinks in each)."""
    layers = []
    for i in range(depth):
        linear = nn.Linear(16 if i == 0 else width, width)
        nn.init.xavier_normal_(linear.weight, gain=gain)
        layers += [linear, nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 2))


def run(mode, log_dir, train_dl, epochs):
    set_seed(0)
    model = deep_tanh()
    analyze = AnalyzeCallback(mode, log_dir=log_dir, layers=[str(i) for i in range(0, 12, 2)])  # the Linears
    with Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.05), epochs=epochs,
                 log_batch=False, show_info=False, running_id=f"analyze-{mode}",
                 callbacks=[LogCallback(log_dir), analyze]) as trainer:
        trainer.fit(train_dl)
    events = EventAccumulator(f"{log_dir}/analyze-{mode}")
    events.Reload()
    return events


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a few seconds' run into a temporary folder")
    parser.add_argument("--log-dir", default=None, help="default: ./logs (a temporary folder with --small)")
    args = parser.parse_args()
    log_dir = args.log_dir or (tempfile.mkdtemp(prefix="deepepochs-logs-") if args.small else "./logs")
    n, epochs = (512, 2) if args.small else (8192, 10)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    train_dl = DataLoader(TensorDataset(x, (x[:, :4].sum(1) > 0).long()), batch_size=64, shuffle=True)
    forward = run("forward", log_dir, train_dl, epochs)
    backward = run("backward", log_dir, train_dl, epochs)

    print("\nepoch 1, std per Linear layer (input side first):")
    print("layer   output std   output-gradient std   weight-gradient std")
    for i in range(0, 12, 2):
        out = forward.Scalars(f"output/{i}/std")[0].value
        grad = backward.Scalars(f"grad/{i}/std")[0].value
        weight = backward.Scalars(f"param_grad/{i}.weight/std")[0].value
        print(f"{i:>5}   {out:10.2e}   {grad:19.2e}   {weight:19.2e}")
    print(f"histograms per layer and epoch: tensorboard --logdir={log_dir} (HISTOGRAMS tab)")


if __name__ == "__main__":
    main()
