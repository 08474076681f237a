"""Sharded checkpoint folders (the form `strategy='fsdp'` saves) never run code from their files, never
send a read outside the folder, never remove a user's files, and a damaged one never blocks `resume=True`.

The folders are real: a one-process trainer writes one through the sharded save path (its policy told it
holds shards, so `checkpoint.save` writes `checkpoint.pt` plus DCP shards, as every FSDP rank does), and
the tests damage or craft files inside it. References are the files themselves and plain PyTorch loads.
"""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from checkpoint_helpers import monitored_trainer, regression_batches  # tests/, on sys.path under pytest
from checkpoint_helpers import save_sharded as _save_sharded
from torch import nn

from deepepochs import CheckpointError, checkpoint
from deepepochs.checkpoint import shard_storage as sharded
from deepepochs.errors import DeepEpochsWarning


def _trainer(tmp_path, **kwargs):
    """A trainer of a small MLP with dropout and Adam, its monitor saving under `tmp_path / 'ckpt'`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Dropout(0.3), nn.Linear(3, 1))
    return monitored_trainer(tmp_path, model, torch.optim.Adam(model.parameters(), lr=0.05), **kwargs)


def _sharded_run(tmp_path, epochs=(1,)):
    """A run folder `<ckpt_dir>/run/` with one sharded checkpoint per entry of `epochs` (older first, each
    written after training that many epochs), and the trainer's weights after each."""
    run = tmp_path / "ckpt" / "run"
    t = _trainer(tmp_path, running_id="run")
    weights, folders = [], []
    for done, name in zip(epochs, ("a", "b", "c")):
        t.fit(regression_batches(), epochs=done)
        folders.append(_save_sharded(t, run / f"{name}.ckpt"))
        weights.append({k: v.clone() for k, v in t.raw_model.state_dict().items()})
        os.utime(folders[-1] / sharded.SIDE_CAR, ns=(10**18 + done * 10**9, 10**18 + done * 10**9))
    t.close()
    for p in run.iterdir():  # only the sharded folders: the monitor's own file is not what these tests read
        if p.is_file():
            p.unlink()
    return folders, weights


# ---- item: the metadata unpickler admits exact names only ------------------------------------------------
def _short_str(text: str) -> bytes:
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data  # SHORT_BINUNICODE


def _payload(module: str, name: str, *args: str) -> bytes:
    """A protocol-4 pickle calling `module`.`name`(*args) (STACK_GLOBAL + REDUCE), which resolves dotted names."""
    assert len(args) == 1
    return b"\x80\x04" + _short_str(module) + _short_str(name) + b"\x93" + _short_str(args[0]) + b"\x85R."


_DCP = "torch.distributed.checkpoint"
# a callable reached through every module the allow-list names, and through builtins, copyreg, functools
_CRAFTED = [
    (f"{_DCP}.metadata", "os.system", "touch {marker}"),
    (f"{_DCP}.metadata", "torch.load", "{marker}"),
    (f"{_DCP}.metadata", "dataclass", "{marker}"),
    (f"{_DCP}.filesystem", "os.system", "touch {marker}"),
    (f"{_DCP}.filesystem", "_StorageInfo.__init__.__globals__", "{marker}"),
    ("torch.serialization", "os.system", "touch {marker}"),
    ("torch.serialization", "_get_layout.__globals__", "{marker}"),
    ("torch", "os.system", "touch {marker}"),
    ("torch", "save", "{marker}"),
    ("torch", "float32.__class__", "{marker}"),
    ("collections", "_sys.exit", "{marker}"),
    ("collections", "OrderedDict.fromkeys", "{marker}"),
    ("pathlib", "os.system", "touch {marker}"),
    ("pathlib", "Path.touch", "{marker}"),
    ("builtins", "exec", "open({marker!r}, 'w').close()"),
    ("builtins", "open", "{marker}"),
    ("copyreg", "_reconstructor", "{marker}"),
    ("copyreg", "__newobj__", "{marker}"),
    ("functools", "partial", "{marker}"),
    ("functools", "reduce", "{marker}"),
]


@pytest.mark.parametrize(("module", "name", "arg"), _CRAFTED, ids=[f"{m}.{n}" for m, n, _ in _CRAFTED])
def test_shard_metadata_naming_any_other_callable_is_refused_before_it_runs(tmp_path, module, name, arg):
    """A crafted `.metadata` reaching a callable through an admitted module (dotted names), or naming one
    outright, is refused by reading the checkpoint; the marker file the call would create never appears."""
    (folder,), _ = _sharded_run(tmp_path)
    marker = tmp_path / "ran"
    (shards,) = [p for p in folder.iterdir() if p.is_dir()]
    (shards / ".metadata").write_bytes(_payload(module, name, arg.format(marker=str(marker))))
    with pytest.raises(CheckpointError, match=rf"refers to {module}\.{name}"):
        checkpoint.read_checkpoint(folder)
    assert not marker.exists()


