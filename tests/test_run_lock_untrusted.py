"""The run lock file is untrusted input (`deepepochs.checkpoint.run_lock`): a `run.lock` that is a symbolic
or hard link, a directory or a file this user cannot write is refused with `RunLockedError` naming it (never
followed, never trained past unlocked); a holder record of any size, depth or content reads as a holder or
as an unknown one, never as a raw error; and `resume=True` without a `running_id` locks the run it loads.
"""

import json
import os
import shutil
import signal
import socket
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import CheckCallback, RunLockedError, Trainer
from deepepochs.checkpoint.run_lock import LOCK_FILE, RunLock
from deepepochs.errors import DeepEpochsWarning

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL") or os.name == "nt", reason="needs POSIX flock")


def _data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def _trainer(tmp_path, **kwargs):
    kwargs.setdefault("running_id", "run")
    return Trainer(nn.Linear(4, 2), F.cross_entropy, epochs=1, log_batch=False, show_info=False,
                   callbacks=[CheckCallback("loss", on_stage="train", ckpt_dir=tmp_path / "ckpt")], **kwargs)


def _lock_path(tmp_path, run="run") -> Path:
    folder = tmp_path / "ckpt" / run
    folder.mkdir(parents=True, exist_ok=True)
    return folder / LOCK_FILE


def _refused(trainer, pattern):
    """fit raises RunLockedError matching `pattern` and trains nothing."""
    with pytest.raises(RunLockedError, match=pattern):
        trainer.fit(_data())
    assert trainer.loop.completed_epochs == 0
    trainer.close()


def test_a_lock_file_that_is_a_symbolic_link_is_refused_and_its_target_left_alone(tmp_path):
    """The link is never followed: the file it points to keeps its contents, and fit names the link."""
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    path = _lock_path(tmp_path)
    path.symlink_to(target)
    _refused(_trainer(tmp_path), f"cannot lock the run folder .*: its lock file {path} is a symbolic link")
    assert target.read_text() == "keep me"
    assert path.is_symlink() and not list((tmp_path / "ckpt" / "run").glob("*.ckpt"))


def test_a_lock_file_that_is_a_hard_link_is_refused_and_the_other_file_left_alone(tmp_path):
    """A hard link is the user's file under a second name: fit names it and never writes its record there."""
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    path = _lock_path(tmp_path)
    os.link(target, path)
    _refused(_trainer(tmp_path), f"cannot lock the run folder .*: its lock file {path} has 2 links \\(a hard link")
    assert target.read_text() == "keep me" and path.read_text() == "keep me"
    assert not list((tmp_path / "ckpt" / "run").glob("*.ckpt"))


def test_a_lock_file_that_is_a_directory_is_refused(tmp_path):
    """A directory in the lock file's place cannot be locked: fit says so instead of training unlocked."""
    path = _lock_path(tmp_path)
    path.mkdir()
    _refused(_trainer(tmp_path), f"cannot lock the run folder .*: its lock file {path} is a directory")


def test_a_lock_file_this_user_cannot_write_is_refused():
    """A lock file another user owns, read-only to this one (checked as the unprivileged user `nobody` in
    a forked child when the tests run as root): refused naming it, never trained past unlocked."""
    base = Path(tempfile.mkdtemp(prefix="deepepochs-lock-"))  # in /tmp, which any user may enter
    try:
        folder = base / "run"
        folder.mkdir()
        path = folder / LOCK_FILE
        path.write_text("")
        path.chmod(0o444)
        os.chmod(base, 0o755)
        outcome = _in_child_as_nobody(lambda: RunLock([folder], "run").try_acquire(), [base, folder])
    finally:
        shutil.rmtree(base)
    assert outcome.startswith(f"RunLockedError: cannot lock the run folder {folder}: its lock file {path} cannot"
                              " be opened for writing by this user"), outcome


