"""Checkpoints, early stopping and resume with `CheckCallback` (synthetic data, CPU, offline).

1. A job named by `running_id` trains with two monitors: the best validation loss (for evaluation, with
   early stopping) and the latest epoch (for resuming). It is killed half-way (simulated: a callback raises).
2. The requeued job runs the same code (same `running_id`, `resume=True`): it loads that run's latest
   checkpoint, trains only the remaining epochs, and `fit()` returns the whole run's records.
3. `test` evaluates the best epoch's weights, then puts the trained weights back.

Run: `python examples/05-checkpoint_resume.py` (or `--small` for a few seconds' run).
"""

import argparse
import pathlib
import tempfile

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, CheckCallback, Optimizer, Trainer, set_seed


def make_data(n, seed):
    """Two Gaussian blobs in 16 dimensions (a binary classification task)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 16, generator=g) + (y[:, None] * 2 - 1) * 0.15
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=False)


def accuracy(preds, targets):
    return (preds.argmax(dim=1) == targets).float().mean()


class KillAt(Callback):
    """Stands in for a preemption: the job dies when epoch `epoch` (1-based) starts."""

    def __init__(self, epoch):
        self.epoch = epoch

    def on_before_epoch(self, trainer, train_tasks, val_tasks, epoch_idx):
        if epoch_idx + 1 == self.epoch:
            raise RuntimeError(f"job killed at the start of epoch {self.epoch}")


class CountEpochs(Callback):
    def __init__(self):
        self.trained = []

    def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx):
        self.trained.append(epoch_idx + 1)


def make_trainer(ckpt_dir, epochs, extra=()):
    """Model, optimizer + scheduler and the two monitors: what the job script builds on every start."""
    set_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    callbacks = [
        # Best validation loss, early stop after 8 epochs without improvement; test() evaluates this one.
        CheckCallback("loss", on_stage="val", mode="min", patience=8, ckpt_dir=ckpt_dir),
        # The latest epoch, for resuming (metric names are the functions' names).
        CheckCallback("accuracy", on_stage="val", mode="max", save_best=False, ckpt_dir=ckpt_dir),
        *extra,
    ]
    # resume=True with a running_id: that run's newest checkpoint when it has one, else a fresh start. The
    # same command line therefore starts the job and resumes it after a requeue.
    return Trainer(model, F.cross_entropy, Optimizer(opt, sched), epochs=epochs, callbacks=callbacks,
                   metrics=[accuracy], resume=True, running_id="job-42", log_batch=False)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="fewer samples and epochs")
    args = parser.parse_args()
    n, epochs = (256, 4) if args.small else (2048, 12)
    train_dl, val_dl, test_dl = make_data(n, 1), make_data(n // 4, 2), make_data(n // 4, 3)

    with tempfile.TemporaryDirectory() as ckpt_dir:
        # First start: the job is killed when epoch epochs // 2 + 1 starts.
        with make_trainer(ckpt_dir, epochs, extra=[KillAt(epochs // 2 + 1)]) as trainer:
            try:
                trainer.fit(train_dl, val_dl)
            except RuntimeError as e:
                print(f"first start: {e} ({trainer.loop.completed_epochs} epoch(s) completed and saved)")
            run_id = trainer.running_id

        # Second start (the requeued job): the same code; resume=True loads run job-42's latest checkpoint.
        counter = CountEpochs()
        with make_trainer(ckpt_dir, epochs, extra=[counter]) as trainer:
            records = trainer.fit(train_dl, val_dl)
            print(f"resumed run {trainer.running_id} (same as first: {trainer.running_id == run_id});"
                  f" this start trained epochs {counter.trained}; fit() returned the whole run's"
                  f" {len(records['train']['loss'])} epochs; lr now {trainer.opt[0].opt.param_groups[0]['lr']:.4f}")
            weights = trainer.raw_model[0].weight.detach().clone()
            results = trainer.test(test_dl)  # evaluates the best val-loss epoch's weights
            print(f"test on the best epoch's weights: {results}")
            print("trained weights restored after test:", torch.equal(weights, trainer.raw_model[0].weight))

        # The files are plain torch.save dicts.
        for path in sorted(pathlib.Path(ckpt_dir, run_id).glob("*.ckpt")):
            data = torch.load(path, weights_only=True)
            print(f"{path.name}: epoch {data['epoch']}, keys {sorted(data)}")


if __name__ == "__main__":
    main()
