"""Careless use gets a clear error, early: an optimizer that trains none of
the model, calling fit/test/close from inside a callback, a training epoch without batches, and a device
this machine does not have."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from deepepochs import Callback, CheckCallback, ConfigError, EpochTask, Trainer, rename
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


class _NoSamples(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter([])


@pytest.mark.parametrize("budget", [{"max_updates": 5}, {"epochs": 2}])
def test_an_empty_dataloader_without_a_length_is_called_empty(budget):
    """A DataLoader over an IterableDataset that yields nothing is empty, not a used-up one-shot iterator."""
    model = nn.Linear(4, 2)
    t = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), **budget, **QUIET)
    with pytest.raises(ConfigError, match=r"the train data of task 0 is empty: it yielded no batch in epoch 1 \(got"
                                          r" a DataLoader without a length\)") as info:
        t.fit(DataLoader(_NoSamples(), batch_size=4))
    assert "one-shot" not in str(info.value)
    assert t.loop.completed_epochs == 0


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
def test_mps_on_a_machine_without_it_is_refused_at_construction():
    """device='mps' without MPS: ConfigError naming the argument and the devices available."""
    with pytest.raises(ConfigError, match=r"device='mps' but MPS is not available here; available: 'cpu'"):
        Trainer(nn.Linear(4, 2), F.cross_entropy, device="mps")


# ---- metric and monitor mistakes: before the first update ----
class _CountUpdates(Callback):
    def __init__(self):
        self.updates = 0

    def on_after_optimize(self, trainer, optimize_index):
        self.updates += 1


def _acc(preds, targets):
    return (preds.argmax(1) == targets).float().mean()


def _fit_expecting(error_match, metrics=None, callbacks=(), val=True, **fit_kw):
    """fit() must raise ConfigError matching `error_match` before any update: no optimizer step ran and the
    weights are the initial ones."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    counter = _CountUpdates()
    trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), epochs=2,
                      callbacks=[counter, *callbacks], metrics=metrics, **QUIET)
    with pytest.raises(ConfigError, match=error_match):
        trainer.fit(_data(), _data() if val else None, **fit_kw)
    assert counter.updates == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    trainer.close()


def test_a_metric_returning_a_non_number_fails_at_the_first_batch_before_any_update():
    _fit_expecting(r"metric 'mood' must return a number.*got str", metrics=[rename(lambda p, y: "high", "mood")])


def test_a_checkcallback_monitor_naming_no_val_metric_fails_before_any_update(tmp_path):
    """A misspelt monitor is refused at the first batch, listing what the validation stage reports."""
    checker = CheckCallback("acc_typo", on_stage="val", mode="max", ckpt_dir=tmp_path)
    _fit_expecting(r"one of 'loss', '_acc' \(got 'acc_typo'\)", metrics=[_acc], callbacks=[checker])


def test_a_val_monitor_on_the_loss_without_val_loss_fails_before_any_update(tmp_path):
    """do_val_loss=False: the validation stage reports no loss, so a 'loss' monitor on it cannot work."""
    checker = CheckCallback("loss", on_stage="val", ckpt_dir=tmp_path)
    _fit_expecting(r"one of '_acc' \(got 'loss'\)", metrics=[_acc], callbacks=[checker], do_val_loss=False)


def test_monitors_of_dict_metric_keys_and_second_task_suffixes_are_accepted(tmp_path):
    """Names only the metrics' results tell (a dict metric's keys) and a second validation task's suffix
    (`loss_1`) are known at the first batch: fit trains, and each monitor records its value every epoch,
    equal to the stage's reported metric."""
    def stats(preds, targets):
        return {"hit": _acc(preds, targets), "miss": 1 - _acc(preds, targets)}

    checkers = [CheckCallback("hit", on_stage="val", mode="max", ckpt_dir=tmp_path),
                CheckCallback("loss_1", on_stage="val", ckpt_dir=tmp_path),
                CheckCallback("miss", on_stage="train", ckpt_dir=tmp_path)]
    model = nn.Linear(4, 2)
    trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), epochs=2,
                      callbacks=checkers, metrics=[stats], **QUIET)
    records = trainer.fit(_data(), _data(), val_tasks=[EpochTask(_data(n=16))])
    trainer.close()
    assert checkers[0].last == records["val"]["hit"][-1]
    assert checkers[1].last == records["val"]["loss_1"][-1]
    assert checkers[2].last == records["train"]["miss"][-1]


def test_a_metric_that_raises_on_one_batch_but_not_on_all_data_is_left_to_the_tasks_end():
    """A metric needing both classes (as an AUC does) raises on a one-class first batch, not on the
    epoch's data: no early failure, and its value is the whole dataset's."""
    def needs_both(preds, targets):
        if targets.unique().numel() < 2:
            raise ValueError("only one class present")
        return _acc(preds, targets)

    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0] * 8 + [0, 1] * 12)
    data = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)]
    model = nn.Linear(4, 2)
    trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.0), epochs=1,
                      metrics=[needs_both], **QUIET)
    records = trainer.fit(data)
    trainer.close()
    with torch.no_grad():
        expected = _acc(model(x), y).item()
    assert records["train"]["needs_both"][0] == pytest.approx(expected)


def test_a_test_metric_returning_a_non_number_fails_at_the_first_test_batch():
    """test(): the first batch already tells; the loader is not read further."""
    seen = []

    class Counting:
        def __iter__(self):
            for batch in _data():
                seen.append(1)
                yield batch

        def __len__(self):
            return 4

    model = nn.Linear(4, 2)
    trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), **QUIET)
    with pytest.raises(ConfigError, match=r"metric 'mood' must return a number"):
        trainer.test(Counting(), metrics=[rename(lambda p, y: None, "mood")])
    assert len(seen) == 1
    trainer.close()


def test_fit_from_a_second_thread_while_fit_runs_says_so_and_the_running_fit_completes():
    """Not 'from inside a callback': the message names both threads and what to do instead."""
    import threading  # noqa: PLC0415

    data, errors = _data(), []

    class SecondThread(Callback):
        def on_after_train_batch(self, trainer, metrics, batch_idx):
            if batch_idx == 0 and not errors:
                def call():
                    try:
                        trainer.fit(data)
                    except RuntimeError as e:
                        errors.append(e)
                worker = threading.Thread(target=call, name="worker")
                worker.start()
                worker.join()

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    t = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), epochs=1,
                callbacks=[SecondThread()], **QUIET)
    t.fit(data)
    assert t.loop.completed_epochs == 1
    (error,) = errors
    assert "fit() was called from thread 'worker' while fit() runs in thread 'MainThread'" in str(error)
    assert "inside a callback" not in str(error) and "its own Trainer" in str(error)


def test_predict_with_an_empty_loader_names_predict_not_a_test_task():
    model = nn.Linear(4, 2)
    t = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), epochs=1, **QUIET)
    empty = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(0, 4)), batch_size=4)
    with pytest.raises(ConfigError, match=r"the data given to predict\(\) is empty \(len 0\)"):
        t.predict(empty)
