"""Training functions that ``tests/distributed/test_averaging_fsdp.py`` runs in two processes through ``launch``
with ``Trainer(strategy='fsdp')``: weight averages sharded like the parameters. Each rank writes what it
observed to ``$DEEPEPOCHS_TEST_OUT/rank<r>.pt``; averages are gathered whole with torch's own
``DTensor.full_tensor()``, weights with ``get_model_state_dict(full_state_dict=True)``."""

import os
from pathlib import Path

import ddp_targets as T
import torch
from fsdp_targets import FSDP_KWARGS, val_loader
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.nn import functional as F
from torch.utils.data import DataLoader

from deepepochs import ConfigError, EMACallback, SnapshotCallback, SWACallback, Trainer, consolidate
from deepepochs.checkpoint import save

__all__ = ["DECAY", "SNAPSHOT_RUN_ID", "SWA_START", "run_scenarios"]

DECAY = 0.8
SWA_START = 7  # the 7th committed update: epoch 2's second (5 updates per epoch)
SNAPSHOT_RUN_ID = "fsdp-ema-snapshot"


def _whole(state) -> dict:
    """Every tensor of a state dict whole on this rank (a DTensor's shards all-gathered: a collective)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in state.items()}


def _weights(trainer) -> dict:
    state = get_model_state_dict(trainer.raw_model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in state.items()}


def _trainer(callbacks, **overrides) -> Trainer:
    model = T.make_model()
    kwargs = T.trainer_kwargs(strategy="fsdp", fsdp_kwargs=FSDP_KWARGS, callbacks=callbacks)
    kwargs.update(overrides)
    return Trainer(model, F.cross_entropy, T.make_optimizer(model), **kwargs)


def _train_loader() -> DataLoader:
    return DataLoader(T.make_data(T.TRAIN_N, 1), batch_size=T.BATCH)


def _ema(out: Path) -> dict:
    """An EMA fit; the average's shards and placements; a sharded checkpoint (consolidated on rank 0 into one
    file, then loaded by a fresh 2-process trainer); test() and predict() with the average."""
    ema = EMACallback(DECAY, evaluate=True)
    with _trainer([ema]) as trainer:
        trainer.fit(_train_loader())
        sharded = {k: (type(v).__name__, tuple(v.to_local().shape) if hasattr(v, "to_local") else None)
                   for k, v in ema.averaged.state_dict().items()}
        average, weights = _whole(ema.averaged.state_dict()), _weights(trainer)
        save(trainer, out / "ema.ckpt")
        if trainer.is_main_process:
            consolidate(out / "ema.ckpt", out / "ema-file.ckpt")
        test = trainer.test(val_loader())  # evaluate=True: the average's weights, then the model's back
        after_test = _weights(trainer)
        with ema.applied(trainer):
            predictions = trainer.predict(val_loader())
        after_predict = _weights(trainer)
    loaded = {}
    for name in ("ema.ckpt", "ema-file.ckpt"):  # the sharded folder, and the consolidated single file
        fresh = EMACallback(DECAY)
        with _trainer([fresh]) as trainer:
            trainer.load_checkpoint(out / name)
            loaded[name] = {"average": _whole(fresh.averaged.state_dict()), "updates": fresh.updates}
    return {"average": average, "updates": ema.updates, "weights": weights, "sharded": sharded, "test": test,
            "after_test": after_test, "predictions": predictions, "after_predict": after_predict, "loaded": loaded}


def _fit_failing(trainer, batch: int, message: str) -> str:
    """Fit with a fault raised once on every rank as epoch 2's batch `batch` (1-based) starts its forward;
    returns the error's first line."""

    def probe(dest):
        if dest == "step_forward" and trainer.loop.epoch == 2 and trainer.loop.batch_idx == batch:
            trainer.machine.probe = None
            raise RuntimeError(message)

    trainer.machine.probe = probe
    try:
        trainer.fit(_train_loader())
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    return "no fault"


def _fault_then_refit() -> dict:
    """Both ranks fail inside epoch 2's third batch (its update discarded); the same trainer fits again."""
    ema = EMACallback(DECAY)
    with _trainer([ema], fuse_steps=False) as trainer:
        error = _fit_failing(trainer, 3, "injected fault inside a window")
        at_fault = ema.updates
        trainer.fit(_train_loader())
        return {"error": error, "at_fault": at_fault, "average": _whole(ema.averaged.state_dict()),
                "updates": ema.updates}


def _snapshot_then_resume(out: Path) -> dict:
    """Mid-epoch sharded snapshots every 3 updates; both ranks fail at epoch 2 batch 4; a new 2-process
    Trainer resumes from the snapshot of update 8 to the end."""
    folder = out / "snapshots"
    kwargs = {"running_id": SNAPSHOT_RUN_ID, "fuse_steps": False}
    ema = EMACallback(DECAY)
    with _trainer([ema, SnapshotCallback(folder, every_n_updates=3, on_signals=())], **kwargs) as trainer:
        error = _fit_failing(trainer, 4, "injected fault after a mid-epoch snapshot")
    ema = EMACallback(DECAY)
    with _trainer([ema, SnapshotCallback(folder, every_n_updates=3, on_signals=())], resume=True,
                  **kwargs) as trainer:
        trainer.fit(_train_loader())
        return {"error": error, "average": _whole(ema.averaged.state_dict()), "updates": ema.updates}


def _swa_by_updates() -> dict:
    """SWA from the 7th committed update on, every update averaged, the fit counted by the update clock."""
    swa = SWACallback(start_update=SWA_START, swa_lr=0.05, anneal_epochs=2)
    with _trainer([swa], epochs=None, max_updates=3 * 5) as trainer:
        trainer.fit(_train_loader())
        return {"average": _whole(swa.averaged.state_dict()), "updates": swa.updates}


def _batchnorm_update_refused() -> str:
    """SWACallback's update_bn needs the averaged model's forward, which the sharded average lacks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(T.FEATURES, 8), nn.BatchNorm1d(8), nn.Linear(8, T.CLASSES))
    try:
        Trainer(model, F.cross_entropy, T.make_optimizer(model), **T.trainer_kwargs(
            strategy="fsdp", fsdp_kwargs=FSDP_KWARGS, callbacks=[SWACallback(start_epoch=2)]))
    except ConfigError as e:
        return str(e)
    return "accepted"


def run_scenarios() -> int:
    """Every scenario in one launch (process start-up is most of the cost); results to rank<r>.pt."""
    out = Path(os.environ[T.OUT_ENV])
    rank = int(os.environ["RANK"])
    results = {"ema": _ema(out), "snapshot": _snapshot_then_resume(out), "refit": _fault_then_refit(),
               "swa": _swa_by_updates(),
               "refused": _batchnorm_update_refused()}  # last: the refused Trainer is never closed
    torch.save(results, out / f"rank{rank}.pt")
    return rank
