"""What the checkpoint safety tests share: a CPU trainer whose one monitor keeps the latest checkpoint of
the training loss under `<tmp_path>/ckpt`, and the small regression data it trains on.

Test modules in tests/ import this from their own folder (pytest puts it on `sys.path`)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from deepepochs import CheckCallback, Trainer, checkpoint


def monitored_trainer(tmp_path, model, opt, **kwargs) -> Trainer:
    """A quiet CPU trainer of `model` (MSE loss, optimizer `opt`, one epoch unless `epochs` is given) with
    one `CheckCallback` saving the latest checkpoint of the training loss under `tmp_path / 'ckpt'`."""
    kwargs.setdefault("epochs", 1)
    return Trainer(model, F.mse_loss, opt, device="cpu", log_batch=False, show_info=False,
                   callbacks=[CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=tmp_path / "ckpt")],
                   **kwargs)


def regression_batches() -> list:
    """Four batches of 8 samples of 4 features, each target the sum of its features (the same every call)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return [(x[i:i + 8], x[i:i + 8].sum(1, keepdim=True)) for i in range(0, 32, 8)]


def save_sharded(trainer, path):
    """Write `trainer`'s state as a sharded checkpoint folder `path`, through the path FSDP ranks take."""
    trainer._dist.shards_model = True  # what FSDP's policy says; one process writes the only shard
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
            checkpoint.save(trainer, path)
    finally:
        del trainer._dist.shards_model  # back to the class's False
    return path
