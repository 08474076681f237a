"""`Trainer(targets=...)`: metrics for dict batches and loss=None models.

The user names where the targets are (a dict-batch key, or a callable giving (preds, targets)); without
it a metric that needs targets fails at the first batch with a message saying how, not after an epoch."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from deepepochs import Callback, Trainer
from deepepochs.errors import ConfigError

N, FEATURES, CLASSES, BATCH = 40, 5, 3, 8


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, FEATURES, generator=g)
    return x, (x[:, :CLASSES]).argmax(1)


def _dict_batches(x, y, label="label"):
    return [{"x": x[i:i + BATCH], label: y[i:i + BATCH]} for i in range(0, N, BATCH)]


def accuracy(preds, targets):
    return (preds.argmax(1) == targets).float().mean()


class OnlyX(nn.Module):
    """forward(x): a label passed as a keyword argument would raise TypeError."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(FEATURES, CLASSES)

    def forward(self, x):
        return self.lin(x)


class OwnLoss(nn.Module):
    """A loss=None model in the style of Hugging Face: forward(x, labels) -> {'loss', 'logits'}."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(FEATURES, CLASSES)

    def forward(self, x, labels):
        logits = self.lin(x)
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}


def _quiet(**kwargs):
    return {"epochs": 2, "device": "cpu", "log_batch": False, "show_info": False, **kwargs}


def _plain_fit(model, x, y, epochs=2, lr=0.1):
    """Reference: plain PyTorch over the same batches."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        for i in range(0, N, BATCH):
            F.cross_entropy(model(x[i:i + BATCH]), y[i:i + BATCH]).backward()
            opt.step()
            opt.zero_grad()
    return model


def test_a_label_key_of_dict_batches_feeds_the_loss_and_metrics_and_is_no_model_input():
    """targets='label' with a loss function: the model gets only x, training equals a plain loop, and
    the validation accuracy equals the plain model's accuracy on the whole set."""
    x, y = _data()
    xv, yv = _data(1)
    model = OnlyX()
    with Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), metrics=[accuracy],
                 targets="label", **_quiet()) as trainer:
        records = trainer.fit(_dict_batches(x, y), _dict_batches(xv, yv))
        predicted = trainer.predict(_dict_batches(xv, yv))
    reference = _plain_fit(OnlyX(), x, y)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value)
    with torch.no_grad():
        expected = (reference(xv).argmax(1) == yv).float().mean().item()
    assert records["val"]["accuracy"][-1] == pytest.approx(expected, abs=1e-6)
    torch.testing.assert_close(predicted, reference(xv).detach())


def test_loss_none_models_get_their_metrics_inputs_from_a_callable():
    """A loss=None model returning {'loss', 'logits'} with dict batches: targets=fn gives the metrics
    (logits, labels); the model still receives labels; accuracy equals the plain computation."""
    x, y = _data()
    model = OwnLoss()
    pick = lambda batch_x, out: (out["logits"], batch_x["labels"])  # noqa: E731
    with Trainer(model, None, torch.optim.SGD(model.parameters(), lr=0.1), metrics=[accuracy], targets=pick,
                 **_quiet(epochs=1)) as trainer:
        metrics = trainer.test(_dict_batches(x, y, label="labels"))
    with torch.no_grad():
        out = model(x, y)
    assert metrics["accuracy"] == pytest.approx((out["logits"].argmax(1) == y).float().mean().item(), abs=1e-6)
    assert metrics["loss"] == pytest.approx(out["loss"].item(), abs=1e-5)


def test_a_label_key_with_loss_none_stays_a_model_input():
    """targets='labels' with loss=None: the model computes its loss from the field (kept as input) and
    the metrics get it as targets, with the output's 'logits' as predictions."""
    x, y = _data()
    model = OwnLoss()
    with Trainer(model, None, metrics=[accuracy], targets="labels", **_quiet(epochs=1)) as trainer:
        metrics = trainer.test(_dict_batches(x, y, label="labels"))
    with torch.no_grad():
        expected = (model(x, y)["logits"].argmax(1) == y).float().mean().item()
    assert metrics["accuracy"] == pytest.approx(expected, abs=1e-6)


class CountBatches(Callback):
    def __init__(self):
        self.batches = 0

    def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
        self.batches += 1


@pytest.mark.parametrize("dict_batches", [True, False], ids=["dict batches", "tuple batches"])
def test_metrics_without_targets_fail_at_the_first_batch_saying_how(dict_batches):
    """loss=None with metrics and no targets: a ConfigError at the first batch (not after an epoch)
    naming the metric and both ways to give targets."""
    x, y = _data()

    class TupleOwnLoss(OwnLoss):
        def forward(self, x, labels):
            return super().forward(x, labels)

    counter = CountBatches()
    data = (_dict_batches(x, y, label="labels") if dict_batches
            else [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, N, BATCH)])
    with Trainer(TupleOwnLoss(), None, metrics=[accuracy], callbacks=[counter], **_quiet()) as trainer:
        with pytest.raises(ConfigError, match=r"metric 'accuracy' needs targets.*targets=None.*"
                                              r"Trainer\(targets='<key>'\).*Trainer\(targets=fn\)"):
            trainer.fit(data)
    assert counter.batches == 1


def test_metrics_that_need_no_targets_still_run_without_them():
    """A metric that ignores its targets is not refused (the check tries the metric, it does not guess)."""
    x, y = _data()
    mean_logit = lambda out, target: out["logits"].mean()  # noqa: E731
    model = OwnLoss()
    with Trainer(model, None, metrics=[mean_logit], **_quiet(epochs=1)) as trainer:
        metrics = trainer.test(_dict_batches(x, y, label="labels"))
    with torch.no_grad():
        assert metrics["<lambda>"] == pytest.approx(model(x, y)["logits"].mean().item(), abs=1e-6)


def test_bad_targets_arguments_are_refused_with_what_was_received():
    """A non-str non-callable, a missing key and a callable not returning a pair name what was wrong."""
    x, y = _data()
    with pytest.raises(ConfigError, match=r"targets must be None, the key .* \(got int\)"):
        Trainer(OnlyX(), F.cross_entropy, targets=3, **_quiet())
    with Trainer(OnlyX(), F.cross_entropy, targets="y", **_quiet()) as trainer:
        with pytest.raises(ConfigError, match=r"targets='y' names a field .* only \['label', 'x'\]"):
            trainer.fit(_dict_batches(x, y))
    with Trainer(OwnLoss(), None, metrics=[accuracy], targets=lambda bx, out: out["logits"],
                 **_quiet()) as trainer:
        with pytest.raises(ConfigError, match=r"must return a \(preds, targets\) pair \(got Tensor\)"):
            trainer.test(_dict_batches(x, y, label="labels"))


def test_a_loss_function_without_a_label_fails_at_the_first_batch_saying_how():
    """Dict batches with a loss function and no targets=: the loss gets batch_y=None; the error names
    targets='<key>' (and keeps the loss's own error as its cause)."""
    x, y = _data()
    counter = CountBatches()
    with Trainer(OnlyX(), F.cross_entropy, callbacks=[counter], **_quiet()) as trainer:
        with pytest.raises(ConfigError, match=r"loss function got batch_y=None .*Trainer\(targets='<key>'\)") as info:
            trainer.fit([{"x": x[:BATCH]}])
    assert counter.batches == 1 and isinstance(info.value.__cause__, Exception)
