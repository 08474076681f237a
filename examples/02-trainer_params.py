"""Every parameter of `Trainer`, `fit` and `test`, each with the value used and what it does.

Run: `python examples/02-trainer_params.py` (or `--small` for a few seconds' run).
"""

import argparse

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, EpochTask, Optimizer, Trainer, set_seed
from deepepochs.metrics import accuracy, f1, precision


def make_data(n, seed):
    """Three Gaussian blobs in 16 dimensions."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    centers = torch.randn(3, 16, generator=torch.Generator().manual_seed(7))
    return TensorDataset(torch.randn(n, 16, generator=g) + 0.5 * centers[y], y)


class EpochPrinter(Callback):
    def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx):
        print(f"  [callback] epoch {epoch_idx + 1} done, val metrics: {sorted(val_metrics)}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="fewer samples and epochs")
    args = parser.parse_args()
    n, epochs = (256, 2) if args.small else (2048, 6)
    set_seed(0)
    train_dl = DataLoader(make_data(n, 1), batch_size=32, shuffle=True)
    val_dl = DataLoader(make_data(n // 4, 2), batch_size=64)
    extra_val = EpochTask(DataLoader(make_data(n // 4, 3), batch_size=64), metrics=[f1])
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    trainer = Trainer(
        model,                          # any torch.nn.Module
        F.cross_entropy,                # loss(model_out, batch_y); None: the model returns its own loss
        Optimizer(opt, torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)),  # None means Adam(lr=1e-3)
        epochs=epochs,                  # total epoch target (a resumed or repeated fit continues to it)
        device="cpu",                   # None: CUDA when available, else CPU; MPS only when asked for
        callbacks=[EpochPrinter()],     # Callback objects (hooks run in registration order)
        metrics=[accuracy],             # metrics of every stage: (preds, targets) -> scalar or dict
        metric_patch="tensor",          # dataset-level aggregation: 'tensor', 'mean' or 'confusion'
        resume=False,                   # True / '<running id>': continue from CheckCallback checkpoints
        running_id="params-demo",       # names log and checkpoint folders (default: a timestamp)
        hyper_params={"lr": 0.05},      # logged with the test metrics by LogCallback
        log_long=False,                 # 7 decimals instead of 4
        log_batch=True,                 # batch lines (throttled; one every 10 s in a log file)
        log_tqdm=False,                 # progress bars (only on a terminal)
        show_info=True,                 # the run header (device, running id, parameter count)
        compile_model=False,            # wrap the model in torch.compile (see 19-compile.py)
        precision="fp32",               # 'fp16' / 'bf16': autocast (+ GradScaler for fp16)
        gradient_accumulation_steps=1,  # DataLoader batches per optimizer update
        nonfinite="raise",              # fp32: 'raise' or 'skip' an update with an inf/NaN loss
        split_batches=False,            # under DDP: divide each DataLoader's batch size by world size
        ddp_kwargs=None,                # under DDP: more DistributedDataParallel arguments, e.g.
                                        # {"find_unused_parameters": True}
        fuse_steps=True,                # False: take every machine edge per batch (finer flight record)
    )
    with trainer:  # a trainer is a context manager: close() runs at the end of the block
        records = trainer.fit(
            train_dl,                   # a DataLoader or any iterable of batches
            val_dl,                     # validation data (optional)
            metrics=None,               # extra metrics for both stages of this fit
            val_freq=1,                 # validate every n-th epoch
            do_val_loss=True,           # compute the loss during validation
            batch_size=None,            # callable (batch_x, batch_y) -> sample count, when not inferable
            train_metrics=None,         # metrics for training only
            val_metrics=[precision],    # metrics for validation only
            train_tasks=None,           # EpochTask list instead of train_dl
            val_tasks=[extra_val],      # more validation tasks (combined with val_dl)
            epochs=None,                # override the epoch target for this and later fits
        )
        print("fit returned", {stage: sorted(m) for stage, m in records.items()})
        results = trainer.test(
            val_dl,                     # a DataLoader or iterable (optional when tasks are given)
            metrics=[f1],               # metrics of this test
            do_loss=True,               # compute the loss
            batch_size=None,            # as in fit
            tasks=None,                 # EpochTask list, combined with test_dl
        )
        print("test returned", {k: round(v, 4) for k, v in results.items()})
        print("learning rate after the StepLR schedule:", trainer.opt[0].opt.param_groups[0]["lr"])


if __name__ == "__main__":
    main()
