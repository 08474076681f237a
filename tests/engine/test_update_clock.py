"""Training by updates: `Trainer(max_updates=N)` and `fit(val_every_n_updates=M)` over a resampled stream.

Reference: the plain PyTorch loop a user writes for it (karpathy's makemore shape): one iterator over a
DataLoader whose sampler draws with replacement from its own generator, N updates, the validation set
evaluated after every M-th update and after the last; written out here. A refit after a fault anywhere in
the stream (in an update, in a validation point) ends as the uninterrupted run does, bit for bit in fp32.
"""

import numpy as np
import pytest
import torch
from state_compare import plain_val_loss  # the plain loop's evaluation
from test_exact_order import FailingLoss  # cross_entropy raising once, on call `fail_at` (training or not)
from test_loader_order import Noisy as TorchNoisy  # noise drawn from torch's generator when loaded
from test_loader_order import _assert_equal as assert_weights_and_optimizer_equal
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, RandomSampler

from deepepochs import ConfigError, Optimizer, SnapshotCallback, Trainer

N, VAL_N, BATCH, UPDATES, EVERY = 40, 20, 4, 23, 5


class Noisy(TorchNoisy):
    """Sample i plus noise drawn from torch's and (`numpy`) NumPy's global generators when it is loaded."""

    def __init__(self, n, seed, numpy=True):
        super().__init__(n, seed)
        self.numpy = numpy

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        if self.numpy:
            x = x + torch.from_numpy(np.random.uniform(-0.05, 0.05, 6)).float()
        return x, y


def _model():
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


def _loaders(resampled=True, numpy=True):
    """An endless-in-practice stream: a sampler with replacement drawing from its own generator; or
    (`resampled=False`) a shuffled DataLoader of 10 batches, whose epochs the budget runs across."""
    train, val = Noisy(N, 1, numpy), Noisy(VAL_N, 2, numpy)
    g = torch.Generator().manual_seed(17)
    if not resampled:
        return DataLoader(train, batch_size=BATCH, shuffle=True, generator=g), DataLoader(val, batch_size=8)
    sampler = RandomSampler(train, replacement=True, num_samples=10**6, generator=g)
    return DataLoader(train, batch_size=BATCH, sampler=sampler), DataLoader(val, batch_size=8)


def _parts():
    torch.manual_seed(0)
    np.random.seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.8)
    return model, opt, sched


def plain_loop(resampled=True, numpy=True, at_start=False, at_end=True):
    """The user's loop: UPDATES updates, validation after every EVERY-th and after the last (not with
    `at_end=False`), and with `at_start` before the first (nanoGPT's iteration 0); a new iterator (an epoch)
    when one runs out, the training loss recorded per epoch."""
    model, opt, sched = _parts()
    train, val = _loaders(resampled, numpy)
    points, losses, train_losses = [], [], []
    if at_start:  # before the training iterator is made, as fit validates at its first task's start
        points.append(0)
        losses.append(plain_val_loss(model, val))
    batches = iter(train)
    train_sum, train_n = 0.0, 0
    model.train()
    for update in range(1, UPDATES + 1):
        try:
            x, y = next(batches)
        except StopIteration:
            train_losses.append(train_sum / train_n)
            train_sum, train_n = 0.0, 0
            batches = iter(train)
            x, y = next(batches)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        train_sum, train_n = train_sum + float(loss.detach()) * len(y), train_n + len(y)
        if update % EVERY == 0 or (at_end and update == UPDATES):
            points.append(update)
            losses.append(plain_val_loss(model, val))
    train_losses.append(train_sum / train_n)
    records = {"train": {"loss": train_losses}, "val": {"updates": points, "loss": losses}}
    return model.state_dict(), opt.state_dict(), sched.state_dict(), records


def _trainer(loss=F.cross_entropy, updates=UPDATES, **kw):
    model, opt, sched = _parts()
    trainer = Trainer(model, loss, Optimizer(opt, sched, sched_on="step"), max_updates=updates, device="cpu",
                      log_batch=False, show_info=False, **kw)
    return trainer, model, opt, sched


