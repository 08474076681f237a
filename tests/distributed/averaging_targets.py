"""Training functions that ``tests/distributed/test_averaging_ddp.py`` runs in two processes through ``launch``:
an `EMACallback` under DDP. Each rank writes what it observed to ``$DEEPEPOCHS_TEST_OUT/rank<r>.pt``."""

import os
from pathlib import Path

import torch
import torch.distributed as dist
from ddp_targets import BATCH, TRAIN_N, make_data, make_model, make_optimizer, trainer_kwargs
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from deepepochs import Callback, EMACallback, SWACallback, Trainer

__all__ = ["DECAY", "run_scenarios"]

DECAY = 0.8

class _Weights(Callback):
    """The model's weights after each update of this rank (what the average is computed from)."""

    def __init__(self):
        self.seen = []

    def on_after_optimize(self, trainer, optimize_index):
        self.seen.append([p.detach().clone() for p in trainer.raw_model.parameters()])

def _swa() -> dict:
    """An SWA fit of a model with BatchNorm (its statistics differ per rank until the fit's end)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    swa = SWACallback(start_epoch=2, swa_lr=0.05, anneal_epochs=1)
    with Trainer(model, F.cross_entropy, make_optimizer(model), **trainer_kwargs(callbacks=[swa])) as trainer:
        # update_bn reads this DataLoader as given, in an order of its own per rank (its generator's seed)
        generator = torch.Generator().manual_seed(dist.get_rank())
        trainer.fit(DataLoader(make_data(TRAIN_N, 1), batch_size=BATCH, shuffle=True, generator=generator))
        return {"average": {k: v.clone() for k, v in swa.averaged.state_dict().items()}, "updates": swa.updates}


def run_scenarios() -> int:
    """An EMA fit (the average, the weights after each update) and an SWA fit (the average), on this rank."""
    out = Path(os.environ["DEEPEPOCHS_TEST_OUT"])
    rank = int(os.environ["RANK"])
    model = make_model()
    ema, weights = EMACallback(DECAY), _Weights()
    with Trainer(model, F.cross_entropy, make_optimizer(model), **trainer_kwargs(callbacks=[ema, weights])) as trainer:
        trainer.fit(DataLoader(make_data(TRAIN_N, 1), batch_size=BATCH))
        result = {"average": {k: v.clone() for k, v in ema.averaged.state_dict().items()}, "weights": weights.seen,
                  "world_size": dist.get_world_size(), "updates": ema.updates}
    result["swa"] = _swa()
    torch.save(result, out / f"rank{rank}.pt")
    return rank
