"""Exact position, in one process: with data_order='global' the training order of a plain DataLoader is
a function of (seed, epoch) (by default it is the DataLoader's own: tests/test_loader_order.py); a refit
after a fault continues at the last commit point with the same order and the same torch random numbers,
skipping at the sampler (skipped batches are never loaded), in either order; a resumed run keeps the
order's seed. References: the documented permutation computed here, and uninterrupted runs."""

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, RandomSampler

from deepepochs import Callback, CheckCallback, Optimizer, Trainer
from deepepochs.errors import DeepEpochsWarning

N, BATCH = 40, 4


class Indexed(Dataset):
    """Sample i: features whose first entry is i; counts how often each sample is loaded."""

    def __init__(self, n=N):
        g = torch.Generator().manual_seed(11)
        self.x = torch.randn(n, 5, generator=g)
        self.x[:, 0] = torch.arange(n, dtype=torch.float32)
        self.y = torch.randint(0, 3, (n,), generator=g)
        self.loads = 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.loads += 1
        return self.x[i], self.y[i]


class Order(Callback):
    """The sample indices each training batch held, per epoch (epochs as the loop counts them)."""

    def __init__(self):
        self.seen = {}

    def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
        self.seen.setdefault(trainer.loop.epoch, []).extend(int(i) for i in batch_x[:, 0])


def _model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


class FailingLoss:
    """cross_entropy, raising once on call `fail_at` (1-based; None: never): a fault inside a fused
    micro-batch, after its forward drew its dropout mask."""

    def __init__(self, fail_at=None):
        self.fail_at, self.calls = fail_at, 0

    def __call__(self, out, y):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected fault")
        return F.cross_entropy(out, y)


def _trainer(model, loss, callbacks=(), k=3, **kw):
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.9)
    return Trainer(model, loss, Optimizer(opt, sched, sched_on="step"), epochs=3, device="cpu",
                   log_batch=False, show_info=False, callbacks=list(callbacks), gradient_accumulation_steps=k,
                   **kw)


def test_a_shuffled_epochs_global_order_is_the_seeded_permutation_of_seed_and_epoch():
    """shuffle=True in one process with data_order='global': epoch e (1-based) trains on randperm(n,
    Generator().manual_seed(seed + e)) with seed the process's torch.initial_seed() when fit began, whatever
    the global generator does between."""
    order = Order()
    trainer = _trainer(_model(), F.cross_entropy, [order], k=1, data_order="global")
    torch.manual_seed(1234)
    data = DataLoader(Indexed(), batch_size=BATCH, shuffle=True)
    trainer.fit(data, epochs=1)
    torch.rand(1000)  # other random draws between fits do not change the order
    trainer.fit(data, epochs=2)
    trainer.close()
    for epoch in (1, 2):
        expected = torch.randperm(N, generator=torch.Generator().manual_seed(1234 + epoch)).tolist()
        assert order.seen[epoch] == expected


@pytest.mark.parametrize("where", ["dataloader", "sampler"])
def test_a_dataloader_with_its_own_generator_is_ordered_by_that_generators_seed(where):
    """data_order='global': a generator given to the DataLoader, or to its RandomSampler, keeps deciding the
    order (its seed replaces the process's)."""
    order = Order()
    trainer = _trainer(_model(), F.cross_entropy, [order], k=1, data_order="global")
    dataset, generator = Indexed(), torch.Generator().manual_seed(77)
    if where == "dataloader":
        data = DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=generator)
    else:
        data = DataLoader(dataset, batch_size=BATCH, sampler=RandomSampler(dataset, generator=generator))
    trainer.fit(data, epochs=1)
    trainer.close()
    assert order.seen[1] == torch.randperm(N, generator=torch.Generator().manual_seed(77 + 1)).tolist()


def _run(fail_at=None, fuse=True, order=None):
    """Three epochs with shuffle=True, dropout, Adam, a step-wise scheduler and k=3; with `fail_at`, the
    loss raises once and fit is called again. Returns the final weights, optimizer and scheduler state."""
    torch.manual_seed(5)
    model = _model()
    loss = FailingLoss(fail_at)
    callbacks = [] if fuse else [Order()]
    trainer = _trainer(model, loss, callbacks, fuse_steps=fuse, data_order=order)
    data = DataLoader(Indexed(), batch_size=BATCH, shuffle=True)
    if fail_at is None:
        trainer.fit(data)
    else:
        with pytest.raises(RuntimeError, match="injected fault"):
            trainer.fit(data)
        torch.rand(77)  # what the user does before refitting does not matter
        trainer.fit(data)
    state = (copy.deepcopy(model.state_dict()), copy.deepcopy(trainer.opt[0].opt.state_dict()),
             trainer.opt[0].scheduler.state_dict())
    trainer.close()
    return state


