"""AnalyzeCallback: statistics checked against plain PyTorch, and no hook outlives training."""

import re

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import AnalyzeCallback, Callback, ConfigError, Trainer

MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                "_state_dict_hooks", "_load_state_dict_pre_hooks")


def hooks_left(model):
    """Every hook registered on the model's modules and parameters, as (name, kind) pairs."""
    found = [(name, kind) for name, m in model.named_modules() for kind in MODULE_HOOKS if getattr(m, kind)]
    for name, p in model.named_parameters():
        if p._backward_hooks:
            found.append((name, "_backward_hooks"))
        if getattr(p, "_post_accumulate_grad_hooks", None):
            found.append((name, "_post_accumulate_grad_hooks"))
    return found


def data(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 2, (n,), generator=g)


def frozen_trainer(model, callbacks, tmp_path, epochs=2):
    """A trainer whose SGD has lr=0, so the model is the same at every batch and plain PyTorch can compute
    the reference statistics over the whole dataset."""
    return Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.0), epochs=epochs,
                   device="cpu", callbacks=callbacks, log_batch=False, show_info=False, running_id="run")


def read(tmp_path):
    ea = EventAccumulator(str(tmp_path / "run"), size_guidance={"scalars": 0, "histograms": 0})
    ea.Reload()
    return ea


def values(ea, tag):
    return [(e.step, e.value) for e in ea.Scalars(tag)]


def model_3():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 2))


def test_forward_mode_writes_each_layers_output_statistics_per_epoch(tmp_path):
    """output/<layer>/mean and std cover every training batch of an epoch; the histogram its first batch."""
    model = model_3()
    x, y = data()
    with frozen_trainer(model, [AnalyzeCallback(log_dir=tmp_path)], tmp_path) as trainer:
        trainer.fit(DataLoader(TensorDataset(x, y), batch_size=16))  # batches of 16, 16, 8
    with torch.no_grad():
        outputs = {"0": model[0](x), "1": torch.tanh(model[0](x)), "2": model(x)}
    ea = read(tmp_path)
    for name, out in outputs.items():
        mean, std = out.double().mean().item(), out.double().std(unbiased=False).item()
        assert values(ea, f"output/{name}/mean") == [(1, pytest.approx(mean, abs=1e-6)),
                                                     (2, pytest.approx(mean, abs=1e-6))]
        assert values(ea, f"output/{name}/std") == [(1, pytest.approx(std, rel=1e-5)),
                                                    (2, pytest.approx(std, rel=1e-5))]
        hist = ea.Histograms(f"output/{name}")[0].histogram_value
        assert hist.num == 16 * out.shape[1]
        assert hist.min == pytest.approx(out[:16].min().item())
        assert hist.max == pytest.approx(out[:16].max().item())


def test_backward_mode_writes_output_and_parameter_gradient_statistics(tmp_path):
    """grad/<layer> is the gradient of the layer output and param_grad/<layer>.<param> the gradient the
    optimizer uses, both equal to plain autograd on the same batch."""
    model = model_3()
    x, y = data()
    analyze = AnalyzeCallback("backward", log_dir=tmp_path)
    with frozen_trainer(model, [analyze], tmp_path, epochs=1) as trainer:
        trainer.fit(DataLoader(TensorDataset(x, y), batch_size=40))
    logits = model(x)
    logits.retain_grad()
    F.cross_entropy(logits, y).backward()
    expected = {"grad/2": logits.grad, "param_grad/0.weight": model[0].weight.grad,
                "param_grad/2.bias": model[2].bias.grad}
    ea = read(tmp_path)
    for tag, grad in expected.items():
        g = grad.double()
        assert values(ea, f"{tag}/mean") == [(1, pytest.approx(g.mean().item(), abs=1e-7))]
        assert values(ea, f"{tag}/std") == [(1, pytest.approx(g.std(unbiased=False).item(), rel=1e-5))]
        assert ea.Histograms(tag)[0].histogram_value.num == g.numel()


class FailOnBatch3(nn.Module):
    """A model whose forward raises on the third training batch."""

    def __init__(self):
        super().__init__()
        self.body = model_3()
        self.calls = 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("forward failed on batch 3")
        return self.body(x)


class RaiseInHook(Callback):
    """Raises once, after the backward of training batch 3."""

    raised = False

    def on_after_backward(self, trainer, loss):
        if trainer.loop.batch_idx == 3 and not self.raised:
            self.raised = True
            raise RuntimeError("callback failed on batch 3")


