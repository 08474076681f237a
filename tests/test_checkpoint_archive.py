"""Bounded reads: a file's zip directory is checked before torch.load reads anything (compressed records,
declared sizes past the file's end or beyond their kind, too many records, records torch.save never
writes), for checkpoints, sharded folders' checkpoint.pt, the run-end record and the command line; and a
refused pickle is named by its type."""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import zipfile

import pytest
import torch
from checkpoint_helpers import monitored_trainer, regression_batches, save_sharded
from torch import nn

from deepepochs.checkpoint import archive, shard_storage
from deepepochs.checkpoint.finished import FINISHED_FILE
from deepepochs.errors import CheckpointError, DeepEpochsWarning


def _trainer(tmp_path, **kwargs):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    return monitored_trainer(tmp_path, model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)


def _repacked(source, target, compress=zipfile.ZIP_STORED, extra=None):
    """`source`'s records written again into `target` (compressed, or with an extra record)."""
    with zipfile.ZipFile(source) as zin, zipfile.ZipFile(target, "w", compression=compress) as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))
        if extra is not None:
            zout.writestr(extra[0], extra[1])
    return target


@pytest.fixture
def saved(tmp_path):
    trainer = _trainer(tmp_path)
    trainer.fit(regression_batches())
    return tmp_path / "ckpt" / trainer.running_id / "train-loss.latest.ckpt"


def _no_torch_load(monkeypatch):
    """torch.load fails the test if called: a refused file must be refused before it is read."""
    def refuse(*args, **kwargs):
        raise AssertionError("torch.load was called on a file the zip check should have refused")
    monkeypatch.setattr(torch, "load", refuse)


def test_a_compressed_record_is_refused_before_torch_reads_anything(tmp_path, monkeypatch):
    """A state of 4,000,000 ones re-packed with deflate is a few kilobytes that would allocate 16 MB: refused
    naming the record, on load_checkpoint and on resume=True (skipped with a warning), without torch.load."""
    path = tmp_path / "bomb" / "run" / "x.ckpt"
    path.parent.mkdir(parents=True)
    plain = tmp_path / "plain.pt"
    torch.save({"format_version": 1, "epoch": 1, "model": {"weight": torch.ones(4_000_000)}}, plain)
    _repacked(plain, path, zipfile.ZIP_DEFLATED)
    assert path.stat().st_size < 100_000
    _no_torch_load(monkeypatch)
    with pytest.raises(CheckpointError, match=r"x\.ckpt: record '[\w/.]+' is compressed \(zip method 8\); torch\.save"
                                              r" stores records uncompressed"):
        _trainer(tmp_path).load_checkpoint(path)


def test_resume_true_skips_a_compressed_file_and_trains_afresh(tmp_path, saved):
    """resume=True with only a compressed checkpoint: a warning names it, and the run starts fresh."""
    _repacked(saved, saved.with_name("packed.tmp"), zipfile.ZIP_DEFLATED).replace(saved)
    trainer = _trainer(tmp_path, resume=True, running_id=saved.parent.name, epochs=2)
    with pytest.warns(DeepEpochsWarning, match=r"skipped .*train-loss\.latest\.ckpt: .*is compressed"):
        records = trainer.fit(regression_batches())
    assert len(records["train"]["loss"]) == 2


def _patched_size(data: bytes, record: str, size: int) -> bytes:
    """The archive `data` with `record`'s central-directory sizes (stored and declared) set to `size`."""
    name = record.encode()
    at = 0
    while True:
        at = data.index(b"PK\x01\x02", at)
        length = struct.unpack("<H", data[at + 28:at + 30])[0]
        if data[at + 46:at + 46 + length] == name:
            return data[:at + 20] + struct.pack("<II", size, size) + data[at + 28:]
        at += 4


def test_a_record_declaring_more_bytes_than_the_file_holds_is_refused(tmp_path, saved, monkeypatch):
    """A storage record whose directory entry declares 1 GB in a file of a few kilobytes: refused, naming
    the record and both sizes, before torch.load."""
    data = saved.read_bytes()
    record = next(n for n in zipfile.ZipFile(saved).namelist() if "/data/" in n)
    (tmp_path / "big.ckpt").write_bytes(_patched_size(data, record, 1 << 30))
    _no_torch_load(monkeypatch)
    with pytest.raises(CheckpointError, match=rf"big\.ckpt: record '{record}' declares {1 << 30} bytes at offset"
                                              r" \d+, past the end of the \d+-byte file"):
        _trainer(tmp_path).load_checkpoint(tmp_path / "big.ckpt")


def test_a_metadata_record_larger_than_its_kind_is_refused(tmp_path, saved):
    """torch.save's `byteorder` record holds a word; one of 10 kB is damage."""
    source = zipfile.ZipFile(saved)
    target = tmp_path / "odd.ckpt"
    with zipfile.ZipFile(target, "w") as out:
        for info in source.infolist():
            body = b"little" * 2000 if info.filename.endswith("/byteorder") else source.read(info.filename)
            out.writestr(info.filename, body)
    with pytest.raises(CheckpointError, match=r"record '[\w]+/byteorder' declares 12000 bytes; that kind of record"
                                              r" holds at most 16"):
        _trainer(tmp_path).load_checkpoint(target)


