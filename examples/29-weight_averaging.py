"""Weight averaging: an exponential moving average (`EMACallback`) and stochastic weight averaging (`SWACallback`).

Both keep a torch `AveragedModel` of the model (`callback.averaged`) that moves only with the updates the
fit committed: an update skipped for inf/NaN or discarded by an error never reaches it, and checkpoints hold
it, so `resume=True` continues it. With `evaluate=True` validation and `test()` use the average.

Run: `python examples/29-weight_averaging.py` (or `--small` for a few seconds' run).
"""

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import CheckCallback, EMACallback, SWACallback, Trainer, set_seed
from deepepochs.metrics import accuracy


def make_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 20, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + (x[:, 4] > 1).long()
    return TensorDataset(x + 0.5 * torch.randn(n, 20, generator=g), y)


def make_model():
    return nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 3))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="fewer samples and epochs")
    args = parser.parse_args()
    n, epochs = (1024, 3) if args.small else (16384, 12)
    set_seed(0)
    train_dl = DataLoader(make_data(n, 1), batch_size=64, shuffle=True)
    val_dl = DataLoader(make_data(n // 4, 2), batch_size=256)

    # An EMA with a half-life of 50 updates, validated and tested in place of the training weights; the
    # checkpoint of the best validation accuracy holds the average too, and test() evaluates that one
    # (the averaging callback listed after the CheckCallback).
    model = make_model()
    ema = EMACallback(half_life=50, warmup=True, evaluate=True)
    checker = CheckCallback("accuracy", mode="max", ckpt_dir="./checkpoints")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with Trainer(model, F.cross_entropy, opt, epochs=epochs, metrics=[accuracy], callbacks=[checker, ema],
                 log_batch=False) as trainer:
        trainer.fit(train_dl, val_dl)
        print("test with the EMA:", trainer.test(val_dl))
    print(f"EMA of {ema.updates} updates; its model: {type(ema.averaged.module).__name__}")

    # SWA over the last third of the epochs, annealing the rate to 0.05; BatchNorm statistics of the
    # average are recomputed over the training data at the end.
    model = make_model()
    swa = SWACallback(start_epoch=epochs - epochs // 3, swa_lr=0.05, anneal_epochs=2, evaluate=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with Trainer(model, F.cross_entropy, opt, epochs=epochs, metrics=[accuracy], callbacks=[swa],
                 log_batch=False) as trainer:
        trainer.fit(train_dl, val_dl)
        print("test with the SWA average:", trainer.test(val_dl))
    print(f"SWA average of {swa.updates} epochs")


if __name__ == "__main__":
    main()
