"""`Trainer.predict`: the model's outputs, in order, compared with a plain
PyTorch loop over the same batches."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, Trainer
from deepepochs.errors import ConfigError


def _data(n=23, features=4, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3))


def _plain(model, x, batch_size):
    """The reference: eval mode, no gradients, one forward per batch, concatenated."""
    model.eval()
    with torch.no_grad():
        out = torch.cat([model(x[i:i + batch_size]) for i in range(0, len(x), batch_size)])
    model.train()
    return out


def _trainer(model, loss=F.cross_entropy, **kwargs):
    return Trainer(model, loss, epochs=1, device="cpu", log_batch=False, show_info=False, **kwargs)


def test_predict_equals_a_plain_loop_after_training_and_leaves_the_model_as_it_was():
    """After a fit, predict over (x, y) batches equals concatenated eval-mode forwards (dropout off), on
    the CPU, without gradients; weights and train mode are unchanged and training can go on."""
    x, y = _data()
    model = _model()
    with _trainer(model) as trainer:
        trainer.fit(DataLoader(TensorDataset(x, y), batch_size=5))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        out = trainer.predict(DataLoader(TensorDataset(x, y), batch_size=5))
        assert model.training
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert out.device.type == "cpu" and not out.requires_grad
        torch.testing.assert_close(out, _plain(model, x, 5), rtol=0, atol=0)
        again = trainer.fit(DataLoader(TensorDataset(x, y), batch_size=5), epochs=2)
        assert len(again["train"]["loss"]) == 2  # the whole run: the first fit's epoch and this one


def test_predict_takes_unlabelled_batches_with_a_loss_function():
    """A lone tensor batch or a one-item tuple is the input, so unlabelled data need no fake labels."""
    x, _ = _data()
    model = _model()
    with _trainer(model) as trainer:
        expected = _plain(model, x, 6)
        torch.testing.assert_close(trainer.predict(DataLoader(TensorDataset(x), batch_size=6)), expected)
        torch.testing.assert_close(trainer.predict([x[i:i + 6] for i in range(0, len(x), 6)]), expected)


class _TwoHeads(nn.Module):
    """Returns a dict holding a tensor and a tuple of tensors: nested outputs."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 2)

    def forward(self, x, scale):
        return {"a": self.a(x) * scale, "pair": (self.b(x), x.sum(dim=1))}


def test_predict_keeps_nested_outputs_and_passes_dict_batches_as_keywords():
    """A dict batch with loss=None goes to the model as keyword arguments; a dict/tuple output keeps its
    structure, each tensor concatenated over the batches."""
    x, _ = _data()
    torch.manual_seed(1)
    model = _TwoHeads()
    scale = torch.full((len(x),), 2.0)
    batches = [{"x": x[i:i + 4], "scale": scale[i:i + 4, None]} for i in range(0, len(x), 4)]
    with _trainer(model, loss=None) as trainer:
        out = trainer.predict(batches)
    with torch.no_grad():
        assert set(out) == {"a", "pair"} and isinstance(out["pair"], tuple)
        torch.testing.assert_close(out["a"], model.a(x) * 2.0)
        torch.testing.assert_close(out["pair"][0], model.b(x))
        torch.testing.assert_close(out["pair"][1], x.sum(dim=1))


class _Recorder(Callback):
    def __init__(self):
        self.calls = []

    def on_before_test_epochs(self, trainer, tasks):
        self.calls.append("on_before_test_epochs")

    def on_before_test_batch(self, trainer, batch_x, batch_y, batch_idx):
        self.calls.append("on_before_test_batch")


def test_predict_runs_no_hooks_prints_nothing_and_walks_the_test_edges(capsys):
    """predict is no test: no test hooks, no console lines; the flight record shows the test stage's
    edges (begin_task ... end_stage) and the machine is idle again."""
    x, y = _data()
    recorder = _Recorder()
    with Trainer(_model(), F.cross_entropy, epochs=1, device="cpu", callbacks=[recorder]) as trainer:
        capsys.readouterr()
        trainer.predict(DataLoader(TensorDataset(x, y), batch_size=8))
        assert capsys.readouterr().out == ""
        assert recorder.calls == []
        triggers = [r.trigger for r in trainer.machine.records()]
        assert triggers[0] == "test" and triggers[-2:] == ["end_task", "end_stage"]
        assert triggers.count("begin_batch") == 3
        assert trainer.machine.state == "idle"


def test_predict_returns_outputs_where_they_were_computed_with_device_none():
    """device=None leaves the outputs on the computing device (here the CPU, the trainer's device)."""
    x, y = _data()
    with _trainer(_model()) as trainer:
        out = trainer.predict(DataLoader(TensorDataset(x, y), batch_size=8), device=None)
    assert out.device == torch.device("cpu") and out.shape == (len(x), 3)


def test_predict_rejects_a_bad_device_and_missing_data():
    """Bad input names the argument and what was received."""
    x, y = _data()
    with _trainer(_model()) as trainer:
        with pytest.raises(ConfigError, match=r"predict device must be None or a device.*'gpu0'"):
            trainer.predict(DataLoader(TensorDataset(x, y)), device="gpu0")
        with pytest.raises(ConfigError, match="predict\\(\\) needs data"):
            trainer.predict(None)


def test_a_failing_forward_in_predict_leaves_the_trainer_usable():
    """An exception inside predict rolls back like test: the machine is idle and fit still works."""
    x, y = _data()

    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)
            self.fail = False

        def forward(self, x):
            if self.fail:
                raise RuntimeError("forward failed on purpose")
            return self.lin(x)

    model = Fails()
    with _trainer(model) as trainer:
        model.fail = True
        with pytest.raises(RuntimeError, match="on purpose"):
            trainer.predict(DataLoader(TensorDataset(x, y), batch_size=8))
        assert trainer.machine.state == "idle" and model.training
        model.fail = False
        assert len(trainer.fit(DataLoader(TensorDataset(x, y), batch_size=8))["train"]["loss"]) == 1