def test_records_torch_save_never_writes_and_too_many_records_are_refused(tmp_path, saved, monkeypatch):
    """An extra record of another kind, or more records than MAX_RECORDS: refused before torch.load."""
    root = zipfile.ZipFile(saved).namelist()[0].split("/")[0]
    extra = _repacked(saved, tmp_path / "extra.ckpt", extra=(f"{root}/payload.bin", b"x" * 10))
    _no_torch_load(monkeypatch)
    with pytest.raises(CheckpointError, match=r"record '[\w]+/payload\.bin' is of a kind torch\.save never writes"):
        archive.check_archive(extra)
    monkeypatch.setattr(archive, "MAX_RECORDS", 3)
    with pytest.raises(CheckpointError, match=r"its zip directory declares \d+ records, more than the 3 a checkpoint"):
        archive.check_archive(saved)


def test_overlapping_records_are_refused(tmp_path):
    """data.pkl declared to span nearly the whole file, over the storage record that follows it: each record
    fits inside the file, together they declare more bytes than it has."""
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(1000)}, buffer)
    data = buffer.getvalue()
    pkl = next(n for n in zipfile.ZipFile(io.BytesIO(data)).namelist() if n.endswith("data.pkl"))
    (tmp_path / "overlap.ckpt").write_bytes(_patched_size(data, pkl, len(data) - 200))
    with pytest.raises(CheckpointError, match=r"records declare \d+ bytes together, more than the file's \d+"):
        archive.check_archive(tmp_path / "overlap.ckpt")


def test_a_sharded_folders_checkpoint_pt_is_checked_too(tmp_path, monkeypatch):
    """A compressed `checkpoint.pt` inside a sharded folder is refused when the folder is loaded."""
    trainer = _trainer(tmp_path)
    trainer.fit(regression_batches())
    folder = save_sharded(trainer, tmp_path / "sharded.ckpt")
    side = folder / shard_storage.SIDE_CAR
    _repacked(side, tmp_path / "packed.pt", zipfile.ZIP_DEFLATED).replace(side)
    with pytest.raises(CheckpointError, match=r"checkpoint\.pt: record .* is compressed"):
        _trainer(tmp_path).load_checkpoint(folder)


def test_consolidate_on_the_command_line_refuses_a_compressed_side_file(tmp_path):
    """`python -m deepepochs consolidate` exits 2 with the one-line reason for a compressed checkpoint.pt."""
    trainer = _trainer(tmp_path)
    trainer.fit(regression_batches())
    folder = save_sharded(trainer, tmp_path / "sharded.ckpt")
    side = folder / shard_storage.SIDE_CAR
    _repacked(side, tmp_path / "packed.pt", zipfile.ZIP_DEFLATED).replace(side)
    done = subprocess.run([sys.executable, "-m", "deepepochs", "consolidate", str(folder), str(tmp_path / "one.ckpt")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "is compressed" in done.stderr + done.stdout
    assert not (tmp_path / "one.ckpt").exists()


def test_a_compressed_run_end_record_is_ignored_with_a_warning(tmp_path):
    """finished.pt re-packed compressed: resume says it ignored it, and the run trains on as unfinished."""
    first = _trainer(tmp_path, running_id="run")
    first.fit(regression_batches())
    marker = tmp_path / "ckpt" / "run" / FINISHED_FILE
    _repacked(marker, tmp_path / "packed.pt", zipfile.ZIP_DEFLATED).replace(marker)
    again = _trainer(tmp_path, running_id="run", resume=True, epochs=1)
    with pytest.warns(DeepEpochsWarning, match=r"resume ignored .*finished\.pt: .*is compressed"):
        again.fit(regression_batches())


class _Payload:
    """An object whose unpickling would call a function: what a crafted file carries."""

    def __reduce__(self):
        return (print, ("ran",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4")
@pytest.mark.parametrize("protocol", [2, 4])
def test_a_crafted_pickle_is_named_by_its_type_at_every_protocol(tmp_path, protocol):
    """A payload pickled with protocol 2 (GLOBAL) or 4 (STACK_GLOBAL, names from the memo) is refused naming
    the function it calls, never reported as a truncated file."""
    path = tmp_path / "crafted.ckpt"
    torch.save({"format_version": 1, "epoch": 1, "model": {}, "x": _Payload()}, path, pickle_protocol=protocol)
    with pytest.raises(CheckpointError, match=r"crafted\.ckpt holds an object of type builtins\.print"
                                              r"|crafted\.ckpt holds an object of type print"):
        _trainer(tmp_path).load_checkpoint(path)


def test_a_run_end_record_with_a_crafted_pickle_is_ignored_naming_the_type(tmp_path):
    """finished.pt holding a payload: ignored with a warning that names the refused type."""
    first = _trainer(tmp_path, running_id="run")
    first.fit(regression_batches())
    marker = tmp_path / "ckpt" / "run" / FINISHED_FILE
    torch.save({"records": _Payload()}, marker)
    again = _trainer(tmp_path, running_id="run", resume=True, epochs=1)
    with pytest.warns(DeepEpochsWarning, match=r"run-end record .*finished\.pt holds an object of type"
                                               r" (builtins\.)?print"):
        again.fit(regression_batches())
