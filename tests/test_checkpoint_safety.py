"""Loading a checkpoint never runs code from the file
unless the caller says it trusts the file; a truncated file says so; loading is all or nothing; names that
become paths are validated; temporary files of killed saves are cleaned up at the next save or resume."""

import errno
import io
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from checkpoint_helpers import monitored_trainer, regression_batches  # tests/, on sys.path under pytest
from torch import nn

import deepepochs.checkpoint as ckpt_mod
import deepepochs.checkpoint.write as ckpt_write
from deepepochs import CheckpointError, ConfigError, Trainer
from deepepochs.checkpoint import archive
from deepepochs.errors import DeepEpochsWarning


class Payload:
    """Unpickling this creates `marker`: the stand-in for code a crafted file would run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class CustomState:
    """An object a custom scheduler might keep in its state: harmless, but not plain data."""

    def __init__(self, value):
        self.value = value


def _trainer(tmp_path, **kwargs):
    """A one-epoch trainer of a linear model with SGD, its monitor saving under `tmp_path / 'ckpt'`."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return monitored_trainer(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def _saved_checkpoint(tmp_path):
    """A real checkpoint written by a one-epoch fit, and its contents."""
    t = _trainer(tmp_path, running_id="run")
    t.fit(regression_batches())
    t.close()
    path = next((tmp_path / "ckpt" / "run").glob("*.ckpt"))
    return path, torch.load(path, weights_only=True)


def test_resume_refuses_a_crafted_file_without_running_its_code(tmp_path):
    """A pickle that would run code, named like a checkpoint in the run folder: resume='<run>' raises
    CheckpointError naming the file and the type; resume=True skips it with a warning saying the same
    and resumes from the older good file (a foreign file never stops fit); the code never ran."""
    path, _ = _saved_checkpoint(tmp_path)
    marker = tmp_path / "code-ran"
    evil = path.with_name("zzz-newest.ckpt")
    torch.save({"format_version": 1, "model": Payload(marker)}, evil)
    os.utime(evil, (path.stat().st_mtime + 10,) * 2)  # the newest file: the one resume picks
    t = _trainer(tmp_path, resume="run")
    with pytest.raises(CheckpointError, match=r"zzz-newest\.ckpt holds an object of type io\.open.*trusted=True"):
        t.fit(regression_batches())
    t = _trainer(tmp_path, resume=True)
    with pytest.warns(DeepEpochsWarning, match=r"skipped .*zzz-newest\.ckpt: .*holds an object of type io\.open"):
        t.fit(regression_batches())
    assert t.running_id == "run" and t.loop.completed_epochs == 1  # the good file was loaded
    assert not marker.exists()


def test_a_trusted_file_is_loaded_only_when_the_caller_says_so(tmp_path):
    """A checkpoint with a non-plain object in a scheduler state is refused by default and loads with
    load_checkpoint(path, trusted=True)."""
    path, data = _saved_checkpoint(tmp_path)
    data["schedulers"] = [None]
    data["monitors"] = {**data["monitors"], "extra": {"custom": CustomState(3)}}
    legacy = tmp_path / "legacy.ckpt"
    torch.save(data, legacy)
    t = _trainer(tmp_path)
    with pytest.raises(CheckpointError, match=r"legacy\.ckpt holds an object of type [\w.]*CustomState"):
        t.load_checkpoint(legacy)
    ckpt = t.load_checkpoint(legacy, trusted=True).last_checkpoint
    assert ckpt.monitors["extra"]["custom"].value == 3
    assert t.loop.completed_epochs == 1
    for p, q in zip(t.raw_model.state_dict().values(), data["model"].values()):
        assert torch.equal(p, q)


def test_a_truncated_file_is_reported_as_truncated_or_corrupt(tmp_path):
    """Half a checkpoint file: the error names the path and says truncated or corrupt."""
    path, _ = _saved_checkpoint(tmp_path)
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"cut\.ckpt: the file is truncated or corrupt"):
        _trainer(tmp_path).load_checkpoint(cut)


@pytest.mark.parametrize("name", ["../escape", "a/b", "/abs", "..", ".", "", "a\\b"])
def test_a_running_id_or_resume_that_would_leave_the_folder_is_refused(tmp_path, name):
    """running_id and resume='<id>' become folder names: separators, '..' and absolute paths are refused."""
    with pytest.raises(ConfigError, match=r"running_id must be a plain folder name .*got"):
        _trainer(tmp_path, running_id=name)
    with pytest.raises(ConfigError, match=r"resume must be a plain folder name"):
        _trainer(tmp_path, resume=name)
    assert not (tmp_path / "escape").exists()


