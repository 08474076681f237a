"""Careless use gets a clear error, early (issue 15, section 5, in part): an optimizer that trains none of
the model, calling fit/test/close from inside a callback, a training epoch without batches, and a device
this machine does not have."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepepochs import Callback, ConfigError, Trainer
from deepepochs.errors import DeepEpochsWarning

QUIET = dict(device="cpu", log_batch=False, show_info=False)


def _data(n=32, batch=8):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return [(x[i:i + batch], (x[i:i + batch, 0] > 0).long()) for i in range(0, n, batch)]


def test_an_optimizer_that_holds_none_of_the_models_parameters_is_refused():
    """The optimizer of another model: ConfigError at construction, not a flat loss after an epoch."""
    model, other = nn.Linear(4, 2), nn.Linear(4, 2)
    with pytest.raises(ConfigError, match=r"opt holds none of the model's 2 trainable parameters"):
        Trainer(model, F.cross_entropy, torch.optim.SGD(other.parameters(), lr=0.1), **QUIET)


def test_an_optimizer_that_holds_some_of_the_models_parameters_warns_how_many_are_left_out():
    """Only the first layer in the optimizer: a warning naming how many trainable tensors it leaves out."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.warns(DeepEpochsWarning, match=r"2 of the model's 4 trainable parameters .* no optimizer"):
        Trainer(model, F.cross_entropy, torch.optim.SGD(model[0].parameters(), lr=0.1), **QUIET)


def test_frozen_parameters_left_out_of_the_optimizer_do_not_warn():
    """Parameters with requires_grad=False are not expected in any optimizer."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer(model, F.cross_entropy, torch.optim.SGD(model[0].parameters(), lr=0.1), **QUIET)


@pytest.mark.parametrize("call", ["fit", "test", "close"])
def test_fit_test_or_close_from_inside_a_callback_is_a_clear_error(call):
    """A callback calling the trainer's fit/test/close while it runs gets an error saying so; the trainer
    rolls back and stays usable."""
    data = _data()

    class Reentrant(Callback):
        fired = False

        def on_after_train_batch(self, trainer, metrics, batch_idx):
            if not self.fired:
                self.fired = True
                getattr(trainer, call)(*([data] if call != "close" else []))

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    t = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), epochs=1,
                callbacks=[Reentrant()], **QUIET)
    with pytest.raises(RuntimeError, match=rf"{call}\(\) was called from inside a callback while fit\(\) runs"):
        t.fit(data)
    assert t.machine.state == "idle"
    t.fit(data)
    assert t.loop.completed_epochs == 1


def test_an_epoch_without_training_batches_is_a_config_error_naming_the_task():
    """A one-shot generator is used up by epoch 1: epoch 2 raises ConfigError suggesting a re-iterable."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    t = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), epochs=2, **QUIET)
    batches = iter(_data())
    with pytest.raises(ConfigError, match=r"the train data of task 0 yielded no batch in epoch 2.*DataLoader"):
        t.fit(batches)
    assert t.loop.completed_epochs == 1


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
def test_mps_on_a_machine_without_it_is_refused_at_construction():
    """device='mps' without MPS: ConfigError naming the argument and the devices available."""
    with pytest.raises(ConfigError, match=r"device='mps' but MPS is not available here; available: 'cpu'"):
        Trainer(nn.Linear(4, 2), F.cross_entropy, device="mps")
