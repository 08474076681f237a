"""Non-finite values: a NaN gradient behind a finite loss is caught like a NaN loss,
and a skipped update's batches stay out of the epoch's loss and metrics, which the epoch line and the
progress say. References: the same model trained by a plain PyTorch loop that skips the same updates."""

import copy
import math

import pytest
import torch
from torch import nn

from deepepochs import Callback, Trainer, torch_private
from deepepochs.reporting import console

BATCH, N_BATCHES = 4, 6


class NanGradient(torch.autograd.Function):
    """Identity forward, NaN gradient backward: a finite loss whose gradients are not."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, math.nan)


class Net(nn.Module):
    """A linear regressor whose training forward number `bad_calls` (1-based) gets NaN gradients."""

    def __init__(self, bad_calls=()):
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.bad_calls, self.calls = set(bad_calls), 0

    def forward(self, x):
        out = self.lin(x)
        if self.training:
            self.calls += 1
            if self.calls in self.bad_calls:
                out = NanGradient.apply(out)
        return out


def _data(nan_batches=()):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N_BATCHES * BATCH, 3, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]]) + 0.1
    batches = [(x[i:i + BATCH].clone(), y[i:i + BATCH].clone()) for i in range(0, len(x), BATCH)]
    for b in nan_batches:  # 0-based batch positions whose loss is NaN
        batches[b][1][0, 0] = math.nan
    return batches


def mse_metric(preds, targets):
    return ((preds - targets) ** 2).mean()


def _reference(model, batches, k=1, skip_windows=(), lr=0.1):
    """A plain loop: k-batch windows (mean of the window's losses); the 0-based windows in `skip_windows`
    are not stepped and stay out of the epoch's loss and metric."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss_sum = metric_sum = count = 0.0
    for w, start in enumerate(range(0, len(batches), k)):
        window = batches[start:start + k]
        losses = []
        for x, y in window:
            out = model(x)
            loss = nn.functional.mse_loss(out, y)
            (loss / len(window)).backward()
            losses.append((loss.item(), mse_metric(out.detach(), y).item()))
        if w in skip_windows:
            opt.zero_grad(set_to_none=True)
            continue
        opt.step()
        opt.zero_grad(set_to_none=True)
        for loss, metric in losses:
            loss_sum += loss * BATCH
            metric_sum += metric * BATCH
            count += BATCH
    return model, loss_sum / count, metric_sum / count


def _trainer(model, **kw):
    return Trainer(model, nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), epochs=1,
                   device="cpu", show_info=False, metrics=[mse_metric], **kw)


