"""Gradient accumulation: windows of k DataLoader batches against plain PyTorch references."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, InvalidTransition, Trainer, TrainerBase

QUIET = dict(log_batch=False, show_info=False, device="cpu")


def make_data(n=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(n, 1, generator=g)
    return x, y


def make_model(seed=1):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def batches_of(dl):
    return [(x.clone(), y.clone()) for x, y in dl]


def reference_windows(model, batches, k, epochs, lr=0.1):
    """Plain PyTorch: one SGD step per window of k consecutive batches, on the concatenated window.

    Returns the per-epoch sample-weighted mean of the batch losses (each computed before its window's step).
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    epoch_losses = []
    for _ in range(epochs):
        loss_sum, count = 0.0, 0
        for start in range(0, len(batches), k):  # windows restart every epoch: never cross its end
            window = batches[start:start + k]
            with torch.no_grad():
                for x, y in window:
                    loss_sum += F.mse_loss(model(x), y).item() * len(x)
                    count += len(x)
            x = torch.cat([b[0] for b in window])
            y = torch.cat([b[1] for b in window])
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        epoch_losses.append(loss_sum / count)
    return epoch_losses


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


class CountUpdates(Callback):
    def __init__(self):
        self.updates = collections.Counter()

    def on_after_optimize(self, trainer, optimize_index):
        self.updates[trainer.loop.epoch] += 1


@pytest.mark.parametrize("k", [1, 2, 3, 4, 7, 10])
@pytest.mark.parametrize("batch_size", [8, 10])
def test_k_step_accumulation_equals_one_step_on_the_concatenated_window(k, batch_size):
    """k micro-batches then one update == one SGD step on their concatenation, tail window and ragged
    last batch included (50 samples: batches of 8 leave a batch of 2; of 10, none)."""
    x, y = make_data()
    dl = DataLoader(TensorDataset(x, y), batch_size=batch_size)
    model, ref = make_model(), make_model()
    counter = CountUpdates()
    trainer = Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), epochs=3,
                      gradient_accumulation_steps=k, callbacks=[counter], **QUIET)
    records = trainer.fit(dl)
    ref_losses = reference_windows(ref, batches_of(dl), k, epochs=3)
    assert max_diff(model, ref) < 1e-5
    assert records["train"]["loss"] == pytest.approx(ref_losses, abs=1e-5)
    n_batches = len(dl)
    assert dict(counter.updates) == {e: -(-n_batches // k) for e in (1, 2, 3)}  # tail window updates too
    assert all(p.grad is None for p in model.parameters())  # nothing leaks out of the fit


@pytest.mark.parametrize("shape", [(), (1,)])
def test_fused_accumulation_equals_one_step_on_the_concatenated_window(shape):
    """The fused window loop (no callback observes it) seeds each micro-batch's backward with its share of
    the window instead of multiplying the loss: the same update as one SGD step on the concatenated window,
    for a scalar loss and a one-element loss of shape (1,), with a tail window and a ragged last batch."""
    x, y = make_data()
    dl = DataLoader(TensorDataset(x, y), batch_size=8)  # 6 batches of 8 and one of 2: windows 3, 3, 1

    def loss_fn(out, target):
        return F.mse_loss(out, target).reshape(shape)

    model, ref = make_model(), make_model()
    trainer = Trainer(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1), epochs=3,
                      gradient_accumulation_steps=3, **QUIET)
    trainer.machine.history = collections.deque()  # keep every transition
    records = trainer.fit(dl)
    assert {"accumulate_step", "update_step"} <= {r.trigger for r in trainer.machine.records()}  # fused
    ref_losses = reference_windows(ref, batches_of(dl), 3, epochs=3)
    assert max_diff(model, ref) < 1e-5
    assert records["train"]["loss"] == pytest.approx(ref_losses, abs=1e-5)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("fuse_steps", [True, False])
def test_windows_never_cross_an_epoch_boundary(fuse_steps):
    """With 7 batches and k=4, each epoch has windows of 4 and 3 batches; the trace shows it (one fused
    edge per micro-batch, or begin_batch ... finish_update)."""
    x, y = make_data()
    dl = DataLoader(TensorDataset(x, y), batch_size=8)
    model = make_model()
    trainer = Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), epochs=2,
                      gradient_accumulation_steps=4, fuse_steps=fuse_steps, **QUIET)
    trainer.machine.history = collections.deque(maxlen=None)
    trainer.fit(dl)
    sizes, current = [], 0
    for rec in trainer.machine.records():
        if rec.trigger == "begin_window":
            current = 0
        elif rec.trigger in ("begin_batch", "accumulate_step", "update_step"):
            current += 1
        if rec.trigger in ("finish_update", "update_step"):
            sizes.append((rec.epoch, current))
    assert sizes == [(1, 4), (1, 3), (2, 4), (2, 3)]


