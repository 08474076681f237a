"""Every leaf of real checkpoints, damaged: a file is refused (or skipped by resume=True) with the trainer
unchanged, or it loads and the next fit trains to the end; nothing else happens.

Checkpoints of several configurations are written by real fits (Adam; SGD with momentum; two optimizers; a
scheduler stepped per update; one stepped per epoch; a mid-epoch snapshot; a sharded checkpoint folder).
Hypothesis picks a leaf of one (a number, a string, a tensor, None, anywhere in the file) and a
replacement (None, -1, 2**62, 'x', NaN, inf, [], {}, True, a 0-d tensor, a tensor of another shape, a
tensor of NaNs), writes the damaged file as the only checkpoint of a run, and checks both routes:
`load_checkpoint(path)` raises `CheckpointError` and leaves the trainer as it was, or loads and `fit()`
trains to its epoch target; `resume=True` skips the file with a warning naming it and trains afresh, or
resumes it and trains to the end. The number of examples is bounded for CI
(`DEEPEPOCHS_FIELD_EXAMPLES` raises it for a thorough run).
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from checkpoint_helpers import regression_batches, save_sharded
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from deepepochs import CheckCallback, Optimizer, SnapshotCallback, Trainer, checkpoint
from deepepochs.errors import CheckpointError

EXAMPLES = int(os.environ.get("DEEPEPOCHS_FIELD_EXAMPLES", "8"))
EPOCHS = 2


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))


def _adam(model):
    return torch.optim.Adam(model.parameters(), lr=1e-2)


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)


def _two(model):
    return [torch.optim.Adam(model[0].parameters(), lr=1e-2),
            torch.optim.SGD(model[2].parameters(), lr=0.01, momentum=0.5)]


def _per_step(model):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return Optimizer(opt, torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=6), sched_on="step")


def _per_epoch(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    return Optimizer(opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))


CONFIGS = {"adam": _adam, "sgd-momentum": _sgd, "two-optimizers": _two, "scheduler-per-step": _per_step,
           "scheduler-per-epoch": _per_epoch, "mid-epoch-snapshot": _adam, "sharded": _adam}


def _trainer(config: str, folder: Path, resume=False, snapshots=False) -> Trainer:
    model = _model()
    callbacks = [CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=folder)]
    if snapshots:
        callbacks.append(SnapshotCallback(folder, every_n_updates=1, keep=100))
    return Trainer(model, F.mse_loss, CONFIGS[config](model), epochs=EPOCHS, device="cpu", callbacks=callbacks,
                   resume=resume, running_id="run", log_batch=False, show_info=False)


def _written(config: str, folder: Path) -> Path:
    """A real checkpoint of `config`, written by a one-epoch fit into `folder`: a file, or a sharded folder."""
    trainer = _trainer(config, folder, snapshots=config == "mid-epoch-snapshot")
    trainer.fit(regression_batches(), epochs=1)
    run = folder / "run"
    if config == "sharded":
        return save_sharded(trainer, folder / "sharded.ckpt")
    if config == "mid-epoch-snapshot":  # inside the first epoch, after 2 of its 4 batches
        for path in run.glob("*.ckpt"):
            pos = torch.load(path, weights_only=True)["position"]
            if pos is not None and pos["batches_done"] == 2:
                return path
        raise AssertionError("no mid-epoch snapshot after 2 batches")
    return run / "train-loss.latest.ckpt"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Per configuration: the file (a sharded folder's `checkpoint.pt`) as a dict, and the folder to copy."""
    out = {}
    for config in CONFIGS:
        path = _written(config, tmp_path_factory.mktemp(config))
        side = path / checkpoint.shard_storage.SIDE_CAR if path.is_dir() else path
        out[config] = (torch.load(side, weights_only=True), path)
    return out


