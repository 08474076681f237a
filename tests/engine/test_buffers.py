"""The model's buffers are run state: a rollback puts BatchNorm's statistics and counters (and any registered
buffer, persistent or not) back as the last commit point left them, so a refit ends with every model tensor,
optimizer and scheduler tensor and record of a run that never saw the discarded window; mid-epoch snapshots,
the learning-rate finder and a rollback outside a fit treat them alike."""

import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

from deepepochs import Callback, Optimizer, SnapshotCallback, Trainer

QUIET = dict(log_batch=False, show_info=False, device="cpu")


class Boom(Exception):
    pass


class Tracked(nn.Module):
    """A module with two buffers of its own: a persistent mean of its inputs and a non-persistent count of
    the samples its training forwards saw (which `state_dict()` leaves out)."""

    def __init__(self, width):
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long), persistent=False)

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
                self.seen += x.shape[0]
        return x


def bn_model(dropout=0.0):
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(3, 8), Tracked(8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(dropout),
                         nn.Linear(8, 1))


def every_tensor(model, opt, sched=None) -> dict:
    """Every model tensor (parameters, buffers persistent or not), optimizer and scheduler value by name."""
    out = {f"param {k}": v for k, v in model.named_parameters()}
    out.update({f"buffer {k}": v for k, v in model.named_buffers()})
    for i, state in opt.state_dict()["state"].items():
        out.update({f"opt {i} {k}": v for k, v in state.items()})
    if sched is not None:
        out.update({f"sched {k}": v for k, v in sched.state_dict().items()})
    return out


def assert_same(actual: dict, expected: dict):
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        got = actual[name]
        if isinstance(value, torch.Tensor):
            assert torch.equal(got, value), f"{name}: {got} != {value}"
        else:
            assert got == value, f"{name}: {got} != {value}"


class RaiseAtCall:
    """A loss that raises once, at its `at`-th call (1-based)."""

    def __init__(self, at):
        self.calls_left = at

    def __call__(self, out, target):
        self.calls_left -= 1
        if self.calls_left != 0:
            return F.mse_loss(out, target)
        raise Boom("the loss failed")


def test_a_refit_after_a_failing_loss_ends_with_the_buffers_of_a_plain_loop_that_never_saw_that_batch():
    """k=1, SGD with momentum and a per-update scheduler, 16 samples in batches of 4, BatchNorm: the loss
    raises once at batch 3; the refit's every tensor equals a plain loop's that ran each batch once."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 3, generator=g), torch.randn(16, 1, generator=g)
    data = DataLoader(TensorDataset(x, y), batch_size=4)

    model = bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    trainer = Trainer(model, RaiseAtCall(3), Optimizer(opt, sched, sched_on="step"), epochs=2, **QUIET)
    with pytest.raises(Boom, match="the loss failed"):
        trainer.fit(data)
    assert int(model[2].num_batches_tracked) == 2  # batch 3's forward is undone, not only its update
    trainer.fit(data)
    trainer.close()

    ref = bn_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, 3, 0.5)
    for _ in range(2):
        for xb, yb in data:
            F.mse_loss(ref(xb), yb).backward()
            ref_opt.step()
            ref_sched.step()
            ref_opt.zero_grad(set_to_none=True)
    assert int(ref[2].num_batches_tracked) == 8 and int(ref[1].seen) == 32
    assert_same(every_tensor(model, opt, sched), every_tensor(ref, ref_opt, ref_sched))


class Noisy(Dataset):
    """Samples with NumPy and Python `random` noise drawn from seeds taken from torch's generator (so the
    draws replay with torch's), raising once at its `fail_at`-th read (1-based; None: never)."""

    def __init__(self, n, fail_at=None):
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)
        self.fail_at, self.reads = fail_at, 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.reads += 1
        if self.reads == self.fail_at:
            raise Boom("the data failed")
        seed = int(torch.randint(0, 2**31 - 1, ()))
        noise = torch.from_numpy(np.random.default_rng(seed).normal(0.0, 0.1, 3).astype(np.float32))
        return self.x[i] + noise * random.Random(seed).random(), self.y[i]


class RaiseAfterBatch(Callback):
    """Raises once after training batch `batch` (1-based) of epoch `epoch`."""

    def __init__(self, epoch, batch):
        self.at = (epoch, batch)

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if self.at == (trainer.loop.epoch, batch_idx + 1):
            self.at = None
            raise Boom("a callback failed")


