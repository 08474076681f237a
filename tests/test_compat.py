"""The 0.6 helper names (`deepepochs.compat`): those that come back behave as 0.6
documented, the others fail with a message naming their replacement."""

from __future__ import annotations

import collections
import copy
import sys

import numpy as np
import pytest
import torch

import deepepochs
from deepepochs import (
    AnalyzeCallback,
    ConfigError,
    InterpreteCallback,
    LogCallback,
    TensorDict,
    TensorTuple,
    batches,
    concat,
    flatten_dict,
    plot_confusion,
    sum_dicts,
    to_numpy,
)
from deepepochs.errors import DeepEpochsWarning

# name -> a phrase its message must contain (the replacement), written here independently of the table
GONE = {
    "StopLoopException": "trainer.request_stop(reason)",
    "LoopException": "re-raised as it is",
    "CallbackException": "deepepochs.ConfigError",
    "Optimizers": "opt=[opt1, Optimizer(",
    "LinearCosineScheduler": "SequentialLR",
}


@pytest.mark.parametrize("name", sorted(GONE))
def test_a_removed_0_6_name_fails_to_import_with_its_replacement_in_the_message(name):
    """`from deepepochs import <0.6 name>` raises ImportError naming what to use instead."""
    with pytest.raises(ImportError, match=rf"deepepochs\.{name} \(deepepochs 0\.6\) was removed: .*MIGRATION"):
        exec(f"from deepepochs import {name}", {})
    with pytest.raises(ImportError) as info:
        getattr(deepepochs, name)
    assert GONE[name] in str(info.value)


def test_other_missing_names_are_still_plain_attribute_errors():
    """Only the 0.6 names get the special message; hasattr() keeps working for anything else."""
    assert not hasattr(deepepochs, "no_such_name")
    with pytest.raises(ImportError, match="cannot import name 'no_such_name'"):
        exec("from deepepochs import no_such_name", {})


@pytest.mark.parametrize("make", [lambda tmp: LogCallback(tmp), lambda tmp: AnalyzeCallback(log_dir=tmp),
                                  lambda tmp: InterpreteCallback(lambda p, y: p[:, 0], k=2, log_dir=tmp)])
def test_run_tensorboard_outside_a_terminal_warns_with_the_command_and_returns(tmp_path, make, monkeypatch):
    """0.6's `run_tensorboard()` at the end of a script that is not run from a terminal (stdin here is not
    one, even under `pytest -s`): a warning with the tensorboard command for the callback's folder, and it
    returns at once (no server)."""
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO())
    cb = make(tmp_path)
    with pytest.warns(DeepEpochsWarning, match=rf"start it yourself: `tensorboard --logdir {tmp_path}`"):
        assert cb.run_tensorboard() is None
    assert copy.deepcopy(cb).log_dir == cb.log_dir


def test_run_tensorboard_in_a_terminal_starts_tensorboard_on_the_folder(tmp_path, monkeypatch, capsys):
    """From a terminal `run_tensorboard()` runs TensorBoard itself on the callback's folder, as 0.6 did. The
    real command is run, with `--version_tb` added so that it exits instead of serving."""
    import subprocess

    from deepepochs import compat

    ran, real_run = [], subprocess.run

    def run_and_exit(command, **kwargs):
        ran.append(command)
        return real_run([*command, "--version_tb"], capture_output=True, text=True, timeout=120, **kwargs)

    monkeypatch.setattr(compat.subprocess, "run", run_and_exit)
    assert LogCallback(tmp_path).run_tensorboard(interactive=True) == 0
    assert ran == [[sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path)]]
    assert f"TensorBoard on {tmp_path}" in capsys.readouterr().out


def test_tensor_tuple_and_tensor_dict_convert_every_tensor_they_hold():
    """`.to`, `.detach`, `.clone`, `.float`, `.long`, `.cpu` and `.device` act on each tensor; other items
    stay as they are."""
    a = torch.randn(3, requires_grad=True)
    b = torch.arange(3)
    tt = TensorTuple([a, b, "tag"])
    assert isinstance(tt, tuple) and tt.device == torch.device("cpu")
    detached = tt.detach()
    assert isinstance(detached, TensorTuple) and not detached[0].requires_grad and detached[2] == "tag"
    doubled = tt.to(torch.float64)
    assert doubled[0].dtype == doubled[1].dtype == torch.float64 and torch.equal(doubled[1], b.double())
    cloned = tt.clone()
    cloned[1].add_(1)
    assert torch.equal(b, torch.arange(3))  # a clone shares no storage
    assert tt.long()[0].dtype == torch.int64 and TensorTuple(a).float()[0] is not None
    td = TensorDict(x=a, y=b, name="n")
    assert isinstance(td.detach(), TensorDict) and not td.detach()["x"].requires_grad
    assert td.float()["y"].dtype == torch.float32 and td.cpu()["name"] == "n" and td.device.type == "cpu"


