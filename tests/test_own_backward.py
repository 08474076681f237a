"""A custom training step that backpropagates its loss itself (`loss.backward()`, or `self.backward(loss)`)
and then calls `self.optimize(i)`: one and two optimizers, accumulation, bf16/fp16, rollback and resume.
References: the plain PyTorch loop written out here, and the uninterrupted run. The spec edge it takes
(`optimize` from `step_forward`, guarded by `grads_present`) is checked against the spec's trace."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_loader_order import Noisy as TorchNoisy  # noise drawn from torch's generator when loaded
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from deepepochs import Callback, ConfigError, SnapshotCallback, TrainerBase
from deepepochs.errors import DeepEpochsWarning, InvalidTransition

N, BATCH, EPOCHS = 48, 4, 2  # 12 batches per epoch
QUIET = dict(log_batch=False, show_info=False, device="cpu")


class Noisy(TorchNoisy):
    """test_loader_order's samples (noise from torch's generator when loaded), plus draws from NumPy's and
    `random`'s generators."""

    def __init__(self, n=N, seed=1, host_draws=True):
        super().__init__(n, seed)
        self.host_draws = host_draws  # a refit puts back torch's generators only (docs: exact resume)

    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        if self.host_draws:
            x = x + float(np.random.rand()) * 0.01 + random.random() * 0.01
        return x, y


def seed_all(seed=0):
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def make_model():
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


def make_opts(model, two):
    if not two:
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return [torch.optim.SGD(list(model[0].parameters()) + list(model[1].parameters()), lr=0.1, momentum=0.9),
            torch.optim.Adam(model[4].parameters(), lr=0.01)]


def loader(host_draws=True):
    return DataLoader(Noisy(host_draws=host_draws), batch_size=BATCH, shuffle=True)


class OwnBackward(TrainerBase):
    """`loss.backward()` then `self.optimize()`; under accumulation the loss is divided by k by hand, as in a
    plain loop. With two optimizers (a GAN's shape): a loss for each, each followed by its optimizer's update;
    the second forward sees the first update, and each update zeroes only its optimizer's gradients."""

    def train_step(self, batch_x, batch_y, **step_args):
        k = self.config.gradient_accumulation_steps
        out = self.model(batch_x)
        loss = F.cross_entropy(out, batch_y)
        if len(self.opt) == 1:
            (loss / k).backward()
            self.optimize()
            return {"loss": loss.detach()}
        (loss / k).backward()
        self.optimize(0)
        second = F.cross_entropy(self.model(batch_x), batch_y, label_smoothing=0.1)  # after update 0
        (second / k).backward()
        self.optimize(1)
        return {"loss": loss.detach()}


def plain_loop(two=False, k=1, epochs=EPOCHS, host_draws=True):
    """The same training by hand: the last window of an epoch steps with what it accumulated."""
    seed_all()
    model = make_model()
    opts = make_opts(model, two)
    opts = opts if two else [opts]
    dl = loader(host_draws)
    for _ in range(epochs):
        model.train()
        for b, (x, y) in enumerate(dl):
            boundary = (b + 1) % k == 0 or b == len(dl) - 1
            out = model(x)
            loss = F.cross_entropy(out, y)
            (loss / k).backward()
            if boundary:
                opts[0].step()
                opts[0].zero_grad()
            if two:
                (F.cross_entropy(model(x), y, label_smoothing=0.1) / k).backward()
                if boundary:
                    opts[1].step()
                    opts[1].zero_grad()
    return model, opts


def trainer_of(cls=OwnBackward, two=False, epochs=EPOCHS, **kw):
    seed_all()
    model = make_model()
    opts = make_opts(model, two)
    return cls(model, F.cross_entropy, opts, epochs=epochs, **QUIET, **kw), model, opts


def assert_same(model, opts, ref_model, ref_opts):
    """Weights, buffers and every optimizer state tensor bit for bit."""
    for (name, value), want in zip(model.state_dict().items(), ref_model.state_dict().values()):
        assert torch.equal(value, want), name
    opts = opts if isinstance(opts, list) else [opts]
    for opt, ref in zip(opts, ref_opts):
        got, exp = opt.state_dict()["state"], ref.state_dict()["state"]
        assert got.keys() == exp.keys()
        for index, state in exp.items():
            for key, value in state.items():
                assert torch.equal(torch.as_tensor(got[index][key]), torch.as_tensor(value)), (index, key)


@pytest.mark.parametrize("two", [False, True], ids=["one-optimizer", "two-optimizers"])
@pytest.mark.parametrize("k", [1, 5])
def test_a_step_with_its_own_backward_trains_bit_identical_to_the_plain_loop(two, k):
    """loss.backward() then self.optimize(i), with one or two optimizers, k=1 or k=5 (12 batches: windows of 5,
    5 and a short one of 2, whose gradients are taken as the step made them): bit for bit in fp32."""
    trainer, model, opts = trainer_of(two=two, gradient_accumulation_steps=k)
    records = trainer.fit(loader())
    trainer.close()
    ref_model, ref_opts = plain_loop(two, k)
    assert_same(model, opts, ref_model, ref_opts)
    assert len(records["train"]["loss"]) == EPOCHS