def test_gradients_do_not_leak_into_the_next_epoch():
    """The tail window's gradients are applied and cleared before the next epoch's first backward."""
    x, y = make_data()
    dl = DataLoader(TensorDataset(x, y), batch_size=8)
    model = make_model()
    seen = []

    class GradAtEpochStart(Callback):
        def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
            if batch_idx == 0:  # 0-based: an epoch's first batch
                seen.append([p.grad for p in trainer.raw_model.parameters()])

    Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), epochs=3,
            gradient_accumulation_steps=3, callbacks=[GradAtEpochStart()], **QUIET).fit(dl)
    assert len(seen) == 3 and all(g is None for grads in seen for g in grads)


def test_uneven_batches_are_weighted_by_their_sample_count():
    """Any iterable of batches works; a window of batches of 5, 3 and 8 samples weighs every sample
    equally (not every batch), and a lone tail batch of 1 is a window of its own."""
    x, y = make_data(17)
    sizes = [5, 3, 8, 1]
    bounds = torch.tensor([0, *sizes]).cumsum(0).tolist()
    batches = [(x[a:b], y[a:b]) for a, b in zip(bounds, bounds[1:])]
    model, ref = make_model(), make_model()
    trainer = Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), epochs=2,
                      gradient_accumulation_steps=3, **QUIET)
    records = trainer.fit(batches)
    ref_losses = reference_windows(ref, batches, 3, epochs=2)
    assert max_diff(model, ref) < 1e-5
    assert records["train"]["loss"] == pytest.approx(ref_losses, abs=1e-5)


class SubBatchTrainer(TrainerBase):
    """Splits each DataLoader batch into sub-batches of `sub` samples by hand."""

    sub = 3

    def train_step(self, batch_x, batch_y, **step_args):
        n = len(batch_x)
        chunks = list(zip(batch_x.split(self.sub), batch_y.split(self.sub)))
        for i, (xc, yc) in enumerate(chunks):
            last = i == len(chunks) - 1
            with (self.no_sync() if not last else _nullcontext()):
                self.loss(self.model(xc), yc, loss_adjust=len(xc) / n, do_optimize=False)
        self.optimize()


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("k", [1, 2])
def test_manual_sub_batching_equals_the_plain_full_batch_step(k):
    """self.loss(..., loss_adjust=n_sub/n, do_optimize=False) per sub-batch, then self.optimize(), equals
    a plain step on the whole batch (k=1) or on the whole window (k=2); the reported loss is the batch's."""
    x, y = make_data()
    dl = DataLoader(TensorDataset(x, y), batch_size=8)
    model, ref = make_model(), make_model()
    trainer = SubBatchTrainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), epochs=2,
                              gradient_accumulation_steps=k, **QUIET)
    records = trainer.fit(dl)
    ref_losses = reference_windows(ref, batches_of(dl), k, epochs=2)
    assert max_diff(model, ref) < 1e-5
    assert records["train"]["loss"] == pytest.approx(ref_losses, abs=1e-5)
    assert all(p.grad is None for p in model.parameters())


def test_no_sync_restores_the_windows_sync_choice():
    """Leaving self.no_sync() restores what the machine chose for the micro-batch: no sync on inner
    micro-batches (so a hand-split inner batch never all-reduces), sync on the window's last one."""
    x, y = make_data(24)
    dl = DataLoader(TensorDataset(x, y), batch_size=6)
    model = make_model()
    trainer = SubBatchTrainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), epochs=1,
                              gradient_accumulation_steps=2, **QUIET)
    calls = []
    trainer._dist.set_grad_sync = calls.append
    seen = []

    class SyncAtBackward(Callback):
        def on_before_backward(self, trainer, loss):
            seen.append((trainer.loop.batch_idx, calls[-1]))

    trainer.add_callbacks([SyncAtBackward()])
    trainer.fit(dl)
    # batches 1, 3 are inner micro-batches (never sync); 2, 4 close their windows (only the last
    # sub-batch, outside no_sync, syncs)
    assert seen == [(1, False), (1, False), (2, False), (2, True),
                    (3, False), (3, False), (4, False), (4, True)]


def test_a_step_that_never_calls_optimize_is_an_error_at_the_window_end():
    """loss(do_optimize=False) without self.optimize() leaves gradients unapplied: a clear error."""

    class Forgetful(TrainerBase):
        def train_step(self, batch_x, batch_y, **step_args):
            self.loss(self.model(batch_x), batch_y, do_optimize=False)

    x, y = make_data(16)
    model = make_model()
    trainer = Forgetful(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), epochs=1, **QUIET)
    with pytest.raises(InvalidTransition, match=r"must call self\.optimize\(\)"):
        trainer.fit(DataLoader(TensorDataset(x, y), batch_size=8))
    assert all(p.grad is None for p in model.parameters())
    assert trainer.machine.state == "idle"


