"""CheckCallback: argument checks, best/latest saves, early stop, testing the best model."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, CheckCallback, ConfigError, Trainer

STEPS = (0.0, 0.02)


def _loaders(n=64):
    """Train targets y = 3x, validation targets y = x: training walks the weight from 0 past 1 towards 3,
    so the validation loss falls, then rises, and its best epoch is neither the first nor the last."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, generator=g)
    train = DataLoader(TensorDataset(x, 3 * x), batch_size=16, shuffle=False)
    val = DataLoader(TensorDataset(x, x.clone()), batch_size=16, shuffle=False)
    return train, val


def _trainer(callbacks, epochs=6, lr=0.02, **kwargs):
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return Trainer(model, F.mse_loss, opt, epochs=epochs, callbacks=callbacks, log_batch=False, **kwargs)


def _weights(trainer):
    return {k: v.clone() for k, v in trainer.raw_model.state_dict().items()}


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"monitor": ""}, r"monitor must be a non-empty metric name string.*\(got ''\)"),
    ({"monitor": "loss", "on_stage": "test"}, r"on_stage must be one of 'val', 'train' \(got 'test'\)"),
    ({"monitor": "loss", "mode": "mean"}, r"mode must be one of 'min', 'max' \(got 'mean'\); 'min' when"),
    ({"monitor": "loss", "patience": -1}, r"patience must be an int >= 0.*\(got -1\)"),
    ({"monitor": "loss", "patience": True}, r"patience must be an int >= 0.*\(got True\)"),
    ({"monitor": "loss", "save_best": "yes"}, r"save_best must be True or False \(got 'yes'\)"),
    ({"monitor": "loss", "ckpt_dir": 3}, r"ckpt_dir must be a path.*\(got int\)"),
])
def test_bad_arguments_are_refused_naming_the_argument_and_the_accepted_values(kwargs, message):
    """Each argument is validated in the constructor, with accepted and received values in the message."""
    with pytest.raises(ConfigError, match=message):
        CheckCallback(**kwargs)


def test_two_callbacks_with_the_same_monitor_id_are_refused_when_attached(tmp_path):
    """Same stage, metric and best/latest kind would share a file: Trainer refuses the second one."""
    with pytest.raises(ConfigError, match="two CheckCallbacks monitor 'val-loss.best'"):
        _trainer([CheckCallback("loss", ckpt_dir=tmp_path), CheckCallback("loss", ckpt_dir=tmp_path / "b")])


def test_a_missing_metric_fails_at_the_first_check_listing_the_existing_names(tmp_path):
    """monitor='acc' on a stage that only has 'loss' and 'mae' raises ConfigError naming those."""
    def mae(preds, targets):
        return (preds - targets).abs().mean()

    trainer = _trainer([CheckCallback("acc", ckpt_dir=tmp_path)], metrics=[mae])
    message = r"monitor must name a val metric: one of 'loss', 'mae' \(got 'acc'\)"
    with pytest.raises(ConfigError, match=message):
        trainer.fit(*_loaders())
    assert trainer.loop.completed_epochs == 0  # the epoch's end raised before the epoch committed


def test_a_validation_monitor_without_validation_data_says_how_to_fix_it(tmp_path):
    """on_stage='val' with fit(train_dl) only raises ConfigError suggesting val_dl or on_stage='train',
    before the first epoch trains (the weights are untouched)."""
    trainer = _trainer([CheckCallback("loss", ckpt_dir=tmp_path)])
    before = [p.detach().clone() for p in trainer.raw_model.parameters()]
    with pytest.raises(ConfigError, match="fit\\(\\) got no validation data.*on_stage='train'"):
        trainer.fit(_loaders()[0])
    assert all(torch.equal(p, q) for p, q in zip(trainer.raw_model.parameters(), before))
    assert trainer.loop.completed_epochs == 0


def test_monitors_in_one_folder_write_their_own_files_each_holding_every_monitors_state(tmp_path):
    """A best-val and a latest-train monitor share ckpt_dir; each file has both states; best is the best."""
    best = CheckCallback("loss", on_stage="val", mode="min", ckpt_dir=tmp_path)
    latest = CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=tmp_path)
    trainer = _trainer([best, latest])
    records = trainer.fit(*_loaders())
    run = tmp_path / trainer.running_id
    assert sorted(p.name for p in run.iterdir()) == ["finished.pt", "progress.pt", "train-loss.latest.ckpt",
                                                     "val-loss.best.ckpt"]

    val = records["val"]["loss"]
    best_epoch = val.index(min(val)) + 1
    assert 1 < best_epoch < len(val)
    best_file = torch.load(run / "val-loss.best.ckpt", weights_only=True)
    latest_file = torch.load(run / "train-loss.latest.ckpt", weights_only=True)
    assert best_file["epoch"] == best_epoch and latest_file["epoch"] == len(val)
    for data in (best_file, latest_file):
        assert set(data["monitors"]) == {"val-loss.best", "train-loss.latest"}
    assert best_file["monitors"]["val-loss.best"]["best"] == pytest.approx(min(val))
    assert latest_file["monitors"]["val-loss.best"]["best_epoch"] == best_epoch
    assert latest_file["monitors"]["train-loss.latest"]["last"] == pytest.approx(records["train"]["loss"][-1])
    torch.testing.assert_close(latest_file["model"]["weight"], trainer.raw_model.weight.detach())


