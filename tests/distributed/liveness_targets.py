"""Functions that ``tests/distributed/test_liveness.py`` runs in two processes (``launch`` or torchrun).

Spawned children import ``main`` by module and name, so they live here. Each rank writes what it saw to
``$DEEPEPOCHS_TEST_OUT/rank<r>.pt``; the parent compares with a reference it computes itself.
"""

import os
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from deepepochs import Callback, Trainer

__all__ = ["FEATURES", "OUT_ENV", "SHARD_BATCHES", "hang_on_rank_1", "make_batches", "uneven_iterable_shards"]

OUT_ENV = "DEEPEPOCHS_TEST_OUT"
FEATURES = 3
SHARD_BATCHES = (10, 7)  # batches per rank: rank 0 has more than rank 1
TIMEOUT_S = 3


class _SleepOnRank1(Callback):
    """Rank 1 blocks in a callback at its second batch, as a hung rank does."""

    def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
        if dist.get_rank() == 1 and batch_idx == 1:  # 0-based: the second batch
            time.sleep(120)


def hang_on_rank_1() -> None:
    """Rank 1 hangs in a callback; rank 0 waits in the gradient all-reduce until dist_timeout."""
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, 1)
    data = [(torch.randn(4, FEATURES), torch.randn(4, 1)) for _ in range(6)]
    with Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), epochs=1, device="cpu",
                 callbacks=[_SleepOnRank1()], log_batch=False, show_info=False, dist_timeout=TIMEOUT_S) as trainer:
        trainer.fit(data)


def make_batches(rank: int) -> list:
    """Rank `rank`'s shard: `SHARD_BATCHES[rank]` batches, the same on every call."""
    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, FEATURES, generator=generator), torch.randn(4, 1, generator=generator))
            for _ in range(SHARD_BATCHES[rank])]


class _Stream:
    """A re-iterable without a length (a generator each epoch), of a rank's own shard."""

    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        yield from self.batches


class _Count(Callback):
    def __init__(self):
        self.per_epoch = []

    def on_after_train_epochs(self, trainer, tasks, metrics, epoch_idx):
        self.per_epoch.append(trainer.loop.batch_idx)


def uneven_iterable_shards() -> None:
    """Two epochs over length-less shards of 10 and 7 batches: every rank stops at 7."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, 1)
    counter = _Count()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), epochs=2, device="cpu",
                     callbacks=[counter], log_batch=False, show_info=False, dist_timeout=60) as trainer:
            records = trainer.fit(_Stream(make_batches(int(os.environ["RANK"]))))
    torch.save({"weights": {k: v.clone() for k, v in model.state_dict().items()},
                "batches_per_epoch": counter.per_epoch, "loss": records["train"]["loss"],
                "warnings": [str(w.message) for w in caught if "shortest shard" in str(w.message)]},
               Path(os.environ[OUT_ENV]) / f"rank{rank}.pt")
