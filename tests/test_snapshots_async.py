"""Snapshots written beside training (`SnapshotCallback(async_write=True)`), in one process: the files equal the
synchronous ones and resume bit-identically, training goes on while a file is written, a failed background
write is reported once and loses nothing else, and the fit's end waits for the last write. SIGKILL and SIGTERM
during background writes, in a process of their own, are in tests/preemption/test_preemption.py."""

from __future__ import annotations

import copy
import errno
import shutil
import threading
import time
import warnings

import pytest
import torch
from state_compare import plain_val_loss, states_equal  # tests/, on sys.path under pytest
from test_snapshots import _data, _equal, _fit, _last, _state, _trainer

from deepepochs import CheckCallback, ConfigError, SnapshotCallback
from deepepochs.checkpoint import background, read_checkpoint
from deepepochs.checkpoint import write as ckpt_write
from deepepochs.errors import DeepEpochsWarning


def _files(folder):
    return {p.name: read_checkpoint(p) for p in sorted((folder / "run").glob("snapshot-*.ckpt"))}


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """The same run with synchronous and with background snapshots at every update, all kept."""
    runs = {}
    for mode in (False, True):
        folder = tmp_path_factory.mktemp(f"async-{mode}")
        trainer, model = _trainer(folder, every_n_updates=1, keep=1000, async_write=mode)
        records = _fit(trainer)
        runs[mode] = folder, _state(trainer, model), records
    return runs


def test_background_snapshots_hold_what_synchronous_ones_hold(both):
    """Every file of the background run equals the synchronous run's file of that name, field by field."""
    sync, background_files = _files(both[False][0]), _files(both[True][0])
    assert list(background_files) == list(sync) and len(sync) == 21  # 18 updates and 3 epoch ends
    for name, ckpt in sync.items():
        other = background_files[name]
        for field in ("model", "optimizers", "schedulers", "rng", "position", "history", "updates", "carried"):
            assert states_equal(getattr(other, field), getattr(ckpt, field)), (name, field)
    assert _equal(both[True][1], both[False][1]) and both[True][2] == both[False][2]


def test_resuming_from_a_background_snapshot_ends_bit_identical(tmp_path, both):
    folder, state, records = both[True]
    (tmp_path / "run").mkdir()
    shutil.copy(folder / "run" / "snapshot-u000000008.ckpt", tmp_path / "run")
    trainer, model = _trainer(tmp_path, resume=True, every_n_updates=1, async_write=True)
    resumed = _fit(trainer)
    assert _equal(_state(trainer, model), state)
    assert _last(resumed) == _last(records)


def test_training_goes_on_while_a_snapshot_is_written(tmp_path):
    """Updates are made while a (slowed) background write runs; the next snapshot waits for it."""
    trainer, _ = _trainer(tmp_path, every_n_updates=4, async_write=True, epochs=1)
    snap = next(cb for cb in trainer.callbacks if isinstance(cb, SnapshotCallback))
    seen = []
    write = snap._writer._write

    def slow_write(data, path):
        start = trainer.loop.run.updates
        deadline = time.monotonic() + (30 if not seen else 0.3)
        while not seen and trainer.loop.run.updates == start and time.monotonic() < deadline:
            time.sleep(0.01)  # the first write (update 4 of 6) lasts until the loop made an update beside it
        time.sleep(0.3)
        seen.append((start, trainer.loop.run.updates, threading.current_thread() is threading.main_thread()))
        return write(data, path)

    snap._writer._write = slow_write
    _fit(trainer)
    assert seen and not any(main for _, _, main in seen)
    assert any(end > start for start, end, _ in seen), seen  # the loop trained while the file was written
    assert snap.waited_seconds > 0  # a snapshot due meanwhile waited for the write before it