class ManagedBackward(TrainerBase):
    """`self.backward(loss)` then `self.optimize()`: the loss weighed per micro-batch as self.loss does."""

    def train_step(self, batch_x, batch_y, **step_args):
        loss = F.cross_entropy(self.model(batch_x), batch_y)
        self.backward(loss)
        self.optimize()
        return {"loss": loss.detach()}


@pytest.mark.parametrize("k", [1, 2, 3])
def test_self_backward_weighs_each_micro_batch_as_the_plain_loop_dividing_by_k(k):
    """self.backward(loss) under accumulation of k equal batches (12 batches: no short window) equals the plain
    loop's (loss / k).backward(), bit for bit in fp32."""
    trainer, model, opts = trainer_of(ManagedBackward, gradient_accumulation_steps=k)
    trainer.fit(loader())
    ref_model, ref_opts = plain_loop(False, k)
    assert_same(model, opts, ref_model, ref_opts)


def _bf16_plain_loop():
    seed_all()
    model = make_model()
    opt = make_opts(model, False)
    dl = loader()
    for _ in range(EPOCHS):
        for x, y in dl:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return model, [opt]


def test_own_backward_under_bf16_equals_the_plain_autocast_loop():
    """precision='bf16': the step's forward runs under the trainer's autocast and its own backward outside the
    loss scaling (there is none): equal to a plain bf16 autocast loop, bit for bit."""
    trainer, model, opts = trainer_of(precision="bf16")
    trainer.fit(loader())
    assert_same(model, opts, *_bf16_plain_loop())


def _fp16_plain_loop():
    """torch's recipe: autocast to float16, GradScaler.scale(loss).backward(), scaler.step(opt), update."""
    seed_all()
    model = make_model()
    opt = make_opts(model, False)
    scaler = torch.amp.GradScaler("cpu")
    dl = loader()
    for _ in range(EPOCHS):
        for x, y in dl:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return model, [opt], scaler


def test_own_backward_under_fp16_is_refused_naming_self_backward_and_self_backward_equals_the_scaler_loop():
    """precision='fp16': loss.backward() leaves the loss unscaled, so self.optimize() refuses it at the first
    batch naming self.backward(loss), before any weight changed; self.backward(loss) applies the GradScaler's
    scale and trains as torch's GradScaler loop does (weights, optimizer state and the scale)."""
    trainer, model, _ = trainer_of(precision="fp16")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(InvalidTransition, match=r"self\.backward\(loss\), not loss\.backward\(\)"):
        trainer.fit(loader())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    trainer, model, opts = trainer_of(ManagedBackward, precision="fp16")
    trainer.fit(loader())
    ref_model, ref_opts, scaler = _fp16_plain_loop()
    assert_same(model, opts, ref_model, ref_opts)
    assert trainer.scaler.get_scale() == scaler.get_scale()


class NoBackward(TrainerBase):
    def train_step(self, batch_x, batch_y, **step_args):
        self.model(batch_x)
        self.optimize()


class LightningStyle(TrainerBase):
    """Lightning's manual optimisation: its own backward, then the optimizer stepped directly."""

    def train_step(self, batch_x, batch_y, **step_args):
        F.cross_entropy(self.model(batch_x), batch_y).backward()
        self.opt[0].opt.step()


def test_optimize_without_a_backward_names_the_ways_to_backpropagate():
    """self.optimize() with no gradient at all fails at the first batch, naming self.loss, self.backward,
    loss.backward() and closures, and the model is untouched."""
    trainer, model, _ = trainer_of(NoBackward)
    with pytest.raises(InvalidTransition, match=r"found no gradients to apply: backpropagate a loss first \(self"):
        trainer.fit(loader())


def test_stepping_an_optimizer_directly_in_a_step_is_refused_before_it_changes_anything():
    """A Lightning-style `opt.step()` inside a step raises a ConfigError naming self.optimize(0), the
    Lightning translation and closures, before the optimizer changed a weight."""
    trainer, model, opt = trainer_of(LightningStyle)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ConfigError, match=r"optimizer 0 \(SGD\) was stepped directly.*self\.optimize\(0\).*"
                                          r"self\.backward\(loss\); self\.optimize\(0\)"):
        trainer.fit(loader())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    opt.step()  # outside a fit the optimizer is the user's own


class FailingOnce(OwnBackward):
    """Raises once, after its own backward of the given (epoch, batch), before the update."""

    fail_at: tuple | None = None

    def train_step(self, batch_x, batch_y, **step_args):
        if (self.loop.epoch, self.loop.batch_idx) == self.fail_at:
            self.fail_at = None
            F.cross_entropy(self.model(batch_x), batch_y).backward()
            raise RuntimeError("boom after backward")
        return super().train_step(batch_x, batch_y, **step_args)


