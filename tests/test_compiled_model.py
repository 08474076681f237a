"""A model given as `torch.compile(model)` is saved, snapshotted, sharded, consolidated and logged as the
module it wraps (keys without `_orig_mod.`), and files written either way load into either form.

torch.compile runs on the CPU (it needs a C compiler) but compiles slowly: one test trains compiled; the
others only build a trainer around the wrapper, which compiles nothing until a forward runs."""

from __future__ import annotations

import shutil

import pytest
import torch
from checkpoint_helpers import monitored_trainer, regression_batches  # tests/, on sys.path under pytest
from checkpoint_helpers import save_sharded as _save_sharded
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from deepepochs import LogCallback, SnapshotCallback, checkpoint


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))


def _keys():
    return set(_model().state_dict())


def _model_state(path):
    return torch.load(path, weights_only=True)["model"]


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on the CPU needs a C compiler")
def test_a_compiled_model_trains_like_the_eager_one_and_every_writer_keeps_the_modules_keys(tmp_path):
    """Trainer(torch.compile(model)) with a checkpoint monitor, mid-epoch snapshots and the model graph
    logged: the checkpoint's and the snapshots' keys are the module's (a plain module loads them strictly),
    the weights equal an eager run's, and the graph's layer names carry no `_orig_mod`."""
    eager = _model()
    with monitored_trainer(tmp_path / "eager", eager, torch.optim.SGD(eager.parameters(), lr=0.05)) as t:
        t.fit(regression_batches())
    module = _model()
    callbacks = [SnapshotCallback(tmp_path / "snaps", every_n_updates=2, on_signals=()),
                 LogCallback(tmp_path / "logs", log_graph=True)]
    with monitored_trainer(tmp_path, torch.compile(module), torch.optim.SGD(module.parameters(), lr=0.05),
                           running_id="run") as t:
        t.add_callbacks(callbacks)
        t.fit(regression_batches())
    [saved] = (tmp_path / "ckpt" / "run").glob("*.ckpt")
    snapshots = list((tmp_path / "snaps").rglob("snapshot-u*.ckpt"))
    assert snapshots
    for path in [saved, *snapshots]:
        assert set(_model_state(path)) == _keys(), path
    plain = _model()
    plain.load_state_dict(_model_state(saved))  # strict
    for key, value in eager.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[key], value)
        torch.testing.assert_close(module.state_dict()[key], value)
    ea = EventAccumulator(str(tmp_path / "logs" / "run"))
    ea.Reload()
    nodes = ea.Graph().node
    assert any(node.op == "aten::linear" for node in nodes)
    assert not [node.name for node in nodes if "_orig_mod" in node.name]


def _compiled_trainer(tmp_path, **kwargs):
    module = _model()
    return monitored_trainer(tmp_path, torch.compile(module), torch.optim.Adam(module.parameters(), lr=0.05),
                             **kwargs)


def test_a_compiled_models_checkpoint_file_carries_the_modules_keys(tmp_path):
    """checkpoint.save from a trainer of torch.compile(model) writes the module's keys; `raw_model` is it."""
    with _compiled_trainer(tmp_path) as t:
        assert set(_model_state(checkpoint.save(t, tmp_path / "a.ckpt"))) == _keys()
        assert type(t.raw_model) is nn.Sequential


def test_a_compiled_models_sharded_folder_and_its_consolidation_carry_the_modules_keys(tmp_path):
    """A sharded folder written from torch.compile(model) and the file consolidated from it hold the module's
    keys; a folder an older deepepochs wrote with the wrapper's keys consolidates to the module's too."""
    with _compiled_trainer(tmp_path) as t:
        folder = _save_sharded(t, tmp_path / "sharded.ckpt")
        assert set(checkpoint.read_checkpoint(folder).model) == _keys()
        assert set(_model_state(checkpoint.consolidate(folder, tmp_path / "one.ckpt"))) == _keys()
        wrapper = torch.compile(t.raw_model)
        module, t.raw_model = t.raw_model, wrapper  # how an older deepepochs held a compiled model
        try:
            old = _save_sharded(t, tmp_path / "old.ckpt")
        finally:
            t.raw_model = module
    assert all(k.startswith("_orig_mod.") for k in checkpoint.read_checkpoint(old).model)
    state = _model_state(checkpoint.consolidate(old, tmp_path / "old-one.ckpt"))
    assert set(state) == _keys()
    plain = _model()
    plain.load_state_dict(state)
    for key, value in module.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[key], value)


def test_files_written_with_either_keys_load_into_either_form(tmp_path):
    """A file with the module's keys loads into a trainer of torch.compile(model), and one with the
    wrapper's `_orig_mod.` keys (written by other code) into a trainer of the plain module."""
    source = _model()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
    with monitored_trainer(tmp_path, source, torch.optim.Adam(source.parameters(), lr=0.05)) as t:
        clean = checkpoint.save(t, tmp_path / "clean.ckpt")
    with _compiled_trainer(tmp_path) as t:
        t.load_checkpoint(clean)
        for key, value in source.state_dict().items():
            torch.testing.assert_close(t.raw_model.state_dict()[key], value)
    prefixed = torch.load(clean, weights_only=True)
    prefixed["model"] = {f"_orig_mod.{k}": v for k, v in prefixed["model"].items()}
    torch.save(prefixed, tmp_path / "prefixed.ckpt")
    plain = _model()
    with monitored_trainer(tmp_path, plain, torch.optim.Adam(plain.parameters(), lr=0.05)) as t:
        t.load_checkpoint(tmp_path / "prefixed.ckpt")
    for key, value in source.state_dict().items():
        torch.testing.assert_close(plain.state_dict()[key], value)
