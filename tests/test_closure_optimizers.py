"""Optimizers whose `step` takes a closure (LBFGS) from a custom step: `self.optimize(closure=closure)`.
References: the plain loop of pytorch/examples' time_sequence_prediction (`opt.step(closure)` per batch),
written out here, and the uninterrupted run: every closure loss and the weights bit for bit, checkpoints
and snapshots that load and resume exactly, and every step counted as an update."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import CheckCallback, Optimizer, SnapshotCallback, TrainerBase
from deepepochs.checkpoint import save
from deepepochs.errors import CheckpointError, InvalidTransition

QUIET = dict(log_batch=False, show_info=False, device="cpu")
EPOCHS = 3


class Sequence(nn.Module):
    """time_sequence_prediction's model, smaller: two LSTM cells and a linear read-out, with dropout."""

    def __init__(self, hidden=8):
        super().__init__()
        self.hidden = hidden
        self.lstm1, self.lstm2 = nn.LSTMCell(1, hidden), nn.LSTMCell(hidden, hidden)
        self.drop = nn.Dropout(0.1)
        self.linear = nn.Linear(hidden, 1)

    def forward(self, x):
        h1 = c1 = h2 = c2 = torch.zeros(x.size(0), self.hidden)
        outputs = []
        for t in range(x.size(1)):
            h1, c1 = self.lstm1(x[:, t:t + 1], (h1, c1))
            h2, c2 = self.lstm2(self.drop(h1), (h2, c2))
            outputs.append(self.linear(h2))
        return torch.cat(outputs, dim=1)


def sine_waves(n=8, length=10, seed=2):
    """Shifted sine waves: inputs are the first `length` points, targets the next ones."""
    g = torch.Generator().manual_seed(seed)
    shift = torch.randint(-20, 20, (n, 1), generator=g).float()
    wave = torch.sin((torch.arange(length + 1).float() + shift) / 4.0)
    return TensorDataset(wave[:, :-1], wave[:, 1:])


def loader():
    return DataLoader(sine_waves(), batch_size=4, shuffle=True)


def make(seed=0):
    torch.manual_seed(seed)
    model = Sequence()
    return model, torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3, history_size=2)


class ClosureStep(TrainerBase):
    """The example's step: a closure that zeroes the gradients, runs the model, backpropagates and returns
    the loss, handed to the update; every loss the closure computes is kept."""

    losses: list

    def train_step(self, batch_x, batch_y, **step_args):
        def closure():
            self.zero_grad()
            loss = F.mse_loss(self.model(batch_x), batch_y)
            self.losses.append(loss.item())
            loss.backward()
            return loss

        self.optimize(closure=closure)


def trainer_of(epochs=EPOCHS, opt_wrap=None, **kw):
    model, opt = make()
    trainer = ClosureStep(model, F.mse_loss, opt if opt_wrap is None else opt_wrap(opt), epochs=epochs, **QUIET, **kw)
    trainer.losses = []
    return trainer, model, opt


@functools.cache
def plain_loop(epochs=EPOCHS):
    """The plain loop (computed once: the tests only read what it returns)."""
    model, opt = make()
    losses = []
    dl = loader()
    for _ in range(epochs):
        for x, y in dl:
            def closure(x=x, y=y):
                opt.zero_grad()
                loss = F.mse_loss(model(x), y)
                losses.append(loss.item())
                loss.backward()
                return loss

            opt.step(closure)
    return model, opt, losses


def assert_same(model, opt, ref_model, ref_opt):
    """The weights and LBFGS's whole state (counts, vectors, history lists) bit for bit."""
    for (name, value), want in zip(model.state_dict().items(), ref_model.state_dict().values()):
        assert torch.equal(value, want), name
    got, exp = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert got.keys() == exp.keys() == {0}
    for key, value in exp[0].items():
        mine = got[0][key]
        if isinstance(value, list):
            assert len(mine) == len(value), key
            assert all(a is b is None or torch.equal(torch.as_tensor(a), torch.as_tensor(b))
                       for a, b in zip(mine, value)), key
        else:
            assert torch.equal(torch.as_tensor(mine), torch.as_tensor(value)), key


def test_an_lbfgs_closure_step_equals_the_plain_loop_closure_loss_by_closure_loss():
    """Three epochs of LBFGS steps (max_iter=3, several closure evaluations per step): every closure loss, the
    weights and LBFGS's state equal the plain loop's bit for bit; each epoch's reported loss is the mean of
    the steps' first closure losses."""
    trainer, model, opt = trainer_of()
    records = trainer.fit(loader())
    ref_model, ref_opt, ref_losses = plain_loop()
    assert trainer.losses == ref_losses
    assert_same(model, opt, ref_model, ref_opt)
    assert len(records["train"]["loss"]) == EPOCHS and all(math.isfinite(v) for v in records["train"]["loss"])


