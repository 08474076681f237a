"""The loop's Python calls per micro-batch stay within a committed budget (a guard against creeping cost).

The per-batch cost of the loop is measured in instructions by `make bench-instructions`, which is too slow and
too noisy for every commit. This guard counts something deterministic instead: the Python function calls
(`sys.setprofile`'s 'call' events, and the C functions called from Python, 'c_call') that one training
micro-batch costs on the tiny workload, for each configuration of `BUDGETS`. A fit over 2N batches minus a fit
over N batches, divided by N, leaves the fixed costs (the run header, the epoch's start and end) out.

A change that adds calls to the hot path fails here until `benchmarks/budgets/calls_per_batch.json` changes in
the same commit, with a line in its `why` list saying what the calls pay for. A change that removes calls fails
too, asking for the budget to be lowered, so that the saving is kept.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import deepepochs

BUDGET_FILE = Path(__file__).resolve().parents[1] / "benchmarks" / "budgets" / "calls_per_batch.json"
#: Batches of the shorter fit; the longer one has twice as many. A multiple of every accumulation window here.
BATCHES = 8


def _data(batches: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batches * 32, 16, generator=g)
    y = torch.randint(0, 2, (batches * 32,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=32)


def _default(tmp_path):
    return {}, {}


def _accumulate(tmp_path):
    return {"gradient_accumulation_steps": 4}, {}


def _update_clock(tmp_path):
    # validation far beyond the fit: the clock counts updates, no validation point falls inside the measure
    return {"max_updates": 10**6}, {"val_every_n_updates": 10**6}


def _ema(tmp_path):
    return {"callbacks": [deepepochs.EMACallback(0.99)]}, {}


def _snapshots(tmp_path):
    # armed for SIGTERM and by count, with no snapshot due inside the fit: the cost between snapshots
    callback = deepepochs.SnapshotCallback(str(tmp_path / "snapshots"), every_n_updates=10**6,
                                           on_signals=("SIGTERM",))
    return {"callbacks": [callback], "running_id": "calls"}, {}


#: configuration name -> a function returning (Trainer keyword arguments, fit keyword arguments)
CONFIGURATIONS = {
    "default": _default,
    "accumulate_4": _accumulate,
    "update_clock": _update_clock,
    "ema": _ema,
    "snapshots_between": _snapshots,
}


def _calls_of_fit(tmp_path, name: str, batches: int) -> int:
    """Python calls made by one fit of one epoch over `batches` batches (the trainer built beforehand)."""
    trainer_kwargs, fit_kwargs = CONFIGURATIONS[name](tmp_path / str(batches))
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 2)
    trainer = deepepochs.Trainer(model, F.cross_entropy, torch.optim.Adam(model.parameters(), lr=1e-3),
                                 device="cpu", **trainer_kwargs)
    data = _data(batches)
    if "val_every_n_updates" in fit_kwargs:
        fit_kwargs = {**fit_kwargs, "val_dl": _data(1)}
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        if event == "call" or event == "c_call":
            count += 1

    gc.collect()
    gc.disable()  # no finaliser runs inside the count
    sys.setprofile(profile)
    try:
        trainer.fit(data, epochs=1, **fit_kwargs)
    finally:
        sys.setprofile(None)
        gc.enable()
        trainer.close()
    return count


def calls_per_batch(tmp_path, name: str) -> float:
    """The Python calls one micro-batch costs in configuration `name`."""
    # a first fit warms the caches (generated code compiled, lazy imports done) outside the measure
    _calls_of_fit(tmp_path / "warm", name, BATCHES)
    short = _calls_of_fit(tmp_path, name, BATCHES)
    long = _calls_of_fit(tmp_path, name, 2 * BATCHES)
    return (long - short) / BATCHES


def _budget() -> dict:
    return json.loads(BUDGET_FILE.read_text())


def test_every_configuration_has_a_budget():
    """The budget file names exactly the configurations measured here, each with a count."""
    budget = _budget()
    assert set(budget["calls_per_batch"]) == set(CONFIGURATIONS)
    assert budget["why"], "the budget file says why each count is what it is"


@pytest.mark.parametrize("name", sorted(CONFIGURATIONS))
def test_calls_per_micro_batch_stay_within_the_budget(tmp_path, name, capsys):
    """A micro-batch makes exactly the committed number of Python calls (within 2 %)."""
    measured = calls_per_batch(tmp_path, name)
    capsys.readouterr()  # the console's lines
    budget = _budget()["calls_per_batch"][name]
    assert measured <= budget * 1.02, (
        f"{name}: a micro-batch now makes {measured:.1f} Python calls, the budget is {budget} "
        f"({BUDGET_FILE.name}): remove the added calls from the hot path, or raise the budget in the same "
        f"commit with a line in its 'why' saying what they pay for")
    assert measured >= budget * 0.98, (
        f"{name}: a micro-batch now makes {measured:.1f} Python calls, fewer than the budget {budget}: "
        f"lower the budget in {BUDGET_FILE.name} to keep the saving")