def fit_random_run(case, fault):
    """One randomized configuration (`case`), trained to its end through at most one fault; returns its
    tensors and records."""
    k, fuse, loss_at, cb_at, data_at = case
    model = bn_model(dropout=0.3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.7)
    train = DataLoader(Noisy(24, fail_at=data_at if fault == "data" else None), batch_size=4, shuffle=True)
    val = DataLoader(TensorDataset(torch.randn(8, 3, generator=torch.Generator().manual_seed(9)),
                                   torch.randn(8, 1, generator=torch.Generator().manual_seed(10))), batch_size=4)
    callbacks = [RaiseAfterBatch(*cb_at)] if fault == "callback" else []
    loss = RaiseAtCall(loss_at) if fault == "loss" else F.mse_loss
    torch.manual_seed(3)
    trainer = Trainer(model, loss, Optimizer(opt, sched, sched_on="step"), epochs=3, callbacks=callbacks,
                      gradient_accumulation_steps=k, fuse_steps=fuse, **QUIET)
    for _ in range(2):
        try:
            trainer.fit(train, val)
            break
        except Boom:
            pass
    else:
        trainer.fit(train, val)
    trainer.close()
    return every_tensor(model, opt, sched), trainer.history


def random_cases(count, seed=36):
    draw = random.Random(seed)
    return [(draw.choice([1, 2, 3]), draw.choice([True, False]), draw.randint(2, 17),
             (draw.randint(1, 3), draw.randint(1, 6)), draw.randint(2, 70)) for _ in range(count)]


@pytest.mark.parametrize("fault", ["loss", "callback", "data"])
@pytest.mark.parametrize("case", random_cases(3), ids=lambda c: f"k{c[0]}-fuse{c[1]}")
def test_a_refit_after_a_fault_anywhere_ends_with_every_tensor_and_record_of_the_uninterrupted_run(case, fault):
    """Randomized: dropout, shuffling, BatchNorm, a persistent and a non-persistent buffer, NumPy and Python
    draws in the data, accumulation over 1-3 batches, a validation stage reading the running statistics; a
    fault in the loss, a callback or the next batch's data, then a refit."""
    tensors, history = fit_random_run(case, fault)
    expected_tensors, expected_history = fit_random_run(case, None)
    assert_same(tensors, expected_tensors)
    assert history == expected_history


def test_a_resumed_snapshot_restores_every_buffer_a_non_persistent_one_included(tmp_path):
    """A run stopped after a mid-epoch snapshot, resumed by a new trainer, ends with the uninterrupted run's
    buffers: the non-persistent count (not in `state_dict()`) comes from the snapshot's run state."""
    def make(callbacks=(), resume=False):
        model = bn_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        cbs = [SnapshotCallback(tmp_path, every_n_updates=3), *callbacks]
        torch.manual_seed(4)
        return Trainer(model, F.mse_loss, opt, epochs=2, callbacks=cbs, resume=resume, running_id="run",
                       **QUIET), model, opt

    data = DataLoader(Noisy(24), batch_size=4, shuffle=True)
    first, _, _ = make([RaiseAfterBatch(2, 5)])
    with pytest.raises(Boom):
        first.fit(data)
    first.close()
    resumed, model, opt = make(resume=True)
    resumed.fit(data)
    resumed.close()
    reference, ref, ref_opt = make()
    reference.fit(data)
    reference.close()
    assert int(model[1].seen) == int(ref[1].seen) == 48
    assert_same(every_tensor(model, opt), every_tensor(ref, ref_opt))


def test_find_lr_leaves_every_buffer_as_it_was():
    """The learning-rate sweep trains (BatchNorm and the module's counts move), then puts every buffer back,
    non-persistent ones included."""
    model = bn_model()
    trainer = Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.01), **QUIET)
    data = DataLoader(Noisy(24), batch_size=4)
    before = {k: v.clone() for k, v in model.named_buffers()}
    trainer.find_lr(data, num_steps=5, plot=False)
    trainer.close()
    assert_same(dict(model.named_buffers()), before)


def test_a_rollback_of_a_test_after_a_fit_keeps_buffers_set_since():
    """Outside a fit nothing is kept: a failing test after the user changed the statistics leaves them."""
    model = bn_model()
    trainer = Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.01), **QUIET)
    data = DataLoader(Noisy(8), batch_size=4)
    trainer.fit(data)
    with torch.no_grad():
        model[2].running_mean.fill_(5.0)
    trainer.loss_fn = RaiseAtCall(1)
    with pytest.raises(Boom):
        trainer.test(data)
    trainer.close()
    assert torch.equal(model[2].running_mean, torch.full((8,), 5.0))