def test_every_closure_step_is_an_update_for_schedules_and_snapshot_names(tmp_path):
    """A step-wise scheduler steps once per closure step (2 batches x 3 epochs = 6), and snapshots written
    every update are named by the update count: u000000001 ... u000000006, and the epochs' ends too."""
    snap = SnapshotCallback(tmp_path, every_n_updates=1, keep=20, on_signals=())
    trainer, _, _ = trainer_of(
        opt_wrap=lambda opt: Optimizer(opt, torch.optim.lr_scheduler.StepLR(opt, 1, 0.9), sched_on="step"),
        callbacks=[snap], running_id="run")
    trainer.fit(loader())
    trainer.close()
    assert trainer.opt[0].scheduler.last_epoch == 6
    names = sorted(p.name for p in (tmp_path / "run").glob("snapshot-u*"))
    assert [name for name in names if "epoch" not in name] == [f"snapshot-u{n:09d}.ckpt" for n in range(1, 7)]
    assert [name for name in names if "epoch" in name] == [
        f"snapshot-u{n:09d}-epoch{n // 2}.ckpt" for n in (2, 4, 6)]


def test_a_checkpoint_of_an_lbfgs_run_loads_and_the_resumed_run_equals_the_uninterrupted_one(tmp_path):
    """An epoch-end checkpoint after 2 epochs passes the checkpoint rules (LBFGS's whole state under parameter
    0: flat vectors, history lists, counts) and a new trainer with resume=True trains epoch 3 to the plain
    loop's weights and state, bit for bit."""
    check = dict(on_stage="train", save_best=False, ckpt_dir=tmp_path)
    first, _, _ = trainer_of(epochs=2, callbacks=[CheckCallback("loss", **check)], running_id="run")
    first.fit(loader())
    first.close()
    resumed, model, opt = trainer_of(callbacks=[CheckCallback("loss", **check)], running_id="run", resume=True)
    with _no_skip_warning():
        resumed.fit(loader())
    assert resumed.loop.completed_epochs == EPOCHS
    ref_model, ref_opt, _ = plain_loop()
    assert_same(model, opt, ref_model, ref_opt)


class _no_skip_warning:
    """A resume that skipped its file would warn and start over: fail on any warning instead."""

    def __enter__(self):
        import warnings  # noqa: PLC0415
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        return self._catch.__exit__(*exc)


def test_a_mid_epoch_snapshot_of_an_lbfgs_run_resumes_exactly(tmp_path):
    """A run that fails in epoch 3 after snapshots every update resumes in a new trainer from the last one
    (mid-epoch) and ends equal to the plain loop."""

    class Failing(ClosureStep):
        def train_step(self, batch_x, batch_y, **step_args):
            if (self.loop.epoch, self.loop.batch_idx) == (3, 2):
                raise RuntimeError("boom")
            return super().train_step(batch_x, batch_y, **step_args)

    snap = dict(ckpt_dir=tmp_path, every_n_updates=1, on_signals=())
    model, opt = make()
    failing = Failing(model, F.mse_loss, opt, epochs=EPOCHS, running_id="run",
                      callbacks=[SnapshotCallback(**snap)], **QUIET)
    failing.losses = []
    with pytest.raises(RuntimeError, match="boom"):
        failing.fit(loader())
    failing.close()
    resumed, model, opt = trainer_of(callbacks=[SnapshotCallback(**snap)], running_id="run", resume=True)
    resumed.fit(loader())
    ref_model, ref_opt, _ = plain_loop()
    assert_same(model, opt, ref_model, ref_opt)


def test_a_damaged_lbfgs_state_is_refused_naming_the_entry(tmp_path):
    """The checkpoint rules check LBFGS's entries for what they are: a search direction of the wrong length is
    refused, naming 'd' and the optimizer's element count."""
    trainer, model, _ = trainer_of(epochs=1)
    trainer.fit(loader())
    path = tmp_path / "a.ckpt"
    save(trainer, path)
    raw = torch.load(path, weights_only=False)
    raw["optimizers"][0]["state"][0]["d"] = torch.zeros(5)
    torch.save(raw, path)
    n = sum(p.numel() for p in model.parameters())
    with pytest.raises(CheckpointError, match=rf"\['d'\] must be a floating point vector of the optimizer's {n}"):
        trainer_of(epochs=1)[0].load_checkpoint(path)


def test_a_closure_inside_an_accumulation_window_or_under_fp16_is_refused():
    """A closure step cannot accumulate (gradient_accumulation_steps=2) nor be scaled (fp16): each is refused at
    the first batch with what to use instead."""
    trainer, _, _ = trainer_of(gradient_accumulation_steps=2)
    with pytest.raises(InvalidTransition, match="cannot accumulate gradients over micro-batches; use"
                                                " gradient_accumulation_steps=1"):
        trainer.fit(loader())
    trainer, _, _ = trainer_of(precision="fp16")
    with pytest.raises(InvalidTransition, match=r"a closure optimizer \(self.optimize\(closure=...\)\) needs"
                                                " precision='fp32' or 'bf16'"):
        trainer.fit(loader())