def _leaves(obj, path=()):
    """The paths of every leaf of a loaded file (long lists of numbers: their first two and last items)."""
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        indices = range(len(obj))
        if len(obj) > 8 and all(not isinstance(v, (Mapping, list, tuple)) for v in obj):
            indices = (0, 1, len(obj) - 1)
        for i in indices:
            yield from _leaves(obj[i], (*path, i))
    else:
        yield path


def _set(obj, path, value):
    if len(path) == 1:
        if isinstance(obj, tuple):
            return (*obj[:path[0]], value, *obj[path[0] + 1:])
        obj[path[0]] = value
        return obj
    inner = _set(obj[path[0]], path[1:], value)
    if isinstance(obj, tuple):
        return (*obj[:path[0]], inner, *obj[path[0] + 1:])
    obj[path[0]] = inner
    return obj


def _replacements(leaf):
    plain = [None, -1, 2**62, "x", math.nan, math.inf, [], {}, True]
    if isinstance(leaf, torch.Tensor):
        nan = torch.full_like(leaf, math.nan) if leaf.is_floating_point() else torch.zeros(7)
        return [*plain, torch.tensor(0.0), torch.zeros(7), nan]
    return plain


def _state(trainer) -> tuple:
    """What a refused load must leave as it was: weights, optimizer and scheduler states, counters, monitors."""
    return (copy.deepcopy(trainer.raw_model.state_dict()), copy.deepcopy(trainer.opt.state_dict()),
            trainer.loop.completed_epochs, trainer.loop.epoch,
            [copy.deepcopy(m.state_dict()) for m in checkpoint.monitors_of(trainer)], copy.deepcopy(trainer.history))


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _place(config, data, source: Path, folder: Path) -> Path:
    """The damaged `data` as the only checkpoint of run 'run' under `folder`."""
    run = folder / "run"
    run.mkdir(parents=True)
    if source.is_dir():
        target = run / source.name
        shutil.copytree(source, target)
        torch.save(data, target / checkpoint.shard_storage.SIDE_CAR)
        return target
    target = run / source.name
    torch.save(data, target)
    return target


def _outcome(config, data, source) -> str:
    """'refused' or 'loaded'; fails the test on any other outcome."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path = _place(config, data, source, folder)
        trainer = _trainer(config, folder / "direct")
        before = _state(trainer)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                trainer.load_checkpoint(path)
                refused = False
            except CheckpointError as e:
                assert str(path) in str(e), f"the message names the file: {e}"
                refused = True
            if refused:
                assert _equal(_state(trainer), before), "a refused load changed the trainer"
            else:
                trainer.fit(regression_batches())
                assert trainer.loop.completed_epochs >= EPOCHS
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resumed = _trainer(config, folder, resume=True)
            records = resumed.fit(regression_batches())
        skipped = [w for w in caught if f"skipped {path}" in str(w.message)]
        if refused:
            assert skipped, f"resume=True did not say it skipped {path}"
            assert resumed.loop.completed_epochs == EPOCHS and len(records["train"]["loss"]) == EPOCHS
        else:
            assert not skipped and resumed.loop.completed_epochs >= EPOCHS
        return "refused" if refused else "loaded"


@pytest.mark.parametrize("config", list(CONFIGS))
def test_every_damaged_leaf_is_refused_unchanged_or_loads_and_trains_to_the_end(written, config):
    """Hypothesis damages one leaf of a real checkpoint of `config`: the outcome is a refusal (trainer
    unchanged; resume=True skips the file with a warning and trains afresh) or a load after which fit
    trains to its epoch target, on both routes."""
    data, source = written[config]
    leaves = list(_leaves(data))

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(st.data())
    def damaged(draw):
        path = draw.draw(st.sampled_from(leaves), label="leaf")
        leaf = data
        for key in path:
            leaf = leaf[key]
        value = draw.draw(st.sampled_from(_replacements(leaf)), label="replacement")
        _outcome(config, _set(copy.deepcopy(data), path, value), source)

    damaged()