@pytest.mark.parametrize(("name", "message"), [
    ("r" * 256, r"running_id must be at most 255 bytes long, a folder name's limit \(got 256 bytes"),
    ("\u00e9" * 128, r"running_id must be at most 255 bytes long, a folder name's limit \(got 256 bytes"),
    ("run\n2", r"running_id must hold printable characters only: .*'\\n'"),
    ("run\x7f", r"running_id must hold printable characters only"),
    ("\ud800", r"running_id holds characters this file system cannot store"),
    (2.5, r"running_id must be a str \(or an int\).*\(got float\)"),
    (["run"], r"running_id must be a str \(or an int\).*\(got list\)"),
])
def test_a_running_id_the_file_system_would_refuse_is_refused_at_construction(tmp_path, name, message):
    """A run name longer than a folder name may be, with control characters, one the file system cannot
    encode, or not a string: ConfigError when the Trainer is made, not an OSError at the first save."""
    with pytest.raises(ConfigError, match=message):
        _trainer(tmp_path, running_id=name)
    assert not (tmp_path / "ckpt").exists()


def test_the_longest_running_id_a_folder_takes_trains_and_saves(tmp_path):
    """255 bytes is a folder name's limit on the usual file systems: such a run saves and resumes."""
    name = "r" * 255
    trainer = _trainer(tmp_path, running_id=name)
    trainer.fit(regression_batches())
    assert (tmp_path / "ckpt" / name / "train-loss.latest.ckpt").is_file()
    again = _trainer(tmp_path, running_id=name, resume=True, epochs=2)
    again.fit(regression_batches())
    assert again.loop.completed_epochs == 2


def _dead_pid():
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_temporary_files_of_killed_saves_are_removed_at_the_next_save(tmp_path):
    """A kill -9 mid-save leaves `.name.<pid>-<hex>.tmp`; the next save in that folder removes it when its
    writer no longer runs, keeps one whose writer is alive, and touches no other file."""
    path, _ = _saved_checkpoint(tmp_path)
    folder = path.parent
    stale = folder / f".{path.name}.{_dead_pid()}-0123abcd.tmp"
    live = folder / f".{path.name}.{os.getpid()}-89abcdef.tmp"
    other = folder / "notes.tmp"
    for f in (stale, live, other):
        f.write_bytes(b"x" * 1000)
    ckpt_mod.write_atomic({"x": torch.zeros(1)}, folder / "another.ckpt")
    assert not stale.exists() and live.exists() and other.exists()


