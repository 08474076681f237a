"""What each rank of ``tests/distributed/test_desync.py`` runs under ``launch``: a short DDP fit where the ranks'
paths part as the scenario says, each rank writing what it raised to ``$DEEPEPOCHS_TEST_OUT/rank<r>.json``.

Scenarios (``$DEEPEPOCHS_TEST_DESYNC``): 'stop' (rank 1 alone requests a stop at the first epoch's end),
'val_longer' (rank 0 has one validation batch more than rank 1, and a metric that all-reduces per batch).
"""

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from deepepochs import Callback, Trainer

__all__ = ["OUT_ENV", "SCENARIO_ENV", "TIMEOUT_S", "desynced_fit", "synced_mean"]

OUT_ENV = "DEEPEPOCHS_TEST_OUT"
SCENARIO_ENV = "DEEPEPOCHS_TEST_DESYNC"
TIMEOUT_S = 5


class _StopOnRank1(Callback):
    """Rank 1 alone asks for a stop at the first epoch's end, as an early stop on a rank-local value would."""

    def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx):
        if dist.get_rank() == 1 and epoch_idx == 0:
            trainer.request_stop("rank 1's own patience ran out", "test")


def synced_mean(preds, targets):
    """The batch's mean prediction over every rank: a metric that issues a collective per batch."""
    value = preds.detach().float().mean().reshape(1)
    dist.all_reduce(value)
    return value / dist.get_world_size()


def desynced_fit() -> None:
    """Two or three epochs of a small fit with validation, the ranks parting as `$DEEPEPOCHS_TEST_DESYNC` says;
    each rank writes its error (or None), its message, `.ranks` and the seconds its fit took."""
    scenario = os.environ[SCENARIO_ENV]
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(6)]
    val = data[:2]
    callbacks, metrics = [], None
    if scenario == "stop":
        callbacks = [_StopOnRank1()]
    elif scenario == "val_longer":
        val = data[:3] if rank == 0 else data[:2]
        metrics = [synced_mean]
    start = time.monotonic()
    out = {"error": None}
    try:
        with Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), epochs=3, device="cpu",
                     callbacks=callbacks, metrics=metrics, metric_patch="mean", log_batch=False, show_info=False,
                     dist_timeout=TIMEOUT_S) as trainer:
            trainer.fit(data, val)
    except Exception as exc:  # noqa: BLE001 (the test reads which error it was)
        ranks = getattr(exc, "ranks", None) or {}
        out = {"error": type(exc).__name__, "message": str(exc), "ranks": {str(r): e for r, e in ranks.items()},
               "classes": [cls.__name__ for cls in type(exc).__mro__]}
    out["seconds"] = time.monotonic() - start
    (Path(os.environ[OUT_ENV]) / f"rank{rank}.json").write_text(json.dumps(out))
