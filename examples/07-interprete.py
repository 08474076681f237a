"""Which samples does the model get wrong? `InterpreteCallback` (synthetic images, CPU, offline).

The data are 12x12 grey images of a horizontal or a vertical bar in noise; a few labels are flipped on
purpose. After training, one callback keeps the test samples with the highest loss (the "hardest": the
flipped labels should be among them) and another the most confident correct ones. With `image_data=True`
the hardest samples are also written as images to TensorBoard (`interprete/test`).

Run: `python examples/07-interprete.py` (or `--small` for a few seconds' run).
"""

import argparse
import tempfile

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import InterpreteCallback, LogCallback, Trainer, set_seed


def make_bars(n, seed, flip=0.05):
    """Images `[n, 1, 12, 12]` with a bar (label 0: horizontal, 1: vertical); a share `flip` of the labels
    is wrong, and the third tensor marks those samples."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = 0.6 * torch.randn(n, 1, 12, 12, generator=g)
    pos = torch.randint(2, 10, (n,), generator=g)
    for i in range(n):
        if y[i] == 0:
            x[i, 0, pos[i], :] += 1.5
        else:
            x[i, 0, :, pos[i]] += 1.5
    flipped = torch.rand(n, generator=g) < flip
    return x, torch.where(flipped, 1 - y, y), flipped


def per_sample_loss(preds, targets):
    return F.cross_entropy(preds, targets, reduction="none")


def correct_confidence(preds, targets):
    """The probability given to the true class (higher: more confidently right)."""
    return preds.softmax(dim=1).gather(1, targets[:, None]).squeeze(1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a few seconds' run into a temporary folder")
    parser.add_argument("--log-dir", default=None, help="default: ./logs (a temporary folder with --small)")
    args = parser.parse_args()
    log_dir = args.log_dir or (tempfile.mkdtemp(prefix="deepepochs-logs-") if args.small else "./logs")
    n, epochs = (600, 3) if args.small else (4000, 8)

    set_seed(0)
    x, y, _ = make_bars(n, 0)
    test_x, test_y, test_flipped = make_bars(n // 4, 1)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d(4), nn.Flatten(),
                          nn.Linear(128, 2))
    hardest = InterpreteCallback(per_sample_loss, k=8, mode="max", image_data=True, stages="test")
    surest = InterpreteCallback(correct_confidence, k=5, mode="max", stages="test")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with Trainer(model, F.cross_entropy, opt, epochs=epochs, log_batch=False,
                 callbacks=[LogCallback(log_dir), hardest, surest]) as trainer:
        trainer.fit(DataLoader(TensorDataset(x, y), batch_size=32, shuffle=True))
        trainer.test(DataLoader(TensorDataset(test_x, test_y), batch_size=64))

    print("\nhardest test samples (highest loss):")
    for value, pred, label, image in hardest.top_samples():
        i = next(j for j in range(len(test_x)) if torch.equal(test_x[j], image))  # records hold the inputs
        note = "  (label flipped on purpose)" if test_flipped[i] else ""
        print(f"  loss {value:6.3f}  label {label.item()}  predicted {pred.argmax().item()}{note}")
    print("most confident correct predictions:", [f"{r[0]:.4f}" for r in surest.top_samples()])
    print(f"images of the hardest samples: tensorboard --logdir={log_dir} (IMAGES tab, interprete/test)")


if __name__ == "__main__":
    main()
