"""What each rank of ``tests/distributed/test_stalls.py`` runs: a short DDP fit where rank 1 stalls as the
scenario says, each rank writing what it raised to ``$DEEPEPOCHS_TEST_OUT/rank<r>.json``.

Scenarios (``$DEEPEPOCHS_TEST_STALL``): 'train_callback' (rank 1 sleeps in a training batch's callback),
'val_callback' (in a validation batch's callback), 'sigkill' (rank 1 is killed mid-epoch), 'late' (rank 1
sleeps before it builds its Trainer: it never joins in time), 'clean' (nobody stalls: each rank records its
weights and whether its heartbeat thread ran during the fit and is gone after `close`).
"""

import json
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from deepepochs import Callback, Trainer

__all__ = ["OUT_ENV", "SCENARIO_ENV", "SLEEP_S", "TIMEOUT_S", "run_rank", "stalled_fit"]

OUT_ENV = "DEEPEPOCHS_TEST_OUT"
SCENARIO_ENV = "DEEPEPOCHS_TEST_STALL"
TIMEOUT_S = 8
SLEEP_S = TIMEOUT_S + 4  # a sleeping rank wakes after its peer gave up, and meets the end of the job itself


class _Stall(Callback):
    """Rank 1 sleeps (or dies) at training batch 3 or validation batch 2, as the scenario says."""

    def __init__(self, scenario):
        self.scenario = scenario
        self.beating = None  # the heartbeat threads alive at the first epoch's end

    def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
        if dist.get_rank() == 1 and batch_idx == 2:  # 0-based: the third batch
            if self.scenario == "train_callback":
                time.sleep(SLEEP_S)
            elif self.scenario == "sigkill":
                os.kill(os.getpid(), signal.SIGKILL)

    def on_after_train_epoch(self, trainer, task, metrics):
        self.beating = _heartbeats()

    def on_before_val_batch(self, trainer, batch_x, batch_y, batch_idx):
        if dist.get_rank() == 1 and batch_idx == 1 and self.scenario == "val_callback":
            time.sleep(SLEEP_S)


def _heartbeats() -> list:
    return [thread.name for thread in threading.enumerate() if thread.name.startswith("deepepochs-heartbeat")]


def stalled_fit() -> dict:
    """Two epochs of a small fit with validation; rank 1 stalls as `$DEEPEPOCHS_TEST_STALL` says."""
    scenario = os.environ[SCENARIO_ENV]
    if scenario == "late" and os.environ["RANK"] == "1":
        time.sleep(SLEEP_S)
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(6)]
    stall = _Stall(scenario)
    with Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), epochs=2, device="cpu",
                 callbacks=[stall], log_batch=False, show_info=False, dist_timeout=TIMEOUT_S) as trainer:
        trainer.fit(data, data[:4])
    return {"error": None, "beating_in_fit": stall.beating, "beating_after_close": _heartbeats(),
            "weights": {name: value.tolist() for name, value in model.state_dict().items()}}


def run_rank() -> None:
    """Run `stalled_fit` in this (torchrun-style) process and write what it raised, then end at once."""
    start = time.monotonic()
    try:
        out = stalled_fit()
    except Exception as exc:  # noqa: BLE001 (the test reads which error it was)
        ranks = getattr(exc, "ranks", None) or {}
        out = {"error": type(exc).__name__, "message": str(exc), "ranks": {str(r): e for r, e in ranks.items()}}
    out["seconds"] = time.monotonic() - start
    path = Path(os.environ[OUT_ENV]) / f"rank{os.environ['RANK']}.json"
    path.write_text(json.dumps(out))
    os._exit(0)