class WideNet(Net):
    """Net with a wide hidden layer (3 -> 21846 -> 1, no biases): its two gradients average 65,538 elements,
    over SUM_CHECK_MEAN_NUMEL, so the finite check sums them (the read-only path)."""

    def __init__(self, bad_calls=()):
        super().__init__(bad_calls)
        self.wide = nn.Linear(3, 65536 // 3 + 1, bias=False)
        self.lin = nn.Linear(65536 // 3 + 1, 1, bias=False)

    def forward(self, x):
        return super().forward(self.wide(x))


@pytest.mark.parametrize("net", [Net, WideNet])
def test_a_nan_gradient_behind_a_finite_loss_raises_before_it_reaches_the_weights(net, monkeypatch):
    """nonfinite='raise': batch 3's loss is finite, its gradients NaN. fit raises naming the gradient;
    the weights are those of the two updates before (a plain loop's), with no NaN in them. Net's small
    gradients take the fused check at every update; WideNet's large ones are summed (the read-only path),
    and only batch 3's non-finite total reaches the exact check."""
    exact = []
    real = torch_private._check_into
    monkeypatch.setattr(torch_private, "_check_into", lambda *args: exact.append(args) or real(*args))
    torch.manual_seed(0)
    model = net(bad_calls={3})
    assert torch_private.sums_pay_off(list(model.parameters())) is (net is WideNet)
    expected = copy.deepcopy(model)
    _reference(expected, _data()[:2])
    trainer = _trainer(model, log_batch=False)
    with pytest.raises(FloatingPointError, match=r"non-finite gradient \(the loss is finite\).*batch 3"):
        trainer.fit(_data())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    for got, want in zip(model.parameters(), expected.parameters()):
        assert torch.equal(got, want)
    assert len(exact) == (1 if net is WideNet else 3)
    trainer.close()


@pytest.mark.parametrize("fuse_steps", [True, False])
def test_a_nan_gradient_behind_a_finite_loss_is_skipped_and_left_out_of_the_epoch(fuse_steps, capsys):
    """nonfinite='skip': the update of batch 3 is skipped; weights, epoch loss and metric equal a plain
    loop's that skips it and leaves it out; the epoch line says one update was skipped."""
    torch.manual_seed(0)
    model = Net(bad_calls={3})
    expected = copy.deepcopy(model)
    expected.bad_calls = set()
    _, ref_loss, ref_metric = _reference(expected, _data(), skip_windows={2})
    trainer = _trainer(model, nonfinite="skip", log_batch=False, fuse_steps=fuse_steps)
    records = trainer.fit(_data())
    trainer.close()
    for got, want in zip(model.parameters(), expected.parameters()):
        assert torch.equal(got, want)
    assert records["train"]["loss"][0] == pytest.approx(ref_loss, rel=1e-6)
    assert records["train"]["mse_metric"][0] == pytest.approx(ref_metric, rel=1e-6)
    assert "(1 update skipped)" in capsys.readouterr().out


@pytest.mark.parametrize("k", [1, 2])
def test_a_nan_loss_skipped_leaves_its_window_out_of_the_epoch_loss_and_metrics(k, capsys, monkeypatch):
    """nonfinite='skip' with NaN losses in batches 2 and 5 (0-based 1 and 4): the epoch loss and metric
    are finite and equal a plain loop's over the windows that trained (k=2: whole windows out); the
    progress line and the epoch line report the skipped updates."""
    monkeypatch.setattr(console, "LOG_REFRESH_S", 0.0)  # a progress line after every batch
    torch.manual_seed(0)
    model = Net()
    expected = copy.deepcopy(model)
    data = _data(nan_batches=(1, 4))
    skip_windows = {1 // k, 4 // k}
    _, ref_loss, ref_metric = _reference(expected, data, k=k, skip_windows=skip_windows)
    trainer = _trainer(model, nonfinite="skip", gradient_accumulation_steps=k)
    records = trainer.fit(data)
    trainer.close()
    out = capsys.readouterr().out
    assert math.isfinite(records["train"]["loss"][0])
    assert records["train"]["loss"][0] == pytest.approx(ref_loss, rel=1e-6)
    assert records["train"]["mse_metric"][0] == pytest.approx(ref_metric, rel=1e-6)
    for got, want in zip(model.parameters(), expected.parameters()):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)
    assert "(2 updates skipped)" in out.splitlines()[-1]  # the epoch line
    progress = [line for line in out.splitlines() if f"B {N_BATCHES}/{N_BATCHES}" in line]
    assert progress and "(2 updates skipped)" in progress[-1]


def test_fp16_nan_loss_skipped_by_the_scaler_stays_out_of_the_epoch_loss():
    """fp16 (GradScaler) skips the update of a NaN loss by itself, and of the first batches while it
    lowers its scale from 2**16 (their scaled gradients overflow fp16); those batches stay out of the
    epoch loss, which is finite and equals the mean of the losses of the batches whose update was applied
    (read back per batch, with the scaler's skips seen by a callback)."""
    torch.manual_seed(0)
    model = Net()
    losses, skipped = [], set()

    class Record(Callback):
        def on_after_train_batch(self, trainer, metrics, batch_idx):
            losses.append(float(metrics["loss"]))

        def on_skip_optimize(self, trainer, opt_index):
            skipped.add(len(losses) + 1)  # runs in the batch, before on_after_train_batch

    trainer = _trainer(model, precision="fp16", log_batch=False, callbacks=[Record()])
    records = trainer.fit(_data(nan_batches=(2,)))
    trainer.close()
    assert math.isnan(losses[2]) and all(math.isfinite(v) for i, v in enumerate(losses) if i != 2)
    applied = [v for i, v in enumerate(losses, 1) if i not in skipped]
    assert 3 in skipped and 0 < len(applied) < N_BATCHES
    assert records["train"]["loss"][0] == pytest.approx(sum(applied) / len(applied), rel=1e-6)


class ComplexNet(nn.Module):
    """A complex-weighted regressor (|x W|): its gradients are complex, which the fused check cannot read."""

    def __init__(self, bad_calls=()):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 1, dtype=torch.complex64, generator=torch.Generator().manual_seed(1)))
        self.bad_calls, self.calls = set(bad_calls), 0

    def forward(self, x):
        out = x.to(torch.complex64) @ self.w
        if self.training:
            self.calls += 1
            if self.calls in self.bad_calls:
                out = NanGradient.apply(out)
        return out.abs()


def test_complex_parameters_train_like_a_plain_loop_and_their_nan_gradients_are_caught():
    """Complex gradients take the finite check's exact path: a fit equals the plain loop's weights and
    loss, and a NaN complex gradient behind a finite loss raises before it reaches the weights."""
    model, expected = ComplexNet(), ComplexNet()
    _, ref_loss, _ = _reference(expected, _data())
    trainer = _trainer(model, log_batch=False)
    records = trainer.fit(_data())
    trainer.close()
    assert torch.equal(model.w, expected.w)
    assert records["train"]["loss"][0] == pytest.approx(ref_loss, rel=1e-6)
    model, expected = ComplexNet(bad_calls={2}), ComplexNet()
    _reference(expected, _data()[:1])
    trainer = _trainer(model, log_batch=False)
    with pytest.raises(FloatingPointError, match=r"non-finite gradient \(the loss is finite\).*batch 2"):
        trainer.fit(_data())
    assert torch.equal(model.w, expected.w)
    trainer.close()