@pytest.mark.parametrize("k", [1, 2])
def test_the_fused_backward_follows_the_loss_shape_and_a_tensor_subclass_backward(k):
    """Each backward starts from a cached gradient (engine.steps.backward); a loss that is () on some
    batches and (1,) on others trains exactly as the every-edge path trains it, and a tensor subclass's
    own `backward` still runs."""
    class Loss(torch.Tensor):
        calls = 0

        def backward(self, *args, **kwargs):
            Loss.calls += 1
            return super().backward(*args, **kwargs)

    def run(fuse_steps, subclass):
        x, y = make_data()
        model = make_model()
        batches = iter(range(10**6))

        def loss_fn(out, target):
            loss = F.mse_loss(out, target)
            loss = loss.reshape(1) if next(batches) % 3 == 1 else loss
            return loss.as_subclass(Loss) if subclass else loss

        trainer = Trainer(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1), epochs=2,
                          gradient_accumulation_steps=k, fuse_steps=fuse_steps, **QUIET)
        trainer.fit(DataLoader(TensorDataset(x, y), batch_size=8))
        return model

    fused, plain = run(True, False), run(False, False)
    assert all(torch.equal(p, q) for p, q in zip(fused.parameters(), plain.parameters()))
    Loss.calls = 0
    subclassed = run(True, True)
    assert Loss.calls == 2 * 7  # every micro-batch of both epochs (7 batches each) went through it
    assert all(torch.equal(p, q) for p, q in zip(subclassed.parameters(), plain.parameters()))


def test_the_backward_seed_cache_stays_small_when_batch_sizes_vary():
    """engine.steps.backward keeps one seed per micro-batch share; with shares that never repeat (bucketed
    batch sizes) the cache is bounded, and every backward still equals backpropagating `loss * share`."""
    from types import SimpleNamespace

    from deepepochs.engine.steps import backward

    w = torch.tensor([1.5, -2.0], requires_grad=True)
    ctx, expected = SimpleNamespace(seeds={}), torch.zeros(2)
    for i in range(40):
        share = (i + 1) / 41
        backward(ctx, (w * w).sum() * (i + 2), share)
        expected += 2 * w.detach() * (i + 2) * share
        assert len(ctx.seeds) <= 16
    torch.testing.assert_close(w.grad, expected)


class Unsized:
    """The batches of `dl` as data without a length (re-iterable); `events` notes each fetch."""

    def __init__(self, dl, events=None):
        self.batches, self.events = batches_of(dl), events

    def __iter__(self):
        for i, batch in enumerate(self.batches):
            if self.events is not None:
                self.events.append(("fetch", i))
            yield batch


@pytest.mark.parametrize("fuse_steps", [True, False])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_data_without_a_length_is_fetched_just_before_each_forward_and_its_cut_window_updates(fuse_steps, k):
    """In one process, a micro-batch of data without a length is fetched right before its forward, as in
    `for batch in data: forward, backward; every k: step` (nothing is read ahead); the window the data's
    end cuts short (7 batches: a tail of 7 mod k) updates after its last micro-batch, so the weights equal
    one SGD step per window on its concatenated batches, tail included."""
    x, y = make_data()
    dl = DataLoader(TensorDataset(x, y), batch_size=8)  # 7 batches
    events = []
    model, ref = make_model(), make_model()
    model.register_forward_pre_hook(lambda module, args: events.append(("forward", None)))
    counter = CountUpdates()
    trainer = Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), epochs=2,
                      gradient_accumulation_steps=k, fuse_steps=fuse_steps, callbacks=[counter], **QUIET)
    trainer.machine.history = collections.deque()  # keep every transition
    records = trainer.fit(Unsized(dl, events))
    assert events == [e for _ in range(2) for i in range(7) for e in (("fetch", i), ("forward", None))]
    cut = [r for r in trainer.machine.records() if r.trigger == "optimize" and r.source == "window_open"]
    assert len(cut) == 2 * (7 % k != 0)  # the tail window of each epoch, once its data said it ended
    assert dict(counter.updates) == {1: -(-7 // k), 2: -(-7 // k)}
    ref_losses = reference_windows(ref, batches_of(dl), k, epochs=2)
    assert max_diff(model, ref) < 1e-5
    assert records["train"]["loss"] == pytest.approx(ref_losses, abs=1e-5)
    assert all(p.grad is None for p in model.parameters())
