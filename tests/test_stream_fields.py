"""The fields a checkpoint holds about the training stream (the DataLoaders' generators, the stateful
datasets' states, a snapshot's data state and what its epoch drew from) are checked when the file is
loaded: a damaged one is refused there, naming the field, with the trainer unchanged, never at the next
fit."""

import copy

import pytest
import torch
from test_stream_resume import _data, _trainer

from deepepochs import SnapshotCallback
from deepepochs.errors import CheckpointError


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    """A mid-epoch snapshot (after 2 of epoch 2's updates) of a sampler with replacement and of a stateful
    IterableDataset, read back as dicts."""
    out = {}
    for kind in ("replacement", "stream"):
        folder = tmp_path_factory.mktemp(kind)
        trainer, _ = _trainer(1, [SnapshotCallback(folder, every_n_updates=1, keep=100)])
        trainer.fit(*_data(kind), epochs=2)
        trainer.close()
        out[kind] = torch.load(folder / "run" / "snapshot-u000000011.ckpt", weights_only=True)
    return out


def _run(snapshot):
    return snapshot["position"]["ranks"][0]["run"]


DAMAGES = {  # name: (stream, how the file is damaged, the field the refusal names)
    "a loader generator's state of another size": (
        "replacement", lambda s: s["rng"]["loaders"].__setitem__(0, torch.zeros(7, dtype=torch.uint8)),
        r"rng\['loaders'\] must be a list of the training DataLoaders' generator states"),
    "a loader generator's state that is not a tensor": (
        "replacement", lambda s: s["rng"].__setitem__("loaders", [3]), r"rng\['loaders'\]"),
    "a dataset's state that is not a dict": (
        "stream", lambda s: s["rng"].__setitem__("streams", ["x"]),
        r"rng\['streams'\] must be a list of the training datasets' state_dict\(\)"),
    "a snapshot's data state that is not a dict": (
        "stream", lambda s: s["position"]["ranks"][0].__setitem__("data", 5),
        r"position\['ranks'\]\[0\]\['data'\] must be None or the training data's state_dict\(\)"),
    "the epoch's sampler draw of another size": (
        "replacement", lambda s: _run(s)["order_draws"]["fields"].__setitem__("sampler", torch.zeros(3)),
        r"\['run'\]\['order_draws'\]\['sampler'\] must be a generator state"),
    "the epoch's draws in epoch 0": (
        "replacement", lambda s: _run(s)["order_draws"]["fields"].__setitem__("epoch", 0), r"\['order_draws'\]"),
    "a commit point's generator states of another kind": (
        "stream", lambda s: _run(s)["data_generators"]["__tuple__"].__setitem__(2, [torch.zeros(2)]),
        r"\['run'\]\['data_generators'\]\[2\]\[0\] must be a generator state"),
    "a stream's end at a negative batch": (
        "stream", lambda s: _run(s).__setitem__("data_ended", {"__tuple__": [2, 0, -1]}),
        r"\['run'\]\['data_ended'\]\[2\] must be an int in \[0, "),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_stream_field_is_refused_at_load_naming_it_with_the_trainer_unchanged(tmp_path, snapshots, damage):
    kind, change, message = DAMAGES[damage]
    data = copy.deepcopy(snapshots[kind])
    change(data)
    path = tmp_path / "damaged.ckpt"
    torch.save(data, path)
    trainer, (model, opt, _) = _trainer(1)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(CheckpointError, match=message) as info:
        trainer.load_checkpoint(path)
    assert str(path) in str(info.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert trainer.loop.completed_epochs == 0 and trainer.loop.resume is None


@pytest.mark.parametrize("kind", ["replacement", "stream"])
def test_the_same_files_undamaged_load(tmp_path, snapshots, kind):
    """The rules accept what a fit writes (the refusals above come from the damage)."""
    path = tmp_path / "whole.ckpt"
    torch.save(snapshots[kind], path)
    trainer, _ = _trainer(1)
    trainer.load_checkpoint(path)
    assert trainer.loop.completed_epochs == 1 and trainer.loop.resume.batches_done == 2