def test_a_failed_background_write_warns_once_and_the_run_goes_on(tmp_path, monkeypatch, both):
    """A full disk during one background write: one warning naming the file and the reason, the files before it
    intact, the run's weights equal to the uninterrupted run's."""
    save = torch.save
    failing = "snapshot-u000000005.ckpt"

    def full_disk(obj, f, *args, **kwargs):
        if failing in getattr(f, "name", ""):
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    trainer, model = _trainer(tmp_path, every_n_updates=1, keep=1000, async_write=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(trainer)
    ours = [w for w in caught if issubclass(w.category, DeepEpochsWarning)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert failing in str(ours[0].message) and "no space left on the device" in str(ours[0].message)
    names = [p.name for p in sorted((tmp_path / "run").glob("snapshot-*.ckpt"))]
    assert failing not in names and "snapshot-u000000004.ckpt" in names
    assert read_checkpoint(tmp_path / "run" / "snapshot-u000000004.ckpt").updates == 4
    assert not list((tmp_path / "run").glob(".*.tmp"))
    assert _equal(_state(trainer, model), both[False][1])


@pytest.mark.parametrize("async_write", [False, True])
def test_snapshots_written_over_rotated_files_equal_fresh_ones(tmp_path, both, monkeypatch, async_write):
    """Rotation hands the file it prunes to the next snapshot, which is written over it (its blocks reused): with
    keep=2, every snapshot from the fourth on; the files kept equal the fresh files of the run that kept them all,
    and no hidden file is left once the fit has ended."""
    taken, take = [], ckpt_write._take_spare
    monkeypatch.setattr(ckpt_write, "_take_spare", lambda spare, temp: taken.append(take(spare, temp)) or taken[-1])
    trainer, _ = _trainer(tmp_path, every_n_updates=1, keep=2, async_write=async_write)
    _fit(trainer)
    assert taken.count(True) == 21 - 3
    kept, reference = _files(tmp_path), _files(both[False][0])
    assert len(kept) == 2 and set(kept) <= set(reference)
    for name, ckpt in kept.items():
        for field in ("model", "optimizers", "schedulers", "rng", "position", "history", "updates", "carried"):
            assert states_equal(getattr(ckpt, field), getattr(reference[name], field)), (name, field)
    assert not list((tmp_path / "run").glob(".*"))


def test_the_fit_returns_once_its_last_snapshot_is_on_disk(tmp_path):
    trainer, _ = _trainer(tmp_path, every_n_updates=None, async_write=True, epochs=1)
    snap = next(cb for cb in trainer.callbacks if isinstance(cb, SnapshotCallback))
    write = snap._writer._write
    snap._writer._write = lambda data, path: (time.sleep(0.3), write(data, path))
    _fit(trainer)
    assert snap._writer.in_flight is None
    assert (tmp_path / "run" / "snapshot-u000000006-epoch1.ckpt").is_file()


def test_host_copy_shares_no_storage_and_keeps_shared_tensors_shared():
    weight = torch.randn(3, 3)
    data = {"a": weight, "b": [weight, {"c": weight[0]}], "n": {"count": 1}}
    copied = background.host_copy(data)
    weight.add_(1)
    data["n"]["count"] = 2
    assert not torch.equal(copied["a"], weight) and copied["n"]["count"] == 1
    assert copied["a"] is copied["b"][0]


def test_host_copy_reuses_its_memory_for_the_same_tensors_and_allocates_for_changed_ones():
    """`HostCopy.take` copies into the buffers of the copy before when the tensors keep their kind; a tensor whose
    shape changed gets new memory; every copy holds the values of its own moment."""
    weight, bias = torch.randn(4, 3), torch.randn(4)
    host = background.HostCopy()
    first = host.take({"w": weight, "b": bias})
    pointers = (first["w"].data_ptr(), first["b"].data_ptr())
    weight.add_(1)
    second = host.take({"w": weight, "b": bias})
    assert (second["w"].data_ptr(), second["b"].data_ptr()) == pointers
    assert torch.equal(second["w"], weight) and second["w"].data_ptr() != weight.data_ptr()
    third = host.take({"w": weight, "b": torch.randn(5)})
    assert third["w"].data_ptr() == pointers[0] and third["b"].data_ptr() != pointers[1]
    assert third["b"].shape == (5,)


def test_a_write_in_flight_keeps_its_copy_while_the_next_snapshot_waits(tmp_path):
    """The writer copies the next state only once the write before it ended (the copies share memory): a slow
    first write still writes the state of its own moment, and the second file holds the changed state."""
    def slow_write(data, path):
        time.sleep(0.3)
        torch.save(dict(data), path)

    writer = background.BackgroundWriter(slow_write)
    weight = torch.zeros(1000)
    writer.submit({"w": weight}, tmp_path / "first.pt")
    weight.fill_(2)
    writer.submit({"w": weight}, tmp_path / "second.pt")
    assert writer.waited > 0.1
    assert writer.finish("test")
    assert torch.equal(torch.load(tmp_path / "first.pt")["w"], torch.zeros(1000))
    assert torch.equal(torch.load(tmp_path / "second.pt")["w"], torch.full((1000,), 2.0))


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_async_write_must_be_a_bool(tmp_path, value):
    with pytest.raises(ConfigError, match=r"SnapshotCallback async_write must be True or False \(got"):
        SnapshotCallback(tmp_path, async_write=value)


def test_async_write_shows_in_the_repr(tmp_path):
    assert "async_write=True" in repr(SnapshotCallback(tmp_path, async_write=True))



def _checked(folder, async_write, slow=0.0):
    check = CheckCallback("loss", save_best=False, ckpt_dir=folder, async_write=async_write)
    trainer, model = _trainer(None, callbacks=[check])
    if slow:
        write = check._writer._write
        check._writer._write = lambda data, path: (time.sleep(slow), write(data, path))
    return trainer, check


@pytest.mark.filterwarnings("ignore::deepepochs.errors.MigrationWarning")
def test_check_callback_files_written_in_the_background_equal_synchronous_ones(tmp_path):
    """`CheckCallback(async_write=True)`: the latest file equals the synchronous run's, and `test()` evaluates
    it complete although its (slowed) write was still in flight when the fit's last epoch ended."""
    files = {}
    for mode in (False, True):
        trainer, check = _checked(tmp_path / str(mode), mode, slow=0.3 if mode else 0.0)
        train, val = _data()
        _fit(trainer)
        tested = trainer.test(val)["loss"]  # waits for the file in flight, then evaluates it
        files[mode] = read_checkpoint(check.path(trainer))
        reference = copy.deepcopy(trainer.raw_model)
        reference.load_state_dict(files[mode].model)
        assert tested == pytest.approx(plain_val_loss(reference, val), abs=1e-6)
    for field in ("model", "optimizers", "schedulers", "rng", "history", "updates"):
        assert states_equal(getattr(files[True], field), getattr(files[False], field)), field


def test_check_callback_async_write_must_be_a_bool(tmp_path):
    with pytest.raises(ConfigError, match=r"CheckCallback async_write must be True or False \(got 'no'\)"):
        CheckCallback("loss", ckpt_dir=tmp_path, async_write="no")
