"""A refit on CUDA replays the CUDA generator exactly (the exact refit, the GPU's generator kept at
commit points as a `Generator.clone_state` copy); skipped without CUDA. Reference: the same run never
interrupted."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Optimizer, Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the CPU twin's fault
from test_exact_order import FailingLoss  # noqa: E402  (a loss raising once, after the forward drew dropout)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _run(fail_at=None, k=2):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 8, generator=g), torch.randint(0, 3, (40,), generator=g)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.4), nn.Linear(32, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
    trainer = Trainer(model, FailingLoss(fail_at), Optimizer(opt, sched, sched_on="step"), epochs=2,
                      device="cuda", log_batch=False, show_info=False, gradient_accumulation_steps=k)
    data = DataLoader(TensorDataset(x, y), batch_size=4)
    if fail_at is None:
        trainer.fit(data)
    else:
        with pytest.raises(RuntimeError, match="injected fault"):
            trainer.fit(data)
        torch.rand(77, device="cuda")  # draws between the fits do not matter
        trainer.fit(data)
    state = copy.deepcopy(trainer.raw_model.state_dict())
    trainer.close()
    return state


@pytest.mark.parametrize("fail_at", [3, 6, 14])
def test_a_refit_on_cuda_with_dropout_ends_bit_identical_to_the_uninterrupted_run(fail_at):
    """Faults inside a window (3), at a window's first batch (6) and in epoch 2 (14): dropout on the GPU
    draws the same masks after the refit as in the run never interrupted."""
    want = _run()
    got = _run(fail_at)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