def _assert_equal(got, want):
    """Weights, buffers, optimizer and scheduler states and every record bit for bit."""
    assert_weights_and_optimizer_equal(got[:2], want[:2])
    assert got[2] == want[2]
    assert got[3] == want[3]


@pytest.fixture(scope="module")
def reference():
    return plain_loop()


@pytest.fixture(scope="module")
def epochs_reference():
    return plain_loop(resampled=False)


@pytest.fixture(scope="module")
def torch_only_reference():
    return plain_loop(resampled=False, numpy=False)


def test_max_updates_and_val_every_n_updates_train_exactly_the_plain_update_loop(reference):
    """Dropout, BatchNorm, a with-replacement sampler, noise from torch and NumPy while loading, a step-wise
    scheduler: the weights, optimizer and scheduler states and the records (one validation row per point with
    its update count) equal the plain loop's bit for bit."""
    trainer, model, opt, sched = _trainer()
    records = trainer.fit(*_loaders(), val_every_n_updates=EVERY)
    trainer.close()
    assert trainer.loop.run.updates == UPDATES and trainer.loop.completed_epochs == 1
    _assert_equal((model.state_dict(), opt.state_dict(), sched.state_dict(), records), reference)


def test_the_budget_runs_across_epoch_ends_of_a_finite_loader_as_the_plain_loop_does(epochs_reference):
    """A shuffled DataLoader of 10 batches and a budget of 23 updates: epochs 1 and 2 end on their own, the
    budget ends epoch 3 after 3 updates; validation points fall inside epochs and at the budget."""
    trainer, model, opt, sched = _trainer()
    records = trainer.fit(*_loaders(resampled=False), val_every_n_updates=EVERY)
    trainer.close()
    assert trainer.loop.completed_epochs == 3
    _assert_equal((model.state_dict(), opt.state_dict(), sched.state_dict(), records), epochs_reference)


@pytest.mark.parametrize("fail_at", [3, 7, 9, 36])
def test_a_refit_after_a_fault_mid_stream_ends_bit_identical_to_the_uninterrupted_run(torch_only_reference, fail_at):
    """A fault in an update (calls 3 and 36: epoch 3), inside a validation point (call 7: the point after
    update 5 runs again) or in the update after it (9), then fit again: the same weights, states and records
    as the plain loop. (The stream is a shuffled DataLoader, whose order a refit continues exactly; a
    sampler's own generator is kept across a refit by the exact-resume work, not by the update clock; and
    NumPy's generator is not kept at commit points, so the data draws from torch only.)"""
    trainer, model, opt, sched = _trainer(FailingLoss(fail_at))
    train, val = _loaders(resampled=False, numpy=False)
    with pytest.raises(RuntimeError, match="injected fault"):
        trainer.fit(train, val, val_every_n_updates=EVERY)
    torch.rand(99)  # what the user draws before refitting does not matter
    records = trainer.fit(train, val, val_every_n_updates=EVERY)
    trainer.close()
    _assert_equal((model.state_dict(), opt.state_dict(), sched.state_dict(), records), torch_only_reference)


def test_a_budget_ending_on_an_epochs_last_update_extended_by_a_resume_ends_as_the_plain_loop(epochs_reference,
                                                                                              tmp_path):
    """A budget of 20 updates, the last of epoch 2 (10 batches an epoch), then a new trainer resumed with a
    budget of 23 from its epoch-end snapshot: the generators stand where the plain loop's `next` after the
    last batch left them (RandomSampler draws once more there), so epoch 3 draws the plain loop's order and
    the run ends as the plain loop of 23 updates, bit for bit."""
    def fit(updates, resume):
        trainer, model, opt, sched = _trainer(updates=updates, callbacks=[SnapshotCallback(tmp_path)],
                                              running_id="extended", resume=resume)
        records = trainer.fit(*_loaders(resampled=False), val_every_n_updates=EVERY)
        trainer.close()
        return trainer, (model.state_dict(), opt.state_dict(), sched.state_dict(), records)

    first, _ = fit(20, False)
    assert first.loop.completed_epochs == 2 and first.loop.run.updates == 20
    _, result = fit(UPDATES, True)
    _assert_equal(result, epochs_reference)


