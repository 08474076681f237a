"""Two-process runs of a step carrying a queue of its own shard's outputs across epochs, for
``test_carried_ddp.py``: each rank fits EPOCHS uninterrupted, then (a new trainer) EPOCHS - 1 with
CheckCallback's file at each epoch's end, then a third trainer continues from that file with
``resume=True``; each writes its weights, records and carried queue to ``$DEEPEPOCHS_TEST_OUT/rank<r>.pt``,
rank 0 also the file's ``carried``."""

import os
from pathlib import Path

import torch
from ddp_targets import BATCH, EPOCHS, TRAIN_N, make_data, make_model, make_optimizer, trainer_kwargs
from torch.nn import functional as F
from torch.utils.data import DataLoader

from deepepochs import CheckCallback, TrainerBase, checkpoint

__all__ = ["OUT_ENV", "run"]

OUT_ENV = "DEEPEPOCHS_TEST_OUT"


class Queue(TrainerBase):
    """The targets' logits are shifted by the mean of a queue of this rank's last outputs, never reset."""

    def train_step(self, batch_x, batch_y, **step_args):
        queue = self.carried.get("queue", torch.zeros(6, 3))
        out = self.model(batch_x)
        self.carried["queue"] = torch.cat([out.detach(), queue])[:6]
        self.loss(out + queue.mean(0), batch_y)


def _fit(folder: Path, epochs: int, resume: bool) -> dict:
    model = make_model()
    callbacks = [CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=folder)]
    kwargs = trainer_kwargs(metrics=[], callbacks=callbacks, resume=resume, running_id="run")
    with Queue(model, F.cross_entropy, make_optimizer(model), **kwargs) as trainer:
        records = trainer.fit(DataLoader(make_data(TRAIN_N, 1), batch_size=BATCH), epochs=epochs)
        return {"state": {k: v.detach().clone() for k, v in trainer.raw_model.state_dict().items()},
                "records": records, "queue": trainer.carried["queue"].clone()}


def run() -> int:
    rank, out = int(os.environ["RANK"]), Path(os.environ[OUT_ENV])
    results = {"uninterrupted": _fit(out / "a", EPOCHS, resume=False)}
    _fit(out / "b", EPOCHS - 1, resume=False)
    if rank == 0:
        results["file"] = checkpoint.read_checkpoint(out / "b" / "run" / "train-loss.latest.ckpt").carried
    results["resumed"] = _fit(out / "b", EPOCHS, resume=True)
    torch.save(results, out / f"rank{rank}.pt")
    return rank
