"""Finding a learning rate: `trainer.find_lr(...)`, and 0.6's `LRFindCallback`.

The finder trains with a learning rate growing exponentially from `min_lr` to `max_lr`, one rate per
update, stops when the loss diverges, and then puts the model, optimizer and scheduler back as they were.
It returns the rates, the losses and a suggestion (where the smoothed loss falls fastest); with matplotlib
installed it draws the curve (here saved to lr_find.png; otherwise it says how to get it).

Run: `python examples/27-lr_find.py` (or `--small` for a few seconds' run).
"""

import argparse
import importlib.util

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import LRFindCallback, Trainer, set_seed
from deepepochs.metrics import accuracy


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + (x[:, 4] > 1).long()
    return TensorDataset(x, y)


def make_model():
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 3))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="fewer samples, steps and epochs")
    args = parser.parse_args()
    n, steps, epochs = (1024, 30, 2) if args.small else (16384, 100, 8)
    set_seed(0)
    train_dl = DataLoader(make_data(n, 1), batch_size=64, shuffle=True)
    val_dl = DataLoader(make_data(n // 4, 2), batch_size=256)

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    with Trainer(model, F.cross_entropy, opt, epochs=epochs, metrics=[accuracy], log_batch=False) as trainer:
        # plot= saves the curve with matplotlib (pip install 'deepepochs[plot]'); without it, read result.lrs
        plot = "lr_find.png" if importlib.util.find_spec("matplotlib") else False
        result = trainer.find_lr(train_dl, min_lr=1e-5, max_lr=10.0, num_steps=steps, plot=plot)
        lr = result.suggestion or 1e-2  # None only when fewer than 3 updates ran
        print(f"swept {len(result.lrs)} rates ({result.stop_reason}); training with lr {lr:.3g}")
        for group in opt.param_groups:  # the sweep left the optimizer as it was: set the rate to use
            group["lr"] = lr
        trainer.fit(train_dl, val_dl)

    # deepepochs 0.6 style: a fit with LRFindCallback is the sweep (and draws the curve when it can).
    model = make_model()
    finder = LRFindCallback(max_batch=steps, min_lr=1e-5, max_lr=10.0, plot=False)
    with Trainer(model, F.cross_entropy, torch.optim.Adam(model.parameters(), lr=2e-4), epochs=2,
                 callbacks=[finder], log_batch=False, show_info=False) as trainer:
        trainer.fit(train_dl)
    print(f"LRFindCallback: {len(finder.lrs)} rates, suggested lr {finder.suggestion}")


if __name__ == "__main__":
    main()
