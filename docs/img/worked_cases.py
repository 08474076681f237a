"""Make the pictures of the three worked cases in docs/debugging.md from real runs (needs Graphviz).

Run from the repository root: `python docs/img/worked_cases.py` (writes docs/img/case-*.svg; `--png` also
writes PNGs next to them for a quick look). Each case is a tiny synthetic run that fails or skips at a known
point:

1. nan-window: gradient accumulation k=3; the loss of epoch 2's 8th batch is NaN; with the default
   nonfinite='raise' the update window that holds it raises FloatingPointError.
2. callback-epoch: a callback raises in `on_after_epoch` of epoch 2 (the epoch's end, before it commits).
3. fp16-skip: precision='fp16' (the CPU GradScaler); the loss of one batch is multiplied by 1e5, so the scaled
   gradients overflow float16 for real and the scaler skips that update. The graph is drawn from the
   `on_skip_optimize` hook, in the middle of the skipped update.
"""

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, Trainer

OUT = Path(__file__).resolve().parent


def data(n=48):
    torch.manual_seed(0)
    x = torch.randn(n, 4)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=4, shuffle=True)  # n/4 batches


def trainer(loss=F.cross_entropy, **kw):
    return Trainer(nn.Linear(4, 2), loss, epochs=3, log_batch=False, show_info=False, device="cpu", **kw)


def nan_window():
    calls = []

    def loss(pred, target):
        calls.append(None)
        out = F.cross_entropy(pred, target)
        return out * float("nan") if len(calls) == 12 + 8 else out

    t = trainer(loss, gradient_accumulation_steps=3)
    try:
        t.fit(data())
    except FloatingPointError as e:
        print("\n".join(e.__notes__))
    return t.state_graph("dot")  # the failed state's level: batch


class FailAtEpochEnd(Callback):
    def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx):
        if epoch_idx == 1:  # 0-based: epoch 2
            raise RuntimeError("callback failed at the end of epoch 2")


def callback_epoch():
    t = trainer(callbacks=[FailAtEpochEnd()])
    try:
        t.fit(data(), data(8))
    except RuntimeError as e:
        print("\n".join(e.__notes__))
    return t.state_graph("dot", last=16)  # the failed state's level: fit; 16 steps reach the last update


class DrawOnSkip(Callback):
    def __init__(self):
        self.dot = None

    def on_skip_optimize(self, trainer, optimize_index):
        if self.dot is None:
            print("skipped in state", trainer.machine.state, "epoch", trainer.loop.epoch, "batch",
                  trainer.loop.batch_idx)
            self.dot = trainer.state_graph("dot", level="batch")


def fp16_skip():
    calls = []

    def loss(pred, target):
        calls.append(None)
        out = F.cross_entropy(pred, target)
        return out * 1e5 if len(calls) == 5 else out  # x 65536 (the scale) overflows float16's 65504

    draw = DrawOnSkip()
    t = trainer(loss, precision="fp16", callbacks=[draw])
    t.fit(data())
    return draw.dot


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--png", action="store_true", help="also write PNGs (not committed)")
    args = parser.parse_args()
    from deepepochs.fsm.render import run_dot  # noqa: PLC0415
    for name, make in (("nan-window", nan_window), ("callback-epoch", callback_epoch), ("fp16-skip", fp16_skip)):
        dot = make()
        (OUT / f"case-{name}.svg").write_bytes(run_dot(dot, "svg"))
        if args.png:
            (OUT / f"case-{name}.png").write_bytes(run_dot(dot, "png"))
        print("wrote", OUT / f"case-{name}.svg")


if __name__ == "__main__":
    main()