class Probe(Callback):
    """Counts the analysis hooks seen during training and those seen during validation."""

    def __init__(self, analyze):
        self.analyze, self.in_training, self.in_validation = analyze, [], []

    def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
        self.in_training.append(self.analyze.hook_count)

    def on_before_val_batch(self, trainer, batch_x, batch_y, batch_idx):
        self.in_validation.append(hooks_left(trainer.raw_model))


@pytest.mark.parametrize("mode", ["forward", "backward"])
@pytest.mark.parametrize("where", ["model_forward", "callback_hook"])
def test_no_hook_is_left_after_an_exception_mid_fit(mode, where, tmp_path):
    """An exception on batch 3 (in the model's forward or in a callback) leaves no hook on any module or
    parameter, and the trainer can fit again."""
    model = FailOnBatch3() if where == "model_forward" else model_3()
    analyze = AnalyzeCallback(mode, log_dir=tmp_path)
    probe = Probe(analyze)
    callbacks = [analyze, probe] + ([RaiseInHook()] if where == "callback_hook" else [])
    x, y = data()
    trainer = frozen_trainer(model, callbacks, tmp_path)
    with pytest.raises(RuntimeError, match="failed on batch 3"):
        trainer.fit(DataLoader(TensorDataset(x, y), batch_size=8))
    assert probe.in_training and all(n > 0 for n in probe.in_training)
    assert hooks_left(model) == []
    trainer.fit(DataLoader(TensorDataset(x, y), batch_size=8))
    assert hooks_left(model) == []
    trainer.close()


def test_hooks_exist_only_during_training_stages(tmp_path):
    """Validation batches see no analysis hook, and none is left after fit."""
    model = model_3()
    analyze = AnalyzeCallback(log_dir=tmp_path)
    probe = Probe(analyze)
    x, y = data()
    with frozen_trainer(model, [analyze, probe], tmp_path) as trainer:
        dl = DataLoader(TensorDataset(x, y), batch_size=16)
        trainer.fit(dl, dl)
        assert hooks_left(model) == []
    assert probe.in_validation and all(h == [] for h in probe.in_validation)
    assert all(n == 3 for n in probe.in_training)  # three leaf modules


def test_close_removes_hooks_still_registered(tmp_path):
    """Hooks registered by a training stage that never ended are removed by trainer.close()."""
    model = model_3()
    analyze = AnalyzeCallback(log_dir=tmp_path)
    trainer = frozen_trainer(model, [analyze], tmp_path)
    analyze.on_before_train_epochs(trainer, [], 1)  # as if a stage had started and its end was never reached
    assert len(hooks_left(model)) == 3
    trainer.close()
    assert hooks_left(model) == []


def test_layers_selects_the_watched_modules(tmp_path):
    """layers=['0'] records only that module."""
    x, y = data()
    with frozen_trainer(model_3(), [AnalyzeCallback(log_dir=tmp_path, layers=["0"])], tmp_path, 1) as trainer:
        trainer.fit(DataLoader(TensorDataset(x, y), batch_size=16))
    assert sorted(read(tmp_path).Tags()["scalars"]) == ["output/0/mean", "output/0/std"]


def test_an_unknown_layer_is_refused_before_training_with_the_available_names(tmp_path):
    """A layer name that is not a module of the model is a ConfigError at the start of fit, listing names."""
    model = model_3()
    probe = Probe(AnalyzeCallback())
    x, y = data()
    with frozen_trainer(model, [AnalyzeCallback(layers=["fc"]), probe], tmp_path) as trainer:
        with pytest.raises(ConfigError, match=re.escape("['fc'] are not modules of the model; the model's"
                                                        " modules are '0', '1', '2'")):
            trainer.fit(DataLoader(TensorDataset(x, y), batch_size=16))
    assert probe.in_training == []


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mode": "grad"}, "mode must be one of 'forward', 'backward'"),
    ({"layers": [1]}, "layers must be None or a non-empty list of module names"),
    ({"histograms": 1}, "histograms must be True or False"),
])
def test_bad_arguments_are_refused_with_a_clear_message(kwargs, message):
    """AnalyzeCallback validates its arguments when it is created."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        AnalyzeCallback(**kwargs)
