"""What `test_ddp_eval_buffers.py` runs in two processes through `launch`: a BatchNorm model (with dropout)
fitted under DDP on shuffled data (different batches on each rank), validated after each epoch, then tested
and predicted with; and the plain PyTorch DDP loop a user writes for the same program, which evaluates
through the `DistributedDataParallel` wrapper (so DDP broadcasts rank 0's buffers at the first evaluation
forward). Each rank saves what it saw to `$DEEPEPOCHS_TEST_OUT/rank<r>.pt`.
"""

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

from deepepochs import Callback, Trainer

__all__ = ["OUT_ENV", "VAL_N", "accuracy", "make_model", "run_scenarios", "val_data"]

OUT_ENV = "DEEPEPOCHS_TEST_OUT"
FEATURES, CLASSES = 5, 3
TRAIN_N, BATCH = 32, 4  # per rank: 4 shuffled batches per epoch
VAL_N, VAL_BATCH = 37, 6  # odd: the validation shards hold 19 and 18 samples
EPOCHS, SEED = 2, 7


def make_model() -> nn.Module:
    """Linear, BatchNorm, ReLU, dropout, Linear: the same initial weights in every process."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3),
                         nn.Linear(16, CLASSES))


def _data(n: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, FEATURES, generator=generator) * 2 + 1,
                         torch.randint(0, CLASSES, (n,), generator=generator))


def val_data() -> TensorDataset:
    """The validation (and test, and prediction) samples."""
    return _data(VAL_N, 2)


def _train_loader(rank: int) -> DataLoader:
    """This rank's shuffled training batches: the caller's `DistributedSampler` (its epoch set to the
    1-based epoch before each, as the Trainer does)."""
    data = _data(TRAIN_N, 1)
    return DataLoader(data, batch_size=BATCH, sampler=DistributedSampler(data, 2, rank, shuffle=True, seed=SEED))


def accuracy(preds, targets):
    """Fraction of correct argmax predictions."""
    return (preds.argmax(-1) == targets).float().mean()


def _state(model: nn.Module) -> dict:
    return {key: value.detach().clone() for key, value in model.state_dict().items()}


def _evaluate(ddp, loader) -> dict:
    """A plain DDP evaluation through the wrapper: loss and accuracy summed over the ranks."""
    ddp.eval()
    sums = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for x, y in loader:
            out = ddp(x)
            sums += torch.tensor([float(F.cross_entropy(out, y)) * len(y), float(accuracy(out, y)) * len(y),
                                  len(y)], dtype=torch.float64)
    dist.all_reduce(sums)
    ddp.train()
    return {"loss": float(sums[0] / sums[2]), "accuracy": float(sums[1] / sums[2])}


def _plain(rank: int, ddp_kwargs: dict) -> dict:
    """The user's loop: fit with validation after each epoch, then test, all evaluated through the wrapper
    on this rank's validation shard (samples rank, rank + 2, ...)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ddp = DistributedDataParallel(model, **ddp_kwargs)
    train = _train_loader(rank)
    val = DataLoader(Subset(val_data(), range(rank, VAL_N, 2)), batch_size=VAL_BATCH)
    records = {"loss": [], "accuracy": []}
    for epoch in range(1, EPOCHS + 1):
        train.sampler.set_epoch(epoch)
        ddp.train()
        for x, y in train:
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
        for name, value in _evaluate(ddp, val).items():
            records[name].append(value)
    return {"val": records, "test": _evaluate(ddp, val), "state": _state(model)}


class _FailOnce(Callback):
    """Raises on every rank once at the first validation batch of epoch 1 and once before the first
    training batch of epoch 2 (after that validation's broadcast): two rollbacks."""

    def __init__(self):
        self.left = {"val", "train"}

    def on_after_val_batch(self, trainer, metrics, batch_idx):
        if "val" in self.left:
            self.left.discard("val")
            raise RuntimeError("failed in validation on purpose")

    def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
        if "train" in self.left and trainer.loop.epoch == 2:
            self.left.discard("train")
            raise RuntimeError("failed in epoch 2 on purpose")


def _trainer(rank: int, ddp_kwargs: dict, callbacks=(), evaluate: bool = True, validate: bool = True) -> dict:
    """The Trainer on the same program (`validate=False`: a fit without validation data); after a fault
    (`callbacks`) the fit is called again."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with Trainer(model, F.cross_entropy, opt, epochs=EPOCHS, device="cpu", metrics=[accuracy],
                 log_batch=False, show_info=False, ddp_kwargs=ddp_kwargs, callbacks=list(callbacks)) as trainer:
        train, val = _train_loader(rank), DataLoader(val_data(), batch_size=VAL_BATCH)
        for _ in range(3):
            try:
                records = trainer.fit(train, val if validate else None)
                break
            except RuntimeError:
                continue
        out = {"val": {name: records["val"][name] for name in ("loss", "accuracy") if validate},
               "state": _state(trainer.raw_model)}
        if evaluate:
            broadcast, calls = dist.broadcast, []
            dist.broadcast = lambda *args, **kwargs: calls.append(args[0].dtype) or broadcast(*args, **kwargs)
            try:
                out["test"] = trainer.test(val)
            finally:
                dist.broadcast = broadcast
            out["test_broadcasts"] = calls
            out["predict"] = trainer.predict(val)
        return out


def run_scenarios() -> int:
    """Every scenario in one launch, in one process group the scenarios share."""
    out = Path(os.environ[OUT_ENV])
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method=f"file://{out / 'group-store'}", rank=rank,
                            world_size=int(os.environ["WORLD_SIZE"]))
    try:
        own = {"broadcast_buffers": False}
        results = {"plain": _plain(rank, {}), "trainer": _trainer(rank, {}),
                   "plain_own": _plain(rank, own), "trainer_own": _trainer(rank, own),
                   "rollback": _trainer(rank, {}, [_FailOnce()], evaluate=False),
                   "unvalidated": _trainer(rank, {}, validate=False)}
    finally:
        dist.destroy_process_group()
    torch.save(results, out / f"rank{rank}.pt")
    return rank
