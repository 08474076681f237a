"""The learning-rate finder: `Trainer.find_lr` and 0.6's `LRFindCallback`.

References are independent: a plain PyTorch range test for the losses, a trainer that never ran the sweep
for "state restored", and the curve's own numbers for the suggestion."""

from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, LRFindCallback, Optimizer, Trainer
from deepepochs.errors import ConfigError

N, FEATURES, CLASSES, BATCH = 96, 6, 3, 16


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(1)
    return x, y


def _model(dropout=0.0):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, CLASSES))


def _quiet(**kwargs):
    return {"epochs": 1, "device": "cpu", "log_batch": False, "show_info": False, **kwargs}


def _ema(losses, beta):
    """Bias-corrected exponential moving average, written out here as the reference."""
    out, avg = [], 0.0
    for i, loss in enumerate(losses):
        avg = beta * avg + (1 - beta) * loss
        out.append(avg / (1 - beta ** (i + 1)))
    return out


def _trainer_with_scheduler(model):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return Trainer(model, F.cross_entropy, Optimizer(opt, sched, sched_on="step"), **_quiet(epochs=2))


def test_find_lr_restores_everything_so_the_next_fit_equals_a_run_without_it():
    """Trainer A fits an epoch, sweeps, fits another; trainer B only fits: weights, Adam state, step-wise
    scheduler, learning rate, records and history end bit-identical (dropout and shuffling included, so
    the random generators are restored too), and the user's callback saw no sweep batch."""

    class CountBatches(Callback):
        def __init__(self):
            self.batches = 0

        def on_after_train_batch(self, trainer, metrics, batch_idx):
            self.batches += 1

    x, y = _data()
    results = []
    for sweep in (True, False):
        model = _model(dropout=0.3)
        counter = CountBatches()
        with _trainer_with_scheduler(model) as trainer:
            trainer.add_callbacks([counter])
            torch.manual_seed(1)
            dl = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)
            trainer.fit(dl, epochs=1)
            if sweep:
                before = {k: v.clone() for k, v in model.state_dict().items()}
                result = trainer.find_lr(dl, min_lr=1e-5, max_lr=1.0, num_steps=15, plot=False)
                assert len(result.lrs) >= 3
                assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
                assert counter.batches == N // BATCH  # the sweep's batches did not reach it
            records = trainer.fit(dl, epochs=2)
            opt = trainer.opt[0]
            results.append({"state": model.state_dict(), "opt": opt.opt.state_dict(),
                            "sched": opt.scheduler.state_dict(), "records": records,
                            "history": trainer.history, "completed": trainer.loop.completed_epochs,
                            "batches": counter.batches})
    a, b = results
    for key in a["state"]:
        assert torch.equal(a["state"][key], b["state"][key]), key
    assert a["sched"] == b["sched"]
    assert a["opt"]["param_groups"] == b["opt"]["param_groups"]
    for index, state in a["opt"]["state"].items():
        for name, value in state.items():
            assert torch.equal(value, b["opt"]["state"][index][name]), (index, name)
    assert a["records"] == b["records"] and a["history"] == b["history"]
    assert a["completed"] == b["completed"] == 2 and a["batches"] == b["batches"]


def test_sweep_losses_and_rates_match_a_plain_pytorch_range_test():
    """Without divergence stopping, the sweep's rates are exponential from min_lr to max_lr and its losses
    equal a plain loop that sets each rate, steps SGD and cycles the data (more steps than batches)."""
    x, y = _data()
    steps, lo, hi = 14, 1e-3, 0.5
    model = _model()
    reference = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with Trainer(model, F.cross_entropy, opt, **_quiet()) as trainer:
        result = trainer.find_lr(DataLoader(TensorDataset(x, y), batch_size=BATCH), min_lr=lo, max_lr=hi,
                                 num_steps=steps, stop_factor=None, plot=False)
    assert result.stop_reason == "max_lr reached"
    expected_lrs = [lo * (hi / lo) ** (i / (steps - 1)) for i in range(steps)]
    np.testing.assert_allclose(result.lrs, expected_lrs, rtol=1e-12)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01, momentum=0.9)
    batches = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, N, BATCH)]
    losses = []
    for i, lr in enumerate(expected_lrs):
        xb, yb = batches[i % len(batches)]
        loss = F.cross_entropy(reference(xb), yb)
        losses.append(loss.item())
        loss.backward()
        for group in ref_opt.param_groups:
            group["lr"] = lr
        ref_opt.step()
        ref_opt.zero_grad()
    np.testing.assert_allclose(result.losses, losses, rtol=1e-5)
    np.testing.assert_allclose(result.smoothed, _ema(losses, 0.9), rtol=1e-5)
    assert opt.param_groups[0]["lr"] == 0.01 and not opt.state_dict()["state"]  # untouched momentum