def test_a_fit_after_the_budget_is_reached_trains_nothing_more(reference):
    """max_updates is a total, like epochs: a second fit finds the budget reached and returns the records."""
    trainer, model, opt, sched = _trainer()
    train, val = _loaders()
    trainer.fit(train, val, val_every_n_updates=EVERY)
    records = trainer.fit(train, val, val_every_n_updates=EVERY)
    trainer.close()
    assert trainer.loop.run.updates == UPDATES
    _assert_equal((model.state_dict(), opt.state_dict(), sched.state_dict(), records), reference)


@pytest.mark.parametrize("at_start", [False, True])
def test_reduce_lr_on_plateau_steps_at_each_validation_point_with_its_loss_as_in_the_plain_loop(at_start):
    """An epoch-wise ReduceLROnPlateau with the monitored loss steps after each validation point with that
    point's validation loss (the plain loop's `plateau.step(val_loss)`), and not again at the epoch's end;
    the point before the first update (`val_at_start`) evaluates but steps nothing (nothing was trained)."""
    def parts():
        model, opt, _ = _parts()
        return model, opt, torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)

    model, opt, plateau = parts()
    train, val = _loaders()
    if at_start:
        plain_val_loss(model, val)  # its loaders draw; the scheduler does not step
    batches = iter(train)
    model.train()
    for update in range(1, UPDATES + 1):
        x, y = next(batches)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if update % EVERY == 0 or update == UPDATES:
            plateau.step(plain_val_loss(model, val))
    want = (model.state_dict(), opt.state_dict(), plateau.state_dict())

    model, opt, plateau = parts()
    trainer = Trainer(model, F.cross_entropy, Optimizer(opt, plateau, sched_with_loss=True), max_updates=UPDATES,
                      device="cpu", log_batch=False, show_info=False)
    trainer.fit(*_loaders(), val_every_n_updates=EVERY, val_at_start=at_start)
    trainer.close()
    assert plateau.state_dict() == want[2] and opt.param_groups[0]["lr"] < 0.1
    for name, value in want[0].items():
        assert torch.equal(model.state_dict()[name], value), name


@pytest.mark.parametrize("at_start,at_end", [(True, True), (True, False), (False, False)])
def test_validation_before_the_first_update_and_without_the_budgets_point_as_the_plain_loop(at_start, at_end):
    """val_at_start=True validates before any update (a row at update 0, its loaders drawing from torch's and
    NumPy's generators before training does), val_at_end=False leaves out the point at the budget (23, not a
    multiple of 5): the weights, states and records equal the plain loop's with that schedule, bit for bit."""
    trainer, model, opt, sched = _trainer()
    records = trainer.fit(*_loaders(), val_every_n_updates=EVERY, val_at_start=at_start, val_at_end=at_end)
    trainer.close()
    want = plain_loop(at_start=at_start, at_end=at_end)
    assert records["val"]["updates"] == [0] * at_start + [5, 10, 15, 20] + [23] * at_end
    _assert_equal((model.state_dict(), opt.state_dict(), sched.state_dict(), records), want)


@pytest.mark.parametrize("kwargs,match", [
    ({"val_every_n_updates": 5, "val_at_start": 1}, r"fit val_at_start must be True or False \(got 1\)"),
    ({"val_every_n_updates": 5, "val_at_end": None}, r"fit val_at_end must be True or False \(got None\)"),
    ({"val_at_start": True}, r"fit val_at_start=True places the validation points of the update clock, but"
                             r" val_every_n_updates is None .* pass val_every_n_updates=M, or leave"
                             r" val_at_start=False"),
    ({"val_at_end": False}, r"fit val_at_end=False .* leave val_at_end=True"),
])
def test_validation_point_placement_arguments_are_checked(kwargs, match):
    """val_at_start/val_at_end must be bools, and place the points of val_every_n_updates only."""
    trainer, _, _, _ = _trainer()
    with pytest.raises(ConfigError, match=match):
        trainer.fit(*_loaders(), **kwargs)
    trainer.close()
