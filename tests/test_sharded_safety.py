"""SEC-4: sharded checkpoint folders (the form `strategy='fsdp'` saves) never run code from their files, never
send a read outside the folder, never remove a user's files, and a damaged one never blocks `resume=True`.

The folders are real: a one-process trainer writes one through the sharded save path (its policy told it
holds shards, so `checkpoint.save` writes `checkpoint.pt` plus DCP shards, as every FSDP rank does), and
the tests damage or craft files inside it. References are the files themselves and plain PyTorch loads.
"""

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from deepepochs import CheckCallback, CheckpointError, Trainer, checkpoint, sharded
from deepepochs.errors import DeepEpochsWarning


def _trainer(tmp_path, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    return Trainer(model, F.mse_loss, torch.optim.Adam(model.parameters(), lr=0.05), epochs=1, device="cpu",
                   log_batch=False, show_info=False,
                   callbacks=[CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=tmp_path / "ckpt")],
                   **kwargs)


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    return [(x[i:i + 8], x[i:i + 8].sum(1, keepdim=True)) for i in range(0, 32, 8)]


def _save_sharded(trainer, path):
    """Write `trainer`'s state as a sharded checkpoint folder `path`, through the path FSDP ranks take."""
    trainer._dist.shards_model = True  # what FSDP's policy says; one process writes the only shard
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
            checkpoint.save(trainer, path)
    finally:
        del trainer._dist.shards_model  # back to the class's False
    return path


def _sharded_run(tmp_path, epochs=(1,)):
    """A run folder `<ckpt_dir>/run/` with one sharded checkpoint per entry of `epochs` (older first, each
    written after training that many epochs), and the trainer's weights after each."""
    run = tmp_path / "ckpt" / "run"
    t = _trainer(tmp_path, running_id="run")
    weights, folders = [], []
    for done, name in zip(epochs, ("a", "b", "c")):
        t.fit(_data(), epochs=done)
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
        _trainer(tmp_path, resume=True).fit(_data())
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