@pytest.mark.parametrize("fail_at", [2, 7, 10, 11, 14, 21, 30])
@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("order", ["loader", "global"])
def test_a_refit_after_a_fault_ends_bit_identical_to_the_uninterrupted_run(fail_at, fuse, order):
    """Epochs of 10 batches in windows of 3 (1-3, 4-6, 7-9, 10). Faults at the loss of batch 2 (inside the
    first window), 7 (a window's first batch), 10 (the tail window), 11 and 14 (epoch 2's first batch and
    second window), 21 and 30 (epoch 3): the refit ends with exactly the weights, Adam state and scheduler
    of a run never interrupted, dropout included (fused micro-batches, and every edge), in either order."""
    want = _run(order=order)
    got = _run(fail_at, fuse, order)
    for k, v in want[0].items():
        assert torch.equal(got[0][k], v), k
    assert repr(got[1]) == repr(want[1])
    assert got[2] == want[2]


def test_a_refit_loads_only_the_batches_it_has_not_trained():
    """A fault at batch 8 of an epoch of 10 with k=3: the last commit is after batch 6, so the refit loads
    the 4 batches 7-10 of that epoch (16 samples) and then the third epoch whole: no skipped sample is
    loaded (before, the refit drew a new order and iterated past the first 6 batches)."""
    torch.manual_seed(5)
    dataset = Indexed()
    model = _model()
    trainer = Trainer(model, FailingLoss(fail_at=18), torch.optim.SGD(model.parameters(), lr=0.1), epochs=3,
                      device="cpu", log_batch=False, show_info=False, gradient_accumulation_steps=3)
    data = DataLoader(dataset, batch_size=BATCH, shuffle=True)
    with pytest.raises(RuntimeError):
        trainer.fit(data)
    loaded_before = dataset.loads
    trainer.fit(data)
    trainer.close()
    assert dataset.loads - loaded_before == 4 * BATCH + N


def test_a_resumed_run_in_another_process_seed_keeps_the_training_order(tmp_path):
    """Two epochs with a checkpoint, then a new trainer under another global seed resumes for the third:
    its third epoch's order is the uninterrupted run's (the order's seed travels in the checkpoint)."""
    def run(epochs, seed, resume, folder):
        torch.manual_seed(seed)
        order = Order()
        model = nn.Linear(5, 3)
        checker = CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=tmp_path / folder)
        trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), epochs=epochs,
                          device="cpu", log_batch=False, show_info=False, resume=resume, running_id="run",
                          callbacks=[order, checker])
        trainer.fit(DataLoader(Indexed(), batch_size=BATCH, shuffle=True))
        trainer.close()
        return order.seen

    whole = run(3, seed=21, resume=False, folder="whole")
    run(2, seed=21, resume=False, folder="split")
    resumed = run(3, seed=999, resume=True, folder="split")
    assert list(resumed) == [3]
    assert resumed[3] == whole[3]


class ShuffledOnce(torch.utils.data.Sampler):
    """A user's sampler: a new random order at every iteration (from torch's generator)."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())

    def __len__(self):
        return self.n


@pytest.mark.parametrize("kind", ["sampler", "generator"])
def test_a_refit_mid_epoch_on_data_of_unknown_order_warns_that_samples_may_repeat(kind):
    dataset = Indexed()
    if kind == "sampler":
        data = DataLoader(dataset, batch_size=BATCH, sampler=ShuffledOnce(N))
    else:
        data = _Regenerating(DataLoader(dataset, batch_size=BATCH))
    model = _model()
    trainer = Trainer(model, FailingLoss(fail_at=8), torch.optim.SGD(model.parameters(), lr=0.1), epochs=1,
                      device="cpu", log_batch=False, show_info=False, gradient_accumulation_steps=3)
    with pytest.raises(RuntimeError):
        trainer.fit(data)
    with pytest.warns(DeepEpochsWarning, match=r"resuming inside an epoch: the training data \((DataLoader|"
                                               r"_Regenerating)\) is not a plain DataLoader.*first 6 batches"):
        trainer.fit(data)
    trainer.close()


class _Regenerating:
    """A re-iterable that is no DataLoader (its order is the wrapped loader's)."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        return iter(self.loader)


@pytest.mark.parametrize("kind", ["list", "sequential"])
def test_a_refit_mid_epoch_on_data_of_fixed_order_does_not_warn(kind, recwarn):
    dataset = Indexed()
    data = DataLoader(dataset, batch_size=BATCH)
    if kind == "list":
        data = list(data)
    model = _model()
    trainer = Trainer(model, FailingLoss(fail_at=8), torch.optim.SGD(model.parameters(), lr=0.1), epochs=1,
                      device="cpu", log_batch=False, show_info=False, gradient_accumulation_steps=3)
    with pytest.raises(RuntimeError):
        trainer.fit(data)
    trainer.fit(data)
    trainer.close()
    assert not [w for w in recwarn if issubclass(w.category, DeepEpochsWarning)]
