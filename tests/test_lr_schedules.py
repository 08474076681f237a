"""Step-wise LR schedules as a first-class path: `trainer.estimated_updates(train_dl)` is the number of
updates a fit makes (the `total_steps` of `OneCycleLR`), a scheduler sized with it can be attached after the
Trainer is built, and `LogCallback` logs the learning rate of every update, read back from the event file."""

import pytest
import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.optim.lr_scheduler import OneCycleLR
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import ConfigError, LogCallback, Optimizer, Trainer

N, BATCH = 100, 8  # 13 batches per epoch, the last one short


def _loader():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=BATCH, shuffle=True, generator=g)


def _quiet():
    return {"log_batch": False, "show_info": False}


class CountSteps:
    """Counts the optimizer's step() calls (the updates actually applied), independently of deepepochs."""

    def __init__(self, opt):
        self.steps = 0
        opt.register_step_post_hook(lambda *_: setattr(self, "steps", self.steps + 1))


@pytest.mark.parametrize("k", [1, 4, 5])
def test_estimated_updates_is_the_number_of_updates_a_fit_makes(k):
    """ceil(13 / k) updates per epoch (a short tail window is one update) times the epochs."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    counter = CountSteps(opt)
    with Trainer(model, F.mse_loss, opt, epochs=3, gradient_accumulation_steps=k, **_quiet()) as trainer:
        estimate = trainer.estimated_updates(_loader())
        assert trainer.estimated_updates(_loader(), epochs=1) * 3 == estimate
        trainer.fit(_loader())
    assert estimate == counter.steps == -(-13 // k) * 3


def test_estimated_updates_refuses_data_without_a_length_and_bad_epochs():
    model = nn.Linear(4, 1)
    with Trainer(model, F.mse_loss, **_quiet()) as trainer:
        with pytest.raises(ConfigError, match="needs data with a length"):
            trainer.estimated_updates(batch for batch in _loader())
        with pytest.raises(ConfigError, match=r"epochs must be a positive int \(got 0\)"):
            trainer.estimated_updates(_loader(), epochs=0)


def test_a_one_cycle_schedule_sized_by_the_estimate_runs_to_its_end_and_logs_every_update(tmp_path):
    """OneCycleLR(total_steps=estimated_updates) attached after the Trainer: the fit steps it exactly
    to its end (one more step would raise), and `lr/update` holds the rate of each update, equal to a plain
    OneCycleLR's rates, at steps 1..total."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    log = LogCallback(tmp_path)
    with Trainer(model, F.mse_loss, Optimizer(opt, sched_on="step"), epochs=2, gradient_accumulation_steps=2,
                 callbacks=[log], running_id="run", **_quiet()) as trainer:
        total = trainer.estimated_updates(_loader())
        trainer.opt[0].scheduler = OneCycleLR(opt, max_lr=0.1, total_steps=total)
        trainer.fit(_loader())
        sched = trainer.opt[0].scheduler
        assert sched.last_epoch == total
    reference_opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.01)
    reference = OneCycleLR(reference_opt, max_lr=0.1, total_steps=total)
    want = []
    for _ in range(total):
        want.append(reference.get_last_lr()[0])
        reference_opt.step()
        reference.step()
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    logged = events.Scalars("lr/update")
    assert [e.step for e in logged] == list(range(1, total + 1))
    assert [e.value for e in logged] == pytest.approx(want, rel=1e-6)


def test_a_scheduler_set_later_is_checked_like_one_given_to_optimizer():
    model, other = nn.Linear(4, 1), nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    wrapped = Optimizer(opt, sched_on="step")
    with pytest.raises(ConfigError, match="scheduler must schedule the optimizer it is wrapped with"):
        wrapped.scheduler = OneCycleLR(torch.optim.SGD(other.parameters(), lr=0.1), max_lr=0.1, total_steps=3)
