"""What the checkpoint safety tests share: a CPU trainer whose one monitor keeps the latest checkpoint of
the training loss under `<tmp_path>/ckpt`, and the small regression data it trains on.

Test modules in tests/ import this from their own folder (pytest puts it on `sys.path`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepepochs import CheckCallback, Trainer


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
