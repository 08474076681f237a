"""Predict and find_lr on CUDA; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

QUIET = dict(log_batch=False, show_info=False, device="cuda")


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 16, generator=g)
    return x, x @ torch.randn(16, 1, generator=g)


def _model():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1)).cuda()


def test_predict_on_cuda_returns_cpu_outputs_by_default_and_cuda_ones_with_device_none():
    """The outputs come back on the CPU (default) or where computed (device=None), equal to a plain
    eval-mode forward."""
    x, y = _data()
    model = _model()
    with Trainer(model, F.mse_loss, epochs=1, **QUIET) as trainer:
        dl = DataLoader(TensorDataset(x, y), batch_size=8)
        on_cpu = trainer.predict(dl)
        on_gpu = trainer.predict(dl, device=None)
    with torch.no_grad():
        reference = model.eval()(x.cuda())
    assert on_cpu.device.type == "cpu" and on_gpu.device.type == "cuda"
    torch.testing.assert_close(on_cpu, reference.cpu())
    torch.testing.assert_close(on_gpu, reference)


def test_find_lr_under_fp16_restores_weights_optimizer_and_grad_scaler():
    """An fp16 sweep (GradScaler skips overflowing updates) leaves weights, Adam state and the scaler's
    state exactly as before."""
    x, y = _data()
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with Trainer(model, F.mse_loss, opt, epochs=1, precision="fp16", **QUIET) as trainer:
        dl = DataLoader(TensorDataset(x, y), batch_size=8)
        trainer.fit(dl)
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        adam = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
        scaler = trainer._precision.state_dict()  # with any deferred scale update applied, as a checkpoint
        result = trainer.find_lr(dl, min_lr=1e-5, max_lr=10.0, num_steps=20, plot=False)
        assert len(result.lrs) >= 3
        assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
        for i, state in opt.state_dict()["state"].items():
            assert all(torch.equal(adam[i][k], v) for k, v in state.items())
        assert trainer._precision.state_dict() == scaler
