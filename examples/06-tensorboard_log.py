"""TensorBoard logging with `LogCallback` (synthetic data, CPU, offline).

One run folder `<log dir>/<running id>` receives, through the trainer's shared writer:
- per-epoch curves `loss/train`, `loss/val`, `accuracy/train`, `accuracy/val` and the learning rate `lr`;
- the model graph (traced from the first training batch);
- the loop's state graph as text (`loop/state_graph`);
- after `test`, `loss/test`, `accuracy/test` and an HParams record of `hyper_params` with those metrics.

Run: `python examples/06-tensorboard_log.py` (or `--small` for a few seconds' run), then
`tensorboard --logdir=./logs`.
"""

import argparse
import tempfile

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import LogCallback, Optimizer, Trainer, set_seed


def make_data(n, seed):
    """Three overlapping Gaussian blobs in 20 dimensions."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    centers = torch.randn(3, 20, generator=torch.Generator().manual_seed(99))
    return TensorDataset(torch.randn(n, 20, generator=g) + 0.4 * centers[y], y)


def accuracy(preds, targets):
    return (preds.argmax(dim=1) == targets).float().mean()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a few seconds' run into a temporary folder")
    parser.add_argument("--log-dir", default=None, help="default: ./logs (a temporary folder with --small)")
    args = parser.parse_args()
    log_dir = args.log_dir or (tempfile.mkdtemp(prefix="deepepochs-logs-") if args.small else "./logs")
    epochs, n = (3, 512) if args.small else (20, 4096)
    hyper_params = {"lr": 0.05, "hidden": 64, "batch_size": 64, "epochs": epochs}

    set_seed(0)
    train_dl = DataLoader(make_data(n, 0), batch_size=hyper_params["batch_size"], shuffle=True)
    val_dl = DataLoader(make_data(n // 4, 1), batch_size=256)
    test_dl = DataLoader(make_data(n // 4, 2), batch_size=256)
    hidden = hyper_params["hidden"]
    model = nn.Sequential(nn.Linear(20, hidden), nn.ReLU(), nn.Linear(hidden, 3))
    opt = torch.optim.SGD(model.parameters(), lr=hyper_params["lr"], momentum=0.9)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)  # a curve worth plotting

    trainer = Trainer(model, F.cross_entropy, Optimizer(opt, sched), epochs=epochs, log_batch=False,
                      callbacks=[LogCallback(log_dir, log_graph=True)], hyper_params=hyper_params)
    try:
        trainer.fit(train_dl, val_dl, metrics=[accuracy])
        results = trainer.test(test_dl, metrics=[accuracy])  # same run folder as the fit
    finally:
        trainer.close()  # flushes the event files and stops the writer thread

    # Read the run back with TensorBoard's own reader: what `tensorboard --logdir` will show.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = f"{log_dir}/{trainer.running_id}"
    events = EventAccumulator(run_dir)
    events.Reload()
    tags = events.Tags()
    print(f"\nrun folder: {run_dir}")
    print("scalars:", ", ".join(sorted(tags["scalars"])))
    texts = ", ".join(t.split("/text_summary")[0] for t in tags["tensors"])
    print(f"graph written: {tags['graph']} | text: {texts}")
    print(f"test accuracy {results['accuracy']:.3f}; view with: tensorboard --logdir={log_dir}")


if __name__ == "__main__":
    main()