def test_sweep_stops_when_the_smoothed_loss_diverges_and_suggests_from_the_curve():
    """With a huge max_lr the sweep stops at the first update whose smoothed loss exceeds 4x its best; the
    suggestion is the rate of steepest descent (vs log lr) of the forward-backward smoothed losses before
    the divergence, before its minimum, at most a tenth of the minimum's rate."""
    x, y = _data()
    model = _model()
    with Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), **_quiet()) as trainer:
        result = trainer.find_lr(DataLoader(TensorDataset(x, y), batch_size=BATCH), min_lr=1e-4, max_lr=1e4,
                                 num_steps=80, plot=False)
    smoothed = _ema(result.losses, 0.9)
    finite = [s for s in smoothed if math.isfinite(s)]
    assert len(result.lrs) < 80 and result.stop_reason.startswith("diverged")
    first_bad = next(i for i, s in enumerate(smoothed) if not math.isfinite(s) or s > 4 * min(smoothed[:i + 1]))
    assert first_bad == len(smoothed) - 1
    assert finite
    raw = result.losses
    cut = next((i for i, v in enumerate(raw) if not math.isfinite(v) or v > 4 * min(raw[:i + 1])), len(raw))
    curve = _ema(_ema(raw[:cut], 0.9)[::-1], 0.9)[::-1]
    low = int(np.argmin(curve))
    slopes = np.gradient(np.array(curve[:low + 1]), np.log10(result.lrs[:low + 1]))
    assert result.suggestion == min(result.lrs[int(np.argmin(slopes))], result.lrs[low] / 10)
    assert 1e-4 <= result.suggestion <= result.lrs[-1]


def test_a_non_finite_loss_in_the_sweep_counts_as_divergence():
    """An update whose loss becomes inf/NaN (nonfinite='raise') ends the sweep as diverged, not with an
    error, and the weights are restored."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g) * 100
    y = torch.randn(64, 1, generator=g) * 100
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), **_quiet()) as trainer:
        result = trainer.find_lr(DataLoader(TensorDataset(x, y), batch_size=8), min_lr=1e-3, max_lr=1e12,
                                 num_steps=60, stop_factor=None, plot=False)
    assert result.stop_reason.startswith("diverged") and len(result.lrs) < 60
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_lr_find_callback_makes_fit_a_sweep_as_in_0_6_then_training_resumes():
    """0.6 code: a fit with LRFindCallback runs the sweep (no training, weights unchanged), the callback
    holds lrs, losses and the suggestion; the next fit trains."""
    x, y = _data()
    model = _model()
    finder = LRFindCallback(max_batch=12, min_lr=1e-4, max_lr=1.0, plot=False)
    opt = torch.optim.Adam(model.parameters(), lr=2e-4)
    dl = DataLoader(TensorDataset(x, y), batch_size=BATCH)
    with Trainer(model, F.cross_entropy, opt, callbacks=[finder], **_quiet()) as trainer:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        assert trainer.fit(dl) == {"train": {}, "val": {}}
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert finder.done and 3 <= len(finder.lrs) == len(finder.losses) <= 12
        assert finder.lrs[0] == pytest.approx(1e-4)
        assert finder.suggestion in finder.lrs or finder.suggestion in [lr / 10 for lr in finder.lrs]
        records = trainer.fit(dl)
        assert len(records["train"]["loss"]) == 1
        assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_without_matplotlib_the_curve_is_skipped_with_one_line(monkeypatch, capsys):
    """plot=True without matplotlib: a line saying how to install it, no error."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    x, y = _data()
    with Trainer(_model(), F.cross_entropy, device="cpu", epochs=1, log_batch=False) as trainer:
        result = trainer.find_lr(DataLoader(TensorDataset(x, y), batch_size=BATCH), num_steps=5, plot=True)
    out = capsys.readouterr().out
    assert "matplotlib is not installed" in out and "pip install matplotlib" in out
    assert result.plot() is False


def test_with_matplotlib_the_measured_curve_is_drawn_and_saved(monkeypatch, tmp_path):
    """plot=path draws losses against the swept rates on a log axis and saves the figure (a stand-in
    pyplot records the calls; matplotlib itself is optional and not installed here)."""
    calls = []

    class Axes:
        def __getattr__(self, name):
            return lambda *args, **kwargs: calls.append((name, args, kwargs))

    class Figure:
        def savefig(self, path):
            calls.append(("savefig", (path,), {}))

    pyplot = types.ModuleType("matplotlib.pyplot")
    pyplot.subplots = lambda: (Figure(), Axes())
    pyplot.close = lambda fig: calls.append(("close", (), {}))
    pyplot.show = lambda: calls.append(("show", (), {}))
    package = types.ModuleType("matplotlib")
    package.pyplot = pyplot
    monkeypatch.setitem(sys.modules, "matplotlib", package)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    x, y = _data()
    path = tmp_path / "lr.png"
    with Trainer(_model(), F.cross_entropy, **_quiet()) as trainer:
        result = trainer.find_lr(DataLoader(TensorDataset(x, y), batch_size=BATCH), num_steps=6, plot=path)
    plots = [c for c in calls if c[0] == "plot"]
    assert plots[0][1] == (result.lrs, result.losses) and plots[1][1] == (result.lrs, result.smoothed)
    assert ("set_xscale", ("log",), {}) in calls
    assert ("savefig", (str(path),), {}) in calls and not any(c[0] == "show" for c in calls)