@pytest.mark.parametrize("two", [False, True], ids=["one-optimizer", "two-optimizers"])
def test_a_refit_after_an_error_after_the_own_backward_equals_the_uninterrupted_run(two):
    """An exception after the step's own backward (epoch 2, batch 7; k=2) rolls back to the last update; the
    next fit ends as the plain loop does, bit for bit."""
    trainer, model, opts = trainer_of(FailingOnce, two=two, gradient_accumulation_steps=2)
    trainer.fail_at = (2, 7)
    dl = loader(host_draws=False)
    with pytest.raises(RuntimeError, match="boom after backward"):
        trainer.fit(dl)
    trainer.fit(dl)
    assert_same(model, opts, *plain_loop(two, 2, host_draws=False))


def test_a_resume_from_a_mid_epoch_snapshot_equals_the_uninterrupted_run(tmp_path):
    """Snapshots every 2 updates; the run fails in epoch 2; a new trainer with resume=True continues from the
    last snapshot and ends bit-identical to the plain loop (two optimizers, k=2)."""
    snap = dict(ckpt_dir=tmp_path, every_n_updates=2, on_signals=())
    trainer, _, _ = trainer_of(FailingOnce, two=True, gradient_accumulation_steps=2, running_id="run",
                               callbacks=[SnapshotCallback(**snap)])
    trainer.fail_at = (2, 8)
    with pytest.raises(RuntimeError, match="boom after backward"):
        trainer.fit(loader())
    trainer.close()
    assert sorted(p.name for p in (tmp_path / "run").glob("snapshot-u*"))[-1].startswith("snapshot-u000000008")
    resumed, model, opts = trainer_of(two=True, gradient_accumulation_steps=2, running_id="run", resume=True,
                                      callbacks=[SnapshotCallback(**snap)])
    resumed.fit(loader())
    resumed.close()
    assert_same(model, opts, *plain_loop(True, 2))


def test_the_own_backward_takes_the_spec_edge_from_step_forward():
    """The recorded path of a window of two batches: begin_batch, then optimize straight from step_forward
    (no backward trigger), through the update, as the spec's grads_present edges say."""
    trainer, _, _ = trainer_of(gradient_accumulation_steps=2, epochs=1)
    trainer.fit(loader())
    records = [(r.source, r.trigger, r.dest) for r in trainer.machine.records()]
    window = records.index(("task_train", "begin_window", "window_open"))
    assert records[window:window + 10] == [
        ("task_train", "begin_window", "window_open"),
        ("window_open", "begin_batch", "step_forward"),
        ("step_forward", "optimize", "step_backward"),
        ("step_backward", "end_batch", "window_open"),
        ("window_open", "begin_batch", "step_forward"),
        ("step_forward", "optimize", "optimize_unscaled"),
        ("optimize_unscaled", "clip", "optimize_clipped"),
        ("optimize_clipped", "apply_update", "optimize_clipped"),
        ("optimize_clipped", "finish_update", "step_optimized"),
        ("step_optimized", "end_batch", "task_train"),
    ]


class FailAfterUpdate(Callback):
    """Raises once, in `on_after_optimize` of the `at`-th update: the update is applied, the step never returns."""

    def __init__(self, at: int):
        self.at, self.count = at, 0

    def on_after_optimize(self, trainer, optimize_index):
        self.count += 1
        if self.count == self.at:
            raise RuntimeError("boom after the update")


@pytest.mark.parametrize("k", [1, 2])
def test_a_refit_after_a_fault_after_the_update_counts_the_returned_loss_of_a_self_backward_step_once(k):
    """`self.backward(loss)`, `self.optimize()`, `return {'loss': loss.detach()}`; an exception in
    on_after_optimize (epoch 2), then `fit()` again: the weights, optimizer and every record (the epochs'
    training losses) equal the uninterrupted run's."""
    reference, ref_model, ref_opts = trainer_of(ManagedBackward, gradient_accumulation_steps=k)
    want = reference.fit(loader(host_draws=False))
    trainer, model, opts = trainer_of(ManagedBackward, gradient_accumulation_steps=k,
                                      callbacks=[FailAfterUpdate(17 // k)])
    dl = loader(host_draws=False)
    with pytest.raises(RuntimeError, match="boom after the update"):
        trainer.fit(dl)
    assert trainer.fit(dl) == want
    assert_same(model, opts, ref_model, [ref_opts])


def test_a_refit_after_a_fault_after_the_own_backward_update_says_the_batch_is_left_out_of_the_records():
    """A step running its own `loss.backward()`: the trainer never saw the loss the step would have returned,
    so after a fault after its update the refit warns that the epoch's records leave the batch out, naming
    self.backward and self.loss; the weights still equal the uninterrupted run's."""
    trainer, model, opts = trainer_of(callbacks=[FailAfterUpdate(17)])
    dl = loader(host_draws=False)
    with pytest.raises(RuntimeError, match="boom after the update"), \
            pytest.warns(DeepEpochsWarning, match=r"epoch 2, batch 5 .*self\.backward\(loss\).*self\.loss"):
        trainer.fit(dl)
    trainer.fit(dl)
    assert_same(model, opts, *plain_loop(False, 1, host_draws=False))
