"""What ``tests/distributed/test_check_resume_ddp.py`` runs in two processes through ``launch``: the run of
tests/check_resume_setup.py (4 samples per rank and batch: 12 updates an epoch), never stopped (keeping the
best file as it stood after update 11: the validation point at 10, inside epoch 1), or resumed from that
file with ``resume=True``. Each rank saves its records and tensors to ``$DEEPEPOCHS_TEST_OUT/<run>-rank<r>.pt``."""

import os
from pathlib import Path

import torch
from check_resume_setup import KeepFile, build, fit, run_state

__all__ = ["OUT_ENV", "RESUME_ENV", "main"]

OUT_ENV = "DEEPEPOCHS_TEST_OUT"
RESUME_ENV = "DEEPEPOCHS_TEST_RESUME"


def main():
    rank = int(os.environ["RANK"])
    out = Path(os.environ[OUT_ENV])
    kept = out / "kept"
    if os.environ.get(RESUME_ENV) == "1":
        name, trainer = "resumed", build(kept, True, resume=True, seed=rank, device="cpu")
    else:
        copy = kept / "run" / "val-loss.ckpt"
        name, trainer = "uninterrupted", build(out / "run", True, lambda c: KeepFile(c, 11, copy), seed=rank,
                                               device="cpu")
    records = fit(trainer, batch_size=4)
    state = {k: v.clone() for k, v in trainer.raw_model.state_dict().items()}
    torch.save({"records": records, "model": state, "state": run_state(trainer)}, out / f"{name}-rank{rank}.pt")
