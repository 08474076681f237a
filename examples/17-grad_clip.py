"""Gradient clipping with GradClipCallback: by value or by norm, after fp16 unscaling, before the step.

Run: `python examples/17-grad_clip.py [--precision fp16] [--small]`. Two optimizers (one per half of the
model) share one joint norm; a group whose gradients overflowed would be left out and skip its update.
"""

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, GradClipCallback, Trainer

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--precision", default="fp32", choices=["fp32", "fp16", "bf16"])
parser.add_argument("--max-norm", type=float, default=1.0)
parser.add_argument("--small", action="store_true", help="2 epochs on less data")
args = parser.parse_args()
n, epochs = (256, 2) if args.small else (2048, 5)

torch.manual_seed(0)
x = torch.randn(n, 16)
y = 5 * x[:, :4] @ torch.tensor([[1.0], [-2.0], [0.5], [1.5]])  # large early errors: big first gradients
train_dl = DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True)

model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
opts = [torch.optim.SGD(model[0].parameters(), lr=0.05, momentum=0.9),
        torch.optim.SGD(model[2].parameters(), lr=0.05, momentum=0.9)]


class NormReport(Callback):
    """Prints the joint norm GradClipCallback saw before clipping, once per epoch (a host sync, so rarely)."""

    def __init__(self, clipper):
        self.clipper = clipper

    def on_after_train_epochs(self, trainer, tasks, metrics, epoch_idx):
        norm = self.clipper.last_norm
        if norm is not None:
            print(f"  epoch {epoch_idx + 1}: last pre-clip norm {norm.item():.3f} -> clipped to"
                  f" {min(norm.item(), self.clipper.max_value):.3f}")


# norm_type=None would clip every gradient element to [-max_value, max_value] instead.
clipper = GradClipCallback(args.max_norm, norm_type=2)
with Trainer(model, F.mse_loss, opts, epochs=epochs, precision=args.precision,
             callbacks=[clipper, NormReport(clipper)], log_batch=False) as trainer:
    records = trainer.fit(train_dl)
    print("per-epoch train loss:", [round(v, 4) for v in records["train"]["loss"]])