def test_early_stop_after_patience_epochs_without_improvement_still_saves_that_epoch(tmp_path, capsys):
    """lr=0 keeps the loss flat: patience=2 stops after epoch 3, and epoch 3's latest file is written."""
    cb = CheckCallback("loss", patience=2, save_best=False, ckpt_dir=tmp_path)
    trainer = _trainer([cb], epochs=10, lr=0.0)
    records = trainer.fit(*_loaders())
    assert len(records["val"]["loss"]) == 3
    assert "Stopped early after epoch 3: val loss did not improve for 2 epoch(s)" in capsys.readouterr().out
    saved = torch.load(tmp_path / trainer.running_id / "val-loss.latest.ckpt", weights_only=True)
    assert saved["epoch"] == 3
    assert saved["monitors"]["val-loss.latest"]["bad_epochs"] == 2
    assert saved["monitors"]["val-loss.latest"]["best_epoch"] == 1


def test_a_resumed_monitor_keeps_counting_patience_from_the_checkpoint(tmp_path):
    """The patience counter is part of the checkpoint: after resume one more flat epoch reaches patience 3."""
    first = _trainer([CheckCallback("loss", patience=3, save_best=False, ckpt_dir=tmp_path)], epochs=3,
                     lr=0.0)
    first.fit(*_loaders())
    resumed = _trainer([CheckCallback("loss", patience=3, save_best=False, ckpt_dir=tmp_path)], epochs=10,
                       lr=0.0, resume=True)
    records = resumed.fit(*_loaders())
    assert len(records["val"]["loss"]) == 4  # three from the checkpoint, one trained now
    assert resumed.loop.completed_epochs == 4


def test_patience_zero_never_stops(tmp_path):
    """patience=0 turns early stopping off even when the metric never improves."""
    trainer = _trainer([CheckCallback("loss", patience=0, ckpt_dir=tmp_path)], epochs=5, lr=0.0)
    assert len(trainer.fit(*_loaders())["val"]["loss"]) == 5


def test_mode_max_tracks_the_highest_value(tmp_path):
    """mode='max' on the validation loss keeps the worst-loss epoch (the first, before any update)."""
    cb = CheckCallback("loss", mode="max", ckpt_dir=tmp_path)
    trainer = _trainer([cb], epochs=2, lr=0.01)
    records = trainer.fit(*_loaders())
    assert cb.best == pytest.approx(max(records["val"]["loss"])) and cb.best_epoch == 1 == cb.saved_epoch


def test_test_evaluates_the_best_epoch_then_restores_the_pre_test_weights(tmp_path):
    """test() returns the best recorded validation loss on the same data; weights and progress are unchanged
    afterwards and fit can continue."""
    trainer = _trainer([CheckCallback("loss", ckpt_dir=tmp_path)])
    train, val = _loaders()
    records = trainer.fit(train, val)
    assert min(records["val"]["loss"]) < records["val"]["loss"][-1]
    before, momentum = _weights(trainer), trainer.opt[0].opt.state_dict()

    metrics = trainer.test(val)

    assert metrics["loss"] == pytest.approx(min(records["val"]["loss"]), rel=1e-6)
    for name, value in _weights(trainer).items():
        assert torch.equal(value, before[name]), name
    assert trainer.loop.completed_epochs == 6
    assert trainer.opt[0].opt.state_dict() == momentum
    assert len(trainer.fit(train, val, epochs=7)["val"]["loss"]) == 7


def test_a_failing_test_still_restores_the_pre_test_weights(tmp_path):
    """A metric raising inside test(): the error propagates, the best weights were in use, then restored."""
    cb = CheckCallback("loss", ckpt_dir=tmp_path)
    trainer = _trainer([cb])
    train, val = _loaders()
    trainer.fit(train, val)
    before = _weights(trainer)
    best = torch.load(cb.path(trainer), weights_only=True)["model"]["weight"]
    seen = []

    def exploding_metric(preds, targets):
        seen.append(trainer.raw_model.weight.detach().clone())
        raise RuntimeError("metric exploded")

    with pytest.raises(RuntimeError, match="metric exploded"):
        trainer.test(val, metrics=[exploding_metric])
    torch.testing.assert_close(seen[0], best)
    assert not torch.equal(best, before["weight"])
    for name, value in _weights(trainer).items():
        assert torch.equal(value, before[name]), name
    assert trainer.machine.state == "idle"


def test_test_uses_the_first_monitor_in_declaration_order_that_has_a_file(tmp_path):
    """A val monitor that never checked (val_freq) has no file, so the train monitor's weights are tested."""
    never = CheckCallback("loss", on_stage="val", ckpt_dir=tmp_path)
    train_best = CheckCallback("loss", on_stage="train", ckpt_dir=tmp_path)
    trainer = _trainer([never, train_best], epochs=3)
    train, val = _loaders()
    trainer.fit(train, val, val_freq=100)
    assert not never.path(trainer).exists() and train_best.path(trainer).exists()
    want = torch.load(train_best.path(trainer), weights_only=True)["model"]["weight"]

    class Spy(Callback):
        def on_before_test_batch(self, trainer, batch_x, batch_y, batch_idx):
            seen.append(trainer.raw_model.weight.detach().clone())

    seen = []
    trainer.add_callbacks([Spy()])
    trainer.test(val)
    torch.testing.assert_close(seen[0], want)


def test_test_without_any_checkpoint_uses_the_current_weights(tmp_path):
    """No monitor has a file yet (fresh trainer): test() evaluates the model as it is."""
    trainer = _trainer([CheckCallback("loss", ckpt_dir=tmp_path)])
    _, val = _loaders()
    x, y = val.dataset.tensors
    assert trainer.test(val)["loss"] == pytest.approx(float(F.mse_loss(torch.zeros_like(y), y)), rel=1e-6)
