"""What the preemption and SLURM tests compare a resumed run with: every model, optimizer and scheduler
tensor of an uninterrupted run, bit for bit and of the same dtype.

Test modules import this from tests/ (pytest puts it on `sys.path`, as for checkpoint_helpers)."""

from __future__ import annotations

import torch
from torch.nn import functional as F


def states_equal(a, b) -> bool:
    """Whether two nested states (tensors in dicts, lists and tuples) are equal: tensors bit for bit and of
    the same dtype, everything else by `==` (NaN equal to NaN)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b))
    return a == b or (a != a and b != b)  # a NaN record equals a NaN record


def assert_same_run(result, reference) -> None:
    """Assert that a run's saved `model`, `opt` and `sched` states equal the reference run's."""
    for key in ("model", "opt", "sched"):
        assert states_equal(result[key], reference[key]), key


def run_tensors(model, opt, sched) -> dict:
    """Every model tensor (buffers included), every optimizer state tensor and the scheduler's state."""
    state = {f"model.{k}": v.clone() for k, v in model.state_dict().items()}
    for index, values in opt.state_dict()["state"].items():
        state.update({f"opt.{index}.{k}": v.clone() for k, v in values.items()})
    state["sched"] = sched.state_dict()
    return state


def assert_tensors_equal(got: dict, want: dict) -> None:
    """`run_tensors` of two runs equal: the same names, every tensor bit for bit, every other value equal."""
    assert got.keys() == want.keys()
    for name, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[name], value), name
        else:
            assert got[name] == value, name


def plain_val_loss(model, val, device=None) -> float:
    """A plain loop's evaluation: the sample-weighted mean cross-entropy over `val` in eval mode (batches
    moved to `device` when given), the model back in training mode after."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in val:
            if device is not None:
                x, y = x.to(device), y.to(device)
            total, count = total + float(F.cross_entropy(model(x), y)) * len(y), count + len(y)
    model.train()
    return total / count
