"""The non-finite gradient check before every update catches an inf or NaN in any single parameter's
gradient, on both of its CPU paths (the fused pass for small gradients, the summed pass for large ones),
with one optimizer, several parameter groups and several optimizers. References: the same model trained
by a plain PyTorch loop on the batches before the bad one."""

import copy
import math

import pytest
import torch
from torch import nn

from deepepochs import Trainer, torch_private

BATCH, N_BATCHES, BAD_BATCH = 4, 5, 3  # BAD_BATCH: 1-based training batch whose gradients are poisoned


class Net(nn.Module):
    """3 -> 8 -> 1 with biases: four parameter tensors. `poison` maps a parameter's index to the value (or
    a tuple of values) written into its gradient's middle element(s) in training forward number BAD_BATCH."""

    def __init__(self, poison=None):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
        self.calls = 0
        for index, param in enumerate(self.parameters()):
            if poison and index in poison:
                param.register_hook(self._poisoner(poison[index]))

    def _poisoner(self, value):
        def hook(grad):
            if self.calls != BAD_BATCH:
                return grad
            grad = grad.clone()
            values = value if isinstance(value, tuple) else (value,)
            middle = grad.numel() // 2
            grad.view(-1)[middle:middle + len(values)] = torch.tensor(values)  # one or more elements, mid-tensor
            return grad

        return hook

    def forward(self, x):
        if self.training:
            self.calls += 1
        return self.body(x)


def _batches():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(N_BATCHES * BATCH, 3, generator=g)
    y = x.sum(dim=1, keepdim=True) * 0.5 - 1.0
    return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]


def _optimizers(model, layout):
    """`layout`: 'one' (one SGD), 'groups' (one SGD, a parameter group per layer with its own lr),
    'two' (an SGD per layer)."""
    first, last = model.body[0], model.body[2]
    if layout == "one":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    if layout == "groups":
        return torch.optim.SGD([{"params": first.parameters()}, {"params": last.parameters(), "lr": 0.05}],
                               lr=0.1, momentum=0.9)
    return [torch.optim.SGD(first.parameters(), lr=0.1), torch.optim.SGD(last.parameters(), lr=0.05)]


def _plain_loop(model, layout, batches):
    opts = _optimizers(model, layout)
    opts = opts if isinstance(opts, list) else [opts]
    for x, y in batches:
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        for opt in opts:
            opt.step()
    return model


@pytest.fixture(params=["fused", "summed", "mixed"])
def check_path(request, monkeypatch):
    """Which CPU path the check takes: the thresholds of `sums_pay_off` and `grads_finite_on_host` set so
    that this small model's gradients are summed ('summed'), not ('fused'), or the first weight (24
    elements) summed and the three smaller gradients in the fused call ('mixed'); the choice of path is made
    when the trainer is built."""
    monkeypatch.setattr(torch_private, "SUM_CHECK_MEAN_NUMEL", 10**12 if request.param == "fused" else 1)
    monkeypatch.setattr(torch_private, "SUM_CHECK_MIN_NUMEL", 9 if request.param == "mixed" else 1)
    return request.param


POISONS = [{index: value} for index in range(4) for value in (math.inf, -math.inf, math.nan)]
POISONS += [{0: math.inf, 3: -math.inf}, {2: -math.inf, 1: math.inf}, {1: math.inf, 2: math.nan}]


@pytest.mark.parametrize("layout", ["one", "groups", "two"])
def test_an_inf_or_nan_in_any_single_gradient_stops_the_update_on_either_check_path(layout, check_path):
    """For every parameter tensor and each of inf, -inf, NaN in one of its elements (and +inf in one tensor
    with -inf in another, whose sum is NaN rather than a finite value): nonfinite='raise' raises at the bad
    batch naming the gradient, and the weights are the plain loop's after the batches before it."""
    torch.manual_seed(0)
    init = Net()
    data = _batches()
    expected = _plain_loop(copy.deepcopy(init), layout, data[:BAD_BATCH - 1])
    for poison in POISONS:
        model = Net(poison)
        model.load_state_dict(init.state_dict())
        assert torch_private.sums_pay_off(list(model.parameters())) is (check_path != "fused")
        trainer = Trainer(model, nn.functional.mse_loss, _optimizers(model, layout), epochs=1, device="cpu",
                          show_info=False, log_batch=False)
        with pytest.raises(FloatingPointError, match=rf"non-finite gradient \(the loss is finite\).*batch {BAD_BATCH}"):
            trainer.fit(data)
        trainer.close()
        for got, want in zip(model.parameters(), expected.parameters()):
            assert torch.equal(got, want), (poison, layout)


def test_finite_gradients_whose_sum_overflows_are_not_taken_for_inf(monkeypatch):
    """On the summed path, a gradient holding two finite elements of 3e38 sums past float32's range: the
    exact check confirms it finite, and the update is applied as in the plain loop (no raise, same weights)."""
    monkeypatch.setattr(torch_private, "SUM_CHECK_MEAN_NUMEL", 1)
    monkeypatch.setattr(torch_private, "SUM_CHECK_MIN_NUMEL", 1)
    torch.manual_seed(0)
    init = Net()
    big = {0: (3e38, 3e38)}
    data = _batches()[:BAD_BATCH]
    expected = Net(big)
    expected.load_state_dict(init.state_dict())
    opt = torch.optim.SGD(expected.parameters(), lr=1e-38)
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(expected(x), y).backward()
        opt.step()
    model = Net(big)
    model.load_state_dict(init.state_dict())
    grads = []
    model.body[0].weight.register_post_accumulate_grad_hook(lambda p: grads.append(p.grad.clone()))
    trainer = Trainer(model, nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=1e-38), epochs=1,
                      device="cpu", show_info=False, log_batch=False)
    trainer.fit(data)
    trainer.close()
    assert len(grads) == BAD_BATCH and not math.isfinite(grads[-1].sum().item())  # its sum alone says inf
    assert torch.isfinite(grads[-1]).all()
    for got, want in zip(model.parameters(), expected.parameters()):
        assert torch.equal(got, want)