def test_a_crafted_metadata_runs_nothing_through_load_checkpoint_resume_or_consolidate(tmp_path):
    """The os.system payload reached through DCP's metadata module, on each way a folder is read."""
    (folder,), _ = _sharded_run(tmp_path)
    marker = tmp_path / "ran"
    (shards,) = [p for p in folder.iterdir() if p.is_dir()]
    (shards / ".metadata").write_bytes(_payload(f"{_DCP}.metadata", "os.system", f"touch {marker}"))
    t = _trainer(tmp_path)
    with pytest.raises(CheckpointError, match=r"refers to torch\.distributed\.checkpoint\.metadata\.os\.system"):
        t.load_checkpoint(folder)
    with pytest.warns(DeepEpochsWarning, match="refers to .*os.system"):
        _trainer(tmp_path, resume=True).fit(regression_batches())
    command = [sys.executable, "-m", "deepepochs", "consolidate", str(folder), str(tmp_path / "one.ckpt")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "os.system" in result.stderr, result.stderr
    assert not marker.exists()


def test_the_metadata_of_a_real_sharded_save_is_still_admitted(tmp_path):
    """The allow-list admits everything DCP writes: the folder reads back into the saved weights."""
    (folder,), (weights,) = _sharded_run(tmp_path)
    t = _trainer(tmp_path)
    t.load_checkpoint(folder)
    for key, value in weights.items():
        assert torch.equal(t.raw_model.state_dict()[key], value), key


# ---- a damaged shard: skipped by resume=True, an error for an explicit path ------------------------------
def _shard_file(folder):
    (shards,) = [p for p in folder.iterdir() if p.is_dir()]
    return shards / "__0_0.distcp"


def _missing(file):
    file.unlink()


def _truncated(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _overwritten(file):  # same size, garbage inside: only reading the tensors finds it
    file.write_bytes(bytes(range(256)) * (file.stat().st_size // 256) + b"x" * (file.stat().st_size % 256))


@pytest.mark.parametrize("damage", [_missing, _truncated, _overwritten])
def test_resume_true_skips_a_newest_folder_with_a_damaged_shard_and_continues_from_the_older_one(tmp_path, damage):
    """The newest folder (epoch 2) has its shard missing, truncated or overwritten: resume=True warns naming
    it, loads the epoch-1 folder and trains epoch 2 again, ending with the uninterrupted run's weights."""
    (older, newest), weights = _sharded_run(tmp_path, epochs=(1, 2))
    damage(_shard_file(newest))
    t = _trainer(tmp_path, resume=True, epochs=2)
    with pytest.warns(DeepEpochsWarning, match=rf"skipped {newest}.*shard"):
        t.fit(regression_batches())
    assert t.running_id == "run"
    for key, value in weights[1].items():
        assert torch.equal(t.raw_model.state_dict()[key], value), key


@pytest.mark.parametrize(("damage", "message"), [(_missing, "incomplete: its shard file __0_0.distcp is missing"),
                                                 (_truncated, "damaged: its shard file __0_0.distcp holds"),
                                                 (_overwritten, "cannot read the shards")])
def test_loading_a_folder_with_a_damaged_shard_by_path_is_an_error_that_changes_nothing(tmp_path, damage, message):
    (folder,), _ = _sharded_run(tmp_path)
    damage(_shard_file(folder))
    t = _trainer(tmp_path)
    before = {k: v.clone() for k, v in t.raw_model.state_dict().items()}
    with pytest.raises(CheckpointError, match=message):
        t.load_checkpoint(folder)
    for key, value in before.items():
        assert torch.equal(t.raw_model.state_dict()[key], value), key


# ---- shard paths stay inside the checkpoint folder ---------------------------------------------------------
def _rewrite_side_car(path, **changes):
    data = torch.load(path / sharded.SIDE_CAR, weights_only=True)
    data["shards"] = {**data["shards"], **changes}
    torch.save(data, path / sharded.SIDE_CAR)


@pytest.mark.parametrize("name", ["..", ".", "", "../a.ckpt", "sub/shards-x", "/tmp"])
def test_a_shard_folder_name_leading_out_of_the_checkpoint_folder_is_refused(tmp_path, name):
    """checkpoint.pt naming '..' (where a copy of real shards waits) or any path: refused, nothing loaded."""
    (folder,), _ = _sharded_run(tmp_path)
    (shards,) = [p for p in folder.iterdir() if p.is_dir()]
    for file in shards.iterdir():  # real shards outside the checkpoint folder, so reading them would work
        shutil.copy(file, folder.parent / file.name)
    _rewrite_side_car(folder, folder=name)
    with pytest.raises(CheckpointError, match="does not name a folder inside"):
        _trainer(tmp_path).load_checkpoint(folder)


def test_a_shard_folder_that_is_a_link_to_outside_is_refused(tmp_path):
    (folder,), _ = _sharded_run(tmp_path)
    (shards,) = [p for p in folder.iterdir() if p.is_dir()]
    outside = shutil.move(shards, tmp_path / "elsewhere")
    (folder / shards.name).symlink_to(outside, target_is_directory=True)
    with pytest.raises(CheckpointError, match="no link leading out of it"):
        checkpoint.read_checkpoint(folder)


def test_shard_metadata_naming_a_file_outside_its_folder_is_refused(tmp_path):
    """DCP opens `<shard folder>/<relative_path>`: a metadata whose relative path leads out is refused."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: PLC0415 (what DCP itself writes)
    (folder,), _ = _sharded_run(tmp_path)
    (shards,) = [p for p in folder.iterdir() if p.is_dir()]
    metadata = sharded._reader(shards).read_metadata()
    shutil.copy(shards / "__0_0.distcp", folder.parent / "__0_0.distcp")
    metadata.storage_data = {k: _StorageInfo("../../__0_0.distcp", v.offset, v.length)
                             for k, v in metadata.storage_data.items()}
    metadata.storage_meta = None
    import pickle  # noqa: PLC0415
    (shards / ".metadata").write_bytes(pickle.dumps(metadata))
    (shards / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"names the shard file '\.\./\.\./__0_0\.distcp'"):
        _trainer(tmp_path).load_checkpoint(folder)


# ---- a save replaces a folder only when it is a complete sharded checkpoint holding nothing else -----------
def test_consolidate_refuses_a_target_folder_holding_other_files_and_leaves_it_intact(tmp_path):
    """TARGET holds a checkpoint.pt and a user's file: refused naming the file, both kept, exit status 2."""
    (folder,), _ = _sharded_run(tmp_path)
    target = tmp_path / "mine"
    target.mkdir()
    shutil.copy(folder / sharded.SIDE_CAR, target / sharded.SIDE_CAR)
    (target / "precious.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match=r"holds what no deepepochs save wrote there \(precious.txt\)"):
        checkpoint.consolidate(folder, target)
    command = [sys.executable, "-m", "deepepochs", "consolidate", str(folder), str(target)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "precious.txt" in result.stderr, result.stderr
    assert (target / "precious.txt").read_text() == "keep me" and (target / sharded.SIDE_CAR).is_file()


def test_a_file_save_refuses_an_empty_or_incomplete_folder_of_its_name(tmp_path):
    (folder,), _ = _sharded_run(tmp_path)
    (tmp_path / "empty.ckpt").mkdir()
    with pytest.raises(CheckpointError, match="not a complete sharded checkpoint"):
        checkpoint.consolidate(folder, tmp_path / "empty.ckpt")
    assert (tmp_path / "empty.ckpt").is_dir()


def test_consolidating_a_folder_onto_itself_or_a_complete_sharded_checkpoint_replaces_it(tmp_path):
    """The folders deepepochs wrote are still replaced: the file loads into the saved weights."""
    (older, newest), weights = _sharded_run(tmp_path, epochs=(1, 2))
    checkpoint.consolidate(newest, older)
    checkpoint.consolidate(newest, newest)
    for path in (older, newest):
        assert path.is_file()
        saved = torch.load(path, weights_only=True)["model"]
        for key, value in weights[1].items():
            assert torch.equal(saved[key], value), key


def test_a_sharded_save_refuses_to_write_into_a_folder_holding_other_files(tmp_path):
    """A user's folder with the checkpoint's name is neither written into nor cleaned of 'shards-' folders."""
    t = _trainer(tmp_path)
    target = tmp_path / "user.ckpt"
    (target / "shards-mine").mkdir(parents=True)
    (target / "shards-mine" / "notes.txt").write_text("keep me")
    (target / "data.csv").write_text("1,2")
    with pytest.raises(CheckpointError, match=r"\(data.csv, shards-mine/notes.txt\)"):
        _save_sharded(t, target)
    assert sorted(p.name for p in target.iterdir()) == ["data.csv", "shards-mine"]
    assert (target / "shards-mine" / "notes.txt").read_text() == "keep me"
    t.close()