def test_a_write_over_a_retired_file_reuses_it_and_keeps_nothing_of_it(tmp_path):
    """`retire` takes a checkpoint out of sight (a temporary name of this process); `write_atomic(spare=...)` writes
    over that file in place (the same inode: its blocks are reused), cut to the new length: it equals a fresh
    write of the same data in size and content, and passes the archive checks."""
    old = ckpt_mod.write_atomic({"w": torch.randn(10_000)}, tmp_path / "old.ckpt")
    inode = old.stat().st_ino
    spare = ckpt_mod.retire(old)
    assert not old.exists() and spare.name.startswith(".old.ckpt.") and spare.suffix == ".tmp"
    small = {"w": torch.arange(10.0)}
    new = ckpt_mod.write_atomic(small, tmp_path / "new.ckpt", spare=spare)
    fresh = ckpt_mod.write_atomic(small, tmp_path / "fresh.ckpt")
    assert new.stat().st_ino == inode and not spare.exists()
    assert new.stat().st_size == fresh.stat().st_size
    archive.check_archive(new)
    assert torch.equal(torch.load(new, weights_only=True)["w"], small["w"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh.ckpt", "new.ckpt"]


def test_a_failed_write_over_a_retired_file_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path, before = _saved_checkpoint(tmp_path)
    spare = ckpt_mod.retire(ckpt_mod.write_atomic({"w": torch.zeros(100)}, path.parent / "pruned.ckpt"))
    monkeypatch.setattr(ckpt_write, "open", lambda file, mode: io.BufferedWriter(_FullDisk(64), 64), raising=False)
    with pytest.raises(CheckpointError, match="no space left on the device"):
        ckpt_mod.write_atomic({"model": {"w": torch.zeros(10_000)}}, path, spare=spare)
    assert torch.load(path, weights_only=True)["epoch"] == before["epoch"]
    assert not spare.exists() and not list(path.parent.glob(".*"))


def test_temporary_files_of_killed_saves_are_removed_at_resume(tmp_path):
    """resume=True cleans the run folder it resumes from the same way."""
    path, _ = _saved_checkpoint(tmp_path)
    stale = path.parent / f".{path.name}.{_dead_pid()}-0123abcd.tmp"
    stale.write_bytes(b"x")
    t = _trainer(tmp_path, resume=True)
    t.fit(regression_batches(), epochs=2)
    assert not stale.exists() and t.loop.completed_epochs == 2


# ---- loading is all or nothing -----------------------------------------------------------------------------
def _state(t):
    """Everything a load could change: weights, optimizer state, scheduler state, epoch count."""
    return ({k: v.clone() for k, v in t.raw_model.state_dict().items()},
            repr(t.opt[0].opt.state_dict()), None if t.opt[0].scheduler is None else t.opt[0].scheduler.state_dict(),
            t.loop.completed_epochs)


def _assert_unchanged(t, before):
    weights, opt, sched, epochs = _state(t)
    assert all(torch.equal(weights[k], before[0][k]) for k in weights)
    assert (opt, sched, epochs) == before[1:]


def test_a_checkpoint_of_another_layer_shape_changes_nothing(tmp_path):
    """A file whose second layer has another width is refused naming the key and both shapes, and the
    trainer's weights and optimizer are untouched (the first layer, whose shape matches, too)."""
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    src = Trainer(wide, F.mse_loss, torch.optim.SGD(wide.parameters(), lr=0.1), epochs=1, device="cpu",
                  log_batch=False, show_info=False)
    path = tmp_path / "wide.ckpt"
    ckpt_mod.write_atomic(ckpt_mod.snapshot(src).to_dict(), path)
    torch.manual_seed(1)
    narrow = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
    t = Trainer(narrow, F.mse_loss, torch.optim.SGD(narrow.parameters(), lr=0.1), epochs=1, device="cpu",
                log_batch=False, show_info=False)
    before = _state(t)
    with pytest.raises(CheckpointError, match=r"nothing was loaded: .*model 1\.weight: shape \(3, 8\) in the file,"
                                              r" \(1, 8\) in the model"):
        t.load_checkpoint(path)
    _assert_unchanged(t, before)


def test_an_sgd_checkpoint_loaded_into_an_adam_trainer_is_refused_at_load_time(tmp_path):
    """SGD with momentum into Adam: CheckpointError naming the optimizer kinds at load, not a KeyError at
    the first step; nothing changed, and the trainer still trains."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    sgd = Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), epochs=1,
                  device="cpu", log_batch=False, show_info=False)
    sgd.fit(regression_batches())
    path = ckpt_mod.write_atomic(ckpt_mod.snapshot(sgd).to_dict(), tmp_path / "sgd.ckpt")
    torch.manual_seed(1)
    other = nn.Linear(4, 1)
    t = Trainer(other, F.mse_loss, torch.optim.Adam(other.parameters(), lr=0.1), epochs=1, device="cpu",
                log_batch=False, show_info=False)
    t.fit(regression_batches())
    before = _state(t)
    with pytest.raises(CheckpointError, match=r"optimizer 0 is Adam, but the file holds another optimizer's state"):
        t.load_checkpoint(path)
    _assert_unchanged(t, before)
    t.fit(regression_batches(), epochs=2)
    assert t.loop.completed_epochs == 2


def test_another_scheduler_kind_or_optimizer_count_is_refused_before_anything_changes(tmp_path):
    """A StepLR checkpoint into a trainer with CosineAnnealingLR, and a one-optimizer file into a
    two-optimizer trainer: each names the mismatch; the trainer is unchanged."""
    from deepepochs import Optimizer

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    src = Trainer(model, F.mse_loss, Optimizer(opt, torch.optim.lr_scheduler.StepLR(opt, 2)), epochs=1,
                  device="cpu", log_batch=False, show_info=False)
    path = ckpt_mod.write_atomic(ckpt_mod.snapshot(src).to_dict(), tmp_path / "step.ckpt")
    torch.manual_seed(1)
    model2 = nn.Linear(4, 1)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    t = Trainer(model2, F.mse_loss, Optimizer(opt2, torch.optim.lr_scheduler.CosineAnnealingLR(opt2, 5)),
                epochs=1, device="cpu", log_batch=False, show_info=False)
    before = _state(t)
    with pytest.raises(CheckpointError, match=r"scheduler 0 is CosineAnnealingLR, but the file holds another"):
        t.load_checkpoint(path)
    _assert_unchanged(t, before)
    model3 = nn.Sequential(nn.Linear(4, 1))
    two = Trainer(model3, F.mse_loss, [torch.optim.SGD(model3.parameters(), lr=0.1),
                                       torch.optim.SGD(model3.parameters(), lr=0.2)],
                  epochs=1, device="cpu", log_batch=False, show_info=False)
    data = torch.load(path, weights_only=True)
    data["model"] = {"0." + k: v for k, v in data["model"].items()}
    other = ckpt_mod.write_atomic(data, tmp_path / "one-opt.ckpt")
    with pytest.raises(CheckpointError, match=r"1 optimizer state\(s\) in the file, 2 optimizer\(s\) in the trainer"):
        two.load_checkpoint(other)


@pytest.mark.parametrize("damage", ["monitor", "scaler"])
def test_a_damaged_monitor_or_scaler_state_leaves_everything_as_it_was(tmp_path, damage):
    """A monitor state whose patience counter is not a number, a scaler state of the wrong type: the field
    rules refuse them with CheckpointError naming the field and the type found, and the weights, optimizer,
    monitor and epoch count are those from before the load."""
    path, data = _saved_checkpoint(tmp_path)
    if damage == "monitor":
        (state,) = data["monitors"].values()
        state["bad_epochs"] = "many"
    else:
        data["scaler"] = {"scale": "big"}
    ckpt_mod.write_atomic(data, path)
    t = _trainer(tmp_path, precision="fp16" if damage == "scaler" else "fp32")
    torch.manual_seed(5)
    with torch.no_grad():
        for p in t.raw_model.parameters():
            p.normal_()
    t.fit(regression_batches())
    before = _state(t)
    monitor = t.callbacks[0] if hasattr(t.callbacks[0], "monitor_id") else None
    monitor_before = None if monitor is None else dict(monitor.state_dict())
    field = (r"monitors\['train-loss.latest'\]\['bad_epochs'\] must be an int \(got str 'many'\)" if damage == "monitor"
             else r"scaler must have the keys .*\(got \['scale'\]\)")
    with pytest.raises(CheckpointError, match=r"nothing was loaded: " + field):
        t.load_checkpoint(path)
    _assert_unchanged(t, before)
    if monitor is not None:
        assert monitor.state_dict() == monitor_before
    t.close()


class _FullDisk(io.RawIOBase):
    """A file on a disk that fills up after `room` bytes: writes beyond fail with ENOSPC, as the OS does."""

    def __init__(self, room):
        self.room = room

    def writable(self):
        return True

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return len(data)


def test_a_save_on_a_full_disk_says_no_space_is_left_and_keeps_the_previous_file(tmp_path, monkeypatch):
    """torch reports the failed write as an 'enforce fail ... unexpected pos'; the error names the cause."""
    path, before = _saved_checkpoint(tmp_path)
    monkeypatch.setattr(ckpt_write, "open", lambda file, mode: io.BufferedWriter(_FullDisk(64), 64), raising=False)
    with pytest.raises(CheckpointError) as info:
        ckpt_mod.write_atomic({"model": {"w": torch.zeros(10_000)}}, path)
    message = str(info.value)
    assert f"writing checkpoint {path} failed (no space left on the device (ENOSPC))" in message
    assert "enforce fail" not in message
    assert torch.load(path, weights_only=True)["epoch"] == before["epoch"]


@pytest.mark.skipif(os.name == "nt", reason="POSIX file size limits")
def test_a_save_beyond_the_file_size_limit_says_the_file_is_too_large(tmp_path):
    """A real limit (RLIMIT_FSIZE, EFBIG) in a child process: the error says so, with the path."""
    code = (
        "import resource, signal, torch\n"
        "from deepepochs import checkpoint\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "try:\n"
        f"    checkpoint.write_atomic({{'w': torch.zeros(100_000)}}, {str(tmp_path / 'big.ckpt')!r})\n"
        "except checkpoint.CheckpointError as e:\n"
        "    print(e)\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert f"writing checkpoint {tmp_path / 'big.ckpt'} failed (the file is too large" in out.stdout, out.stderr
    assert not (tmp_path / "big.ckpt").exists() and not list(tmp_path.iterdir())
