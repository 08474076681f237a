"""What a W&B run wrote, read back from its own run files (`run-<id>.wandb`, which `wandb sync` uploads):
the tests of `WandbCallback` run W&B offline (no account, no network) and check what the files hold.

wandb >= 0.20 writes these files from its Go core and ships no Python reader of them; the framing is W&B's
record log (a 7-byte header `:W&B`, magic, version; 32 KiB blocks of records, each a CRC-32C, a 16-bit
length and a chunk type: full, first, middle or last), and each record is W&B's own protobuf message
`wandb.proto.wandb_internal_pb2.Record`, decoded with it."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

__all__ = ["history_rows", "records", "run_files", "scalar_series"]

#: How long W&B's core may take to write a finished run's records to its file: `run.finish()` returns once
#: the core has the run's exit, and the core writes the file behind (seconds on a loaded machine).
WRITTEN_S = 120

_HEADER = b":W&B"
_BLOCK = 32 * 1024
_CHUNK = struct.Struct("<IHB")  # CRC-32C, length, type
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path):
    """Each `Record` of the run file `path`, in the order W&B wrote them."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == _HEADER, f"{path} is not a W&B run file"
    position, pending = 7, b""
    while position + _CHUNK.size <= len(data):
        left = _BLOCK - position % _BLOCK
        if left < _CHUNK.size:  # a block's tail too short for a chunk header is padding
            position += left
            continue
        _crc, length, kind = _CHUNK.unpack_from(data, position)
        if kind == 0:  # zero padding to the block's end
            position += left
            continue
        payload = data[position + _CHUNK.size: position + _CHUNK.size + length]
        position += _CHUNK.size + length
        if kind in (_FIRST, _FULL):
            pending = b""
        pending += payload
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def run_files(folder, run_id: str, count: int = 1) -> list[Path]:
    """The run files of the W&B run `run_id` under `folder` (a W&B `dir`), oldest first (a resumed offline
    run writes a file of its own next to the first), once `count` of them exist (W&B's core may create a
    run's folder after `run.finish()` returned) and each holds its run's exit record."""
    deadline = time.monotonic() + WRITTEN_S
    while True:
        paths = sorted(Path(folder).glob(f"wandb/*-{run_id}/run-{run_id}.wandb"))
        if len(paths) >= count or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    for path in paths:
        while not any(record.WhichOneof("record_type") == "exit" for record in records(path)):
            assert time.monotonic() < deadline, f"W&B never wrote the end of {path}"
            time.sleep(0.2)
    return paths


def history_rows(paths) -> list[tuple[int, dict]]:
    """`(step, {tag: value})` of every history row the files hold (W&B's own `_step`, `_runtime`, ...
    left out), in file order."""
    rows = []
    for path in paths:
        for record in records(path):
            if record.WhichOneof("record_type") != "history":
                continue
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    row[key] = json.loads(item.value_json)
            rows.append((int(record.history.step.num), row))
    return rows


def scalar_series(paths) -> dict[str, list[tuple[int, float]]]:
    """`{tag: [(step, value), ...]}` of the files' history rows, in the order logged (repeats kept)."""
    out: dict[str, list] = {}
    for step, row in history_rows(paths):
        for tag, value in row.items():
            out.setdefault(tag, []).append((step, value))
    return out