def _in_child_as_nobody(call, owned) -> str:
    """Run `call` in a forked child, as the user `nobody` (owning the folders `owned`) when this is root;
    returns 'returned' or the exception it raised, as text."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop privileges where needed, call, report, exit at once
        try:
            os.close(read)
            if os.geteuid() == 0:
                for p in owned:
                    os.chown(p, 65534, 65534)
                os.setgid(65534)
                os.setuid(65534)
            try:
                call()
                outcome = "returned"
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                outcome = f"{type(e).__name__}: {e}"
            os.write(write, outcome.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        outcome = pipe.read()
    os.waitpid(pid, 0)
    return outcome


@pytest.mark.parametrize("record", [b"[" * 100_000, b"{" * 3000, b"\xff\xfe", b"[1, 2]", b'{"pid": "7"}',
                                    json.dumps({"pid": 2 ** 70, "host": socket.gethostname()}).encode(),
                                    json.dumps({"pid": -1, "host": socket.gethostname()}).encode(),
                                    json.dumps({"pid": 5, "host": ["x"], "since": {"a": 1}}).encode()],
                         ids=["deep-lists", "deep-objects", "not-utf8", "a-list", "pid-text", "huge-pid",
                              "negative-pid", "odd-types"])
def test_a_malformed_holder_record_reads_as_an_unknown_holder(tmp_path, record):
    """While another descriptor holds the lock, any malformed record (deep, huge, wrong types, a pid no
    process can have) makes fit name an unknown holder; no RecursionError or OverflowError escapes."""
    path = _lock_path(tmp_path)
    other = RunLock([path.parent], "run")
    other.try_acquire()
    try:
        os.truncate(path, 0)
        path.write_bytes(record)
        _refused(_trainer(tmp_path), "run 'run' is being trained by another process: an unknown process")
    finally:
        other.release()


def test_a_deep_record_left_by_a_dead_holder_is_taken_over_and_the_lock_released(tmp_path):
    """A free lock file holding 100,000 '[' is taken over (its holder unknown), the fit trains, and its end
    releases and removes the lock: another process can lock the run again."""
    path = _lock_path(tmp_path)
    path.write_bytes(b"[" * 100_000)
    trainer = _trainer(tmp_path)
    trainer.fit(_data())
    trainer.close()
    assert trainer.loop.completed_epochs == 1 and not path.exists()
    again = RunLock([path.parent], "run")
    assert again.try_acquire() == (None, [])
    again.release()


def _two_runs(tmp_path):
    """Run 'old' with a usable checkpoint, then run 'new' whose only (newer) file is damaged: resume=True
    without a running_id skips 'new' and loads 'old'."""
    first = _trainer(tmp_path, running_id="old")
    first.fit(_data())
    first.close()
    damaged = tmp_path / "ckpt" / "new" / "train-loss.best.ckpt"
    damaged.parent.mkdir()
    damaged.write_bytes(b"not a checkpoint")
    os.utime(damaged, ns=(os.stat(damaged).st_mtime_ns + 10**9,) * 2)


def _resuming(tmp_path, epochs=2):
    return Trainer(nn.Linear(4, 2), F.cross_entropy, epochs=epochs, resume=True, log_batch=False, show_info=False,
                   callbacks=[CheckCallback("loss", on_stage="train", ckpt_dir=tmp_path / "ckpt")])


def test_resume_true_that_skips_the_newest_run_locks_the_run_it_loads(tmp_path):
    """The newest run's file is unusable and another process trains run 'old': the resume that would load
    'old' is refused naming it, instead of training 'old' under the lock of 'new'."""
    _two_runs(tmp_path)
    other = RunLock([tmp_path / "ckpt" / "old"], "old")
    other.try_acquire()
    try:
        trainer = _resuming(tmp_path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeepEpochsWarning)
            _refused(trainer, "run 'old' is being trained by another process")
    finally:
        other.release()


def test_resume_true_holds_the_lock_of_the_run_it_loaded_while_it_trains(tmp_path):
    """Free runs: the resume loads 'old' and, while training, holds old/run.lock and not new/run.lock."""
    _two_runs(tmp_path)
    seen = []

    class Look(CheckCallback):
        def on_before_epoch(self, trainer, *args):
            seen.append(sorted(p.parent.name for p in (tmp_path / "ckpt").glob(f"*/{LOCK_FILE}")))

    trainer = _resuming(tmp_path)
    trainer.add_callbacks([Look("loss", on_stage="train", save_best=False, ckpt_dir=tmp_path / "ckpt")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepEpochsWarning)
        trainer.fit(_data())
    trainer.close()
    assert trainer.running_id == "old" and trainer.loop.completed_epochs == 2
    assert seen == [["old"]]
    assert not list((tmp_path / "ckpt").glob(f"*/{LOCK_FILE}"))


def test_resume_true_finding_nothing_usable_locks_the_fresh_run_it_trains(tmp_path):
    """Only a damaged file: the fit starts its own run fresh, and that run, not the damaged one, is locked."""
    damaged = tmp_path / "ckpt" / "new" / "train-loss.best.ckpt"
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"not a checkpoint")
    trainer = _resuming(tmp_path, epochs=1)
    other = RunLock([tmp_path / "ckpt" / str(trainer.running_id)], str(trainer.running_id))
    other.try_acquire()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeepEpochsWarning)
            _refused(trainer, f"run '{trainer.running_id}' is being trained by another process")
    finally:
        other.release()
