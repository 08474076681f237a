"""`torch.compile` through `Trainer(compile_model=True)`.

The trainer compiles the model it calls; `trainer.raw_model` stays the plain module, so state dicts and
checkpoints have the same parameter names with and without compilation. Compilation needs a working
backend (Inductor needs a C++ compiler on CPU); when it fails here the script says why and exits 0.

Run: `python examples/19-compile.py` (or `--small` for a short run).
"""

import argparse
import sys
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Trainer, set_seed


def train(compile_model, epochs, train_dl, val_dl):
    set_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 4))
    trainer = Trainer(model, F.cross_entropy, torch.optim.AdamW(model.parameters(), lr=3e-3), epochs=epochs,
                      compile_model=compile_model, log_batch=False, show_info=False)
    with trainer:
        start = time.perf_counter()
        records = trainer.fit(train_dl, val_dl)
        elapsed = time.perf_counter() - start
        names = list(trainer.raw_model.state_dict())
    return records["val"]["loss"][-1], elapsed, names


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="fewer samples and epochs")
    args = parser.parse_args()
    n, epochs = (512, 1) if args.small else (8192, 4)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 32, generator=g)
    y = (x[:, :4] * torch.arange(1, 5)).argmax(dim=1)
    train_dl = DataLoader(TensorDataset(x[: n * 3 // 4], y[: n * 3 // 4]), batch_size=64, shuffle=True)
    val_dl = DataLoader(TensorDataset(x[n * 3 // 4:], y[n * 3 // 4:]), batch_size=128)

    eager_loss, eager_s, eager_names = train(False, epochs, train_dl, val_dl)
    try:
        compiled_loss, compiled_s, compiled_names = train(True, epochs, train_dl, val_dl)
    except Exception as e:  # backends fail in many ways: no C++ compiler, unsupported platform, ...
        first_line = (str(e).strip().splitlines() or [""])[0]
        print(f"skipped: torch.compile does not work on this machine ({type(e).__name__}: {first_line})")
        return 0
    print(f"eager:    val loss {eager_loss:.4f} in {eager_s:.1f} s")
    print(f"compiled: val loss {compiled_loss:.4f} in {compiled_s:.1f} s (includes compilation)")
    print("same parameter names in the state dict:", eager_names == compiled_names, eager_names[:2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
