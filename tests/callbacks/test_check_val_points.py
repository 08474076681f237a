"""CheckCallback at the update clock's validation points: each file written at a point holds the point's row
(read back against `trainer.history`), and a fault at a point after the monitor's check leaves the monitor
as the point never checked, so the refit ends with the uninterrupted run's monitor state and records."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from deepepochs import Callback, CheckCallback, Optimizer, Trainer
from deepepochs.checkpoint import read_checkpoint

UPDATES, EVERY = 22, 4


def data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=g), torch.randint(0, 2, (64,), generator=g)
    train = TensorDataset(x, y)
    sampler = RandomSampler(train, replacement=True, num_samples=10**6, generator=torch.Generator().manual_seed(1))
    return DataLoader(train, batch_size=8, sampler=sampler), DataLoader(TensorDataset(x[:24], y[:24]), batch_size=8)


class FailingStepLR(torch.optim.lr_scheduler.StepLR):
    """An epoch-wise StepLR, which steps at each validation point after the monitors checked it, raising
    once at its `fail_at`-th step (None: never): a fault at a point after its check, before it commits."""

    def __init__(self, opt, fail_at):
        # one dict, shared by the scheduler's states: a rollback puts back `steps`, not the fault's plan
        self.plan, self.steps = {"fail_at": fail_at}, 0
        super().__init__(opt, 2, 0.9)

    def step(self, *args, **kwargs):
        self.steps += 1
        if self.steps == self.plan["fail_at"]:
            self.plan["fail_at"] = None
            raise RuntimeError("fault at a validation point")
        super().step(*args, **kwargs)


class Trace(Callback):
    """The monitor's state before each validation point's check (monitors check after the other callbacks),
    by update count; a point validated again after a refit replaces its entry."""

    def __init__(self, monitor):
        self.monitor, self.states = monitor, {}

    def on_after_val_epochs(self, trainer, tasks, metrics, epoch_idx):
        self.states[trainer.loop.run.updates] = self.monitor.state_dict()


def fit(tmp_path, fail_at=None, patience=3, save_best=True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), 0.5)
    check = CheckCallback("loss", ckpt_dir=tmp_path, patience=patience, save_best=save_best)
    check.trace = Trace(check)
    trainer = Trainer(model, F.cross_entropy, Optimizer(opt, FailingStepLR(opt, fail_at)), max_updates=UPDATES,
                      callbacks=[check, check.trace], log_batch=False, show_info=False, running_id="run")
    train, val = data()
    try:
        trainer.fit(train, val, val_every_n_updates=EVERY)
    except RuntimeError:
        trainer.fit(train, val, val_every_n_updates=EVERY)  # the refit
    trainer.close()
    return trainer, check, {k: v.clone() for k, v in model.state_dict().items()}


def test_a_file_written_at_a_validation_point_holds_that_points_row(tmp_path):
    """save_best=False writes the file at every point: read back, its validation records are the run's rows
    up to that point, each metric list as long as the update counts (before, the point's metrics were added
    without its update count)."""
    trainer, check, _ = fit(tmp_path, save_best=False, patience=0)
    ckpt = read_checkpoint(check.path(trainer))
    want = trainer.history["val"]
    assert ckpt.updates == UPDATES and ckpt.history["val"] == want
    assert len(want["updates"]) == len(want["loss"]) == UPDATES // EVERY + 1


@pytest.mark.parametrize("point", [2, 3, 5])
def test_a_fault_at_a_validation_point_after_the_check_is_refitted_with_the_uninterrupted_monitor(tmp_path, point):
    """The scheduler raises at a point (the monitor's check done, its save not): the refit validates the
    point again, and the monitor's state after every point (best, its point, patience count), the records and
    the weights equal the uninterrupted run's (before, the discarded point's check was counted twice: a point
    that did not improve counted two bad points)."""
    trainer, check, weights = fit(tmp_path / "a")
    faulted, faulted_check, faulted_weights = fit(tmp_path / "b", fail_at=point)
    assert faulted_check.trace.states == check.trace.states
    assert faulted_check.state_dict() == check.state_dict()
    assert faulted.history == trainer.history
    assert all(torch.equal(faulted_weights[k], v) for k, v in weights.items())


def test_under_the_update_clock_the_tested_file_the_resume_and_the_test_line_name_updates(tmp_path):
    """A run by updates whose files are written inside epoch 1: test() names the best file by its update
    count (read back from the file), not "(epoch 0)"; the test line reads `U <updates>  TEST>`; a resume says
    how many updates are committed and which one comes next, not "0 epoch(s) completed"."""
    import io

    trainer, check, _ = fit(tmp_path, patience=0)
    best = check.path(trainer)
    updates = read_checkpoint(best).updates
    assert read_checkpoint(best).epoch == 0 and 0 < updates <= UPDATES
    train, val = data()
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 2))
    again = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), 0.5), max_updates=UPDATES + 4,
                    callbacks=[CheckCallback("loss", ckpt_dir=tmp_path)], log_batch=False, running_id="run",
                    resume=True)
    again.console.stream = out = io.StringIO()
    again.test(val)
    text = out.getvalue()
    assert f"Testing the weights of {best} (update {updates})" in text and "(epoch 0)" not in text, text
    assert f"\nU {updates}  TEST>  loss: " in text, text
    assert (f"{updates} update(s) committed, continuing with update {updates + 1} (inside epoch 1, after"
            f" {updates} of its batch(es))" in text), text  # one batch per update
    assert "E 1/1  TEST>" not in text and "0 epoch(s) completed, continuing" not in text, text
    again.close()
