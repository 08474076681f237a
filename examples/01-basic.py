"""The smallest complete run: a linear classifier on random binary data, then fit, test, close.

The model learns the rule `y = x[:, 0] > 0` within the first epochs (Adam, lr=0.05, 5 epochs of 6
batches: the loss falls every epoch); the script then continues the same trainer to a higher epoch
target, which shows that `fit` can be called again and goes on from where it stopped.

Run: `python examples/01-basic.py` (or `--small` for fewer epochs). `make demo` runs this file.
"""

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Trainer
from deepepochs.metrics import accuracy

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--small", action="store_true", help="2 + 5 epochs instead of 5 + 10")
args = parser.parse_args()
epochs, more = (2, 5) if args.small else (5, 10)

# ---- the whole run: data, model, optimizer, Trainer, fit, test ----
torch.manual_seed(0)
x = torch.randn(256, 16)
y = (x[:, 0] > 0).long()
train_dl = DataLoader(TensorDataset(x[:192], y[:192]), batch_size=32, shuffle=True)
val_dl = DataLoader(TensorDataset(x[192:], y[192:]), batch_size=32)

model = nn.Linear(16, 2)
opt = torch.optim.Adam(model.parameters(), lr=0.05)
trainer = Trainer(model, F.cross_entropy, opt, epochs=epochs)
progress = trainer.fit(train_dl, val_dl)
results = trainer.test(val_dl)
# ---- end of the run ----

# fit() returned per-epoch records, test() a dict of metrics; test() may be called again with metrics.
print("per-epoch train loss:", [round(v, 4) for v in progress["train"]["loss"]])
print("per-epoch val loss:  ", [round(v, 4) for v in progress["val"]["loss"]])
print("test results:", results)
print(f"accuracy after the first {epochs} epochs: {trainer.test(val_dl, metrics=[accuracy])['accuracy']:.3f}")

# `epochs` is the total target: a later fit continues from the completed epochs up to the new target.
trainer.fit(train_dl, val_dl, epochs=epochs + more)
scores = trainer.test(val_dl, metrics=[accuracy])
print(f"accuracy after {epochs + more} epochs: {scores['accuracy']:.3f} (chance is about 0.5)")

trainer.close()