def test_find_lr_rejects_bad_arguments_naming_them():
    """Bad ranges, step counts and a missing opt_index with two optimizers are refused before any work."""
    x, y = _data()
    dl = DataLoader(TensorDataset(x, y), batch_size=BATCH)
    model = _model()
    with Trainer(model, F.cross_entropy, **_quiet()) as trainer:
        with pytest.raises(ConfigError, match=r"min_lr must be smaller than max_lr \(got min_lr=1.0, max_lr=0.1\)"):
            trainer.find_lr(dl, min_lr=1.0, max_lr=0.1)
        with pytest.raises(ConfigError, match=r"num_steps \(max_batch\) must be an int >= 2.*got 1"):
            trainer.find_lr(dl, num_steps=1)
        with pytest.raises(ConfigError, match=r"min_lr must be a positive finite number \(got -1\)"):
            trainer.find_lr(dl, min_lr=-1)
    first, second = model[0], model[3]
    opts = [torch.optim.SGD(first.parameters(), lr=0.1), torch.optim.SGD(second.parameters(), lr=0.1)]
    with Trainer(model, F.cross_entropy, opts, **_quiet()) as trainer:
        with pytest.raises(ConfigError, match=r"2 optimizers: pass opt_index \(opt_id\) = 0..1"):
            trainer.find_lr(dl, num_steps=5, plot=False)
        with pytest.raises(ConfigError, match=r"opt_index \(opt_id\) must be an int in 0..1 \(got 2\)"):
            trainer.find_lr(dl, num_steps=5, opt_index=2, plot=False)
        result = trainer.find_lr(dl, num_steps=5, opt_index=1, plot=False)
        assert len(result.lrs) == 5
        assert [o.opt.param_groups[0]["lr"] for o in trainer.opt] == [0.1, 0.1]
    with pytest.raises(ConfigError, match="max_batch"):
        LRFindCallback(max_batch=0)


def _least_squares(scale, seed=0):
    """A linear least-squares problem (one full batch, no bias) and its largest stable SGD rate: for the
    mean squared error the Hessian is 2/n X^T X, and gradient descent is stable only below 2 / its largest
    eigenvalue."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 8, generator=g) * scale * torch.tensor([3.0, 1, 1, 1, 0.5, 0.5, 0.2, 0.1])
    y = x @ (10 * torch.randn(8, 1, generator=g)) + 0.1 * torch.randn(256, 1, generator=g)
    hessian = 2 / len(x) * x.T @ x
    return x, y, 2 / torch.linalg.eigvalsh(hessian.double()).max().item()


@pytest.mark.parametrize("scale, num_steps", [(1.0, 30), (1.0, 100), (10.0, 30), (10.0, 60)])
def test_the_suggestion_lies_in_the_stable_descending_region_of_a_least_squares_problem(scale, num_steps):
    """Swept over eight decades around the largest stable rate, the suggestion is below half of it (not
    at the cliff, where a lagging average put it) and above a thousandth of it, and plain gradient
    descent at the suggested rate lowers the loss at every step."""
    x, y, stable = _least_squares(scale)
    model = nn.Linear(8, 1, bias=False)
    with Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), **_quiet()) as trainer:
        result = trainer.find_lr([(x, y)], min_lr=1e-6 * stable, max_lr=100 * stable, num_steps=num_steps,
                                 plot=False)
    assert stable / 1000 < result.suggestion < stable / 2
    torch.manual_seed(1)
    plain = nn.Linear(8, 1, bias=False)
    opt = torch.optim.SGD(plain.parameters(), lr=result.suggestion)
    losses = []
    for _ in range(20):
        loss = F.mse_loss(plain(x), y)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(b < a for a, b in zip(losses, losses[1:]))


def test_a_plot_file_without_matplotlib_is_an_error_naming_the_plot_extra(monkeypatch):
    """plot='lr.png' cannot be honoured without matplotlib: a ConfigError before the sweep, naming the
    [plot] extra (plot=True only prints a note)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    x, y = _data()
    model = _model()
    with Trainer(model, F.cross_entropy, **_quiet()) as trainer:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(ConfigError, match=r"plot='lr\.png' saves the curve with matplotlib, which is not"
                                              r" installed: pip install matplotlib \(the clone's extra: pip"
                                              r" install -e '\.\[plot\]'\)"):
            trainer.find_lr(DataLoader(TensorDataset(x, y), batch_size=BATCH), num_steps=5, plot="lr.png")
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[plot\]'"):
        LRFindCallback(plot="lr.png")