def test_batches_splits_along_the_first_dimension_and_concat_joins_the_parts_back():
    """batches(x, 4) equals torch.split(x, 4) for tensors, tuples and dicts; concat undoes it."""
    x, y = torch.randn(10, 3), torch.arange(10)
    parts = list(batches(x, 4))
    assert [p.shape[0] for p in parts] == [4, 4, 2]
    assert all(torch.equal(p, q) for p, q in zip(parts, torch.split(x, 4)))
    assert torch.equal(concat(parts), x)
    pairs = list(batches((x, y), 3))
    assert all(isinstance(p, TensorTuple) for p in pairs)
    assert [len(p[1]) for p in pairs] == [3, 3, 3, 1]
    joined = concat(pairs)
    assert torch.equal(joined[0], x) and torch.equal(joined[1], y)
    dicts = list(batches({"x": x, "y": y}, 6))
    assert torch.equal(concat(dicts)["y"], y) and torch.equal(dicts[1]["x"], x[6:])
    assert torch.equal(concat([torch.tensor(1.0), torch.tensor(2.0)]), torch.tensor([1.0, 2.0]))
    with pytest.raises(ConfigError, match=r"batch_size must be a positive int \(got 0\)"):
        next(batches(x, 0))
    with pytest.raises(ConfigError, match="concat\\(\\) needs a non-empty list"):
        concat([])


def test_sum_dicts_flatten_dict_and_to_numpy():
    """Key-wise sums, '.'-joined keys of nested dicts, and tensors turned into NumPy arrays recursively."""
    assert sum_dicts([{"a": 1, "b": 2}, {"a": 10}, {"b": 5, "c": 1}]) == {"a": 11, "b": 7, "c": 1}
    summed = sum_dicts([{"tp": torch.tensor(2)}, {"tp": torch.tensor(3)}])
    assert int(summed["tp"]) == 5
    assert flatten_dict({"opt": {"lr": 0.1, "betas": {"b1": 0.9}}, "epochs": 3}) == {
        "opt.lr": 0.1, "opt.betas.b1": 0.9, "epochs": 3}
    assert flatten_dict({"a": {"b": 1}}, sep="/") == {"a/b": 1}
    t = torch.arange(4.0, requires_grad=True) * 2
    Pair = collections.namedtuple("Pair", "left right")
    out = to_numpy({"t": t, "list": [t, 3], "pair": Pair(t, "x"), "bf16": torch.ones(2, dtype=torch.bfloat16)})
    assert isinstance(out["t"], np.ndarray) and np.array_equal(out["t"], np.arange(4.0) * 2)
    assert out["list"][1] == 3 and isinstance(out["pair"], Pair) and out["pair"].right == "x"
    assert out["bf16"].dtype == np.float32


def test_plot_confusion_without_matplotlib_says_how_to_install_it(monkeypatch):
    """matplotlib is optional: plot_confusion raises ImportError with the pip command when it is missing,
    and refuses a matrix that is not square before that."""
    with pytest.raises(ConfigError, match=r"cm must be a square \[C, C\] matrix"):
        plot_confusion(torch.zeros(2, 3))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        plot_confusion(torch.eye(3))


def test_plot_confusion_draws_the_counts_in_the_cells():
    """With matplotlib installed: one text per cell holding its count, rows true and columns predicted."""
    pytest.importorskip("matplotlib")
    cm = torch.tensor([[5, 1], [2, 7]])
    fig = plot_confusion(cm, class_names=["neg", "pos"], title="cm")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert texts == ["5", "1", "2", "7"]
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["neg", "pos"]


def test_a_0_6_callback_priority_is_refused_with_how_to_order_callbacks():
    """0.6's `super().__init__(priority=...)` raises a TypeError saying to order the callbacks list; a plain
    `super().__init__()` still works."""
    from deepepochs import Callback

    class Prioritised(Callback):
        def __init__(self):
            super().__init__(priority=10)

    class Plain(Callback):
        def __init__(self):
            super().__init__()

    with pytest.raises(TypeError, match=r"Prioritised: Callback\(priority=\.\.\.\) \(deepepochs 0\.6\) was removed: "
                                        r".*order that list instead"):
        Prioritised()
    assert isinstance(Plain(), Callback)
