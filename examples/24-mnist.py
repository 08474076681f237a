"""MNIST digits with a small convolutional network (needs torchvision: `pip install torchvision`).

The data is downloaded to `--data` on first use. Without torchvision, or when the download is not
possible (offline), the script says so and exits 0. With `--small` it never downloads: it uses MNIST
when it is already in `--data`, and otherwise synthetic 28x28 "digits" (a fixed random template per
class plus noise), so the smoke test runs offline; `--synthetic` always uses the synthetic digits.

Run: `python examples/24-mnist.py [--data ./data]` (or `--small` for a short run on a subset).
"""

import argparse
import sys

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset

from deepepochs import Trainer, set_seed
from deepepochs.metrics import accuracy, f1


def mnist(root, download):
    """(train, test) datasets, or (None, reason) when MNIST cannot be had here."""
    try:
        from torchvision import datasets, transforms
    except ImportError:
        return None, "torchvision is not installed (pip install torchvision)"
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    try:
        return (datasets.MNIST(root, train=True, download=download, transform=tf),
                datasets.MNIST(root, train=False, download=download, transform=tf)), None
    except Exception as e:  # no network, a proxy, a broken mirror: report instead of crashing
        action = "downloaded to" if download else "found in"
        return None, f"MNIST could not be {action} {root!r} ({type(e).__name__}: {e})"


def synthetic(n_train, n_test):
    g = torch.Generator().manual_seed(0)
    templates = (torch.rand(10, 1, 28, 28, generator=g) > 0.7).float() * 2 - 0.5

    def sample(n):
        y = torch.randint(0, 10, (n,), generator=g)
        return TensorDataset(templates[y] + 2.0 * torch.randn(n, 1, 28, 28, generator=g), y)

    return sample(n_train), sample(n_test)


def convnet():
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # 16 x 14 x 14
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 32 x 7 x 7
        nn.Flatten(), nn.Dropout(0.25), nn.Linear(32 * 7 * 7, 10),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a subset and one epoch (synthetic fallback)")
    parser.add_argument("--synthetic", action="store_true", help="use synthetic digits, no download")
    parser.add_argument("--data", default="./data", help="where MNIST is (or is downloaded to)")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    set_seed(0)
    datasets, reason = (None, "--synthetic given") if args.synthetic else mnist(args.data, not args.small)
    if datasets is None:
        print(f"MNIST unavailable: {reason}.")
        if not (args.small or args.synthetic):
            print("Nothing to train; rerun with --synthetic (or --small) to use synthetic 28x28 digits.")
            return 0
        print("Training on synthetic 28x28 digits instead.")
        datasets = synthetic(2048, 512) if args.small else synthetic(20000, 4000)
    train_set, test_set = datasets
    epochs = 1 if args.small else args.epochs
    if args.small:
        train_set = Subset(train_set, range(min(len(train_set), 2048)))
        test_set = Subset(test_set, range(min(len(test_set), 512)))
    train_dl = DataLoader(train_set, batch_size=64, shuffle=True)
    test_dl = DataLoader(test_set, batch_size=256)
    model = convnet()
    with Trainer(model, F.cross_entropy, torch.optim.Adam(model.parameters(), lr=1e-3), epochs=epochs,
                 metrics=[accuracy, f1], metric_patch="confusion") as trainer:
        trainer.fit(train_dl, test_dl)
        results = trainer.test(test_dl)
    print(f"test accuracy {results['accuracy']:.4f}, macro F1 {results['f1']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
