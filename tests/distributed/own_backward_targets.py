"""Two-process runs of custom steps with their own backward, for ``test_own_backward_ddp.py``: each rank
trains with `loss.backward()` (k=1) and with `self.backward(loss)` (k=2), counts the gradient all-reduces
and writes its weights to ``$DEEPEPOCHS_TEST_OUT/rank<r>.pt``."""

import os
from pathlib import Path

import torch
from ddp_targets import BATCH, TRAIN_N, make_data, make_model, make_optimizer, trainer_kwargs
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn import functional as F
from torch.utils.data import DataLoader

from deepepochs import TrainerBase

__all__ = ["OUT_ENV", "run"]

OUT_ENV = "DEEPEPOCHS_TEST_OUT"


class OwnBackward(TrainerBase):
    """`loss.backward()` (or `self.backward(loss)` when `managed`), then `self.optimize()`."""

    managed = False

    def train_step(self, batch_x, batch_y, **step_args):
        loss = F.cross_entropy(self.model(batch_x), batch_y)
        if self.managed:
            self.backward(loss)
        else:
            loss.backward()
        self.optimize()
        return {"loss": loss.detach()}


def _fit(k: int, managed: bool) -> dict:
    model = make_model()
    kwargs = trainer_kwargs(gradient_accumulation_steps=k, metrics=[])
    with OwnBackward(model, F.cross_entropy, make_optimizer(model), **kwargs) as trainer:
        trainer.managed = managed
        syncs: list = []

        def count(calls, bucket):
            calls.append(bucket.index())
            return default_hooks.allreduce_hook(None, bucket)

        trainer.model.register_comm_hook(syncs, count)
        trainer.fit(DataLoader(make_data(TRAIN_N, 1), batch_size=BATCH))
        return {"state": {k: v.detach().clone() for k, v in trainer.raw_model.state_dict().items()},
                "syncs": len(syncs)}


def run() -> int:
    rank = int(os.environ["RANK"])
    results = {"own": _fit(1, managed=False), "managed": _fit(2, managed=True)}
    torch.save(results, Path(os.environ[OUT_ENV]) / f"rank{rank}.pt")
    return rank
