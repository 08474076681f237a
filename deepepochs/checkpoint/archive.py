"""Bounded reads: a file's zip directory checked before `torch.load` reads it, and the refused pickle type
named when a file holds more than plain data.

`torch.save` writes a zip archive of uncompressed records: `data.pkl` (the pickled structure), one
`data/<key>` record per tensor storage, and a few small records of metadata (`version`, `byteorder`, ...).
torch's reader allocates each storage at the size the directory declares, and it accepts deflate-compressed
records too, which `torch.save` never writes: a record of ones compressed a thousand times over would make a
file of a few hundred kilobytes allocate gigabytes. `check_archive` therefore reads only the zip directory
(its end record first, so even the number of entries is known before any is parsed) and refuses the file
unless every record is stored uncompressed, every declared size fits inside the file (and all of them
together too: records never overlap in a file `torch.save` wrote), the metadata records are as small as
their kind is, and the number of records is bounded. What a file then makes `torch.load` allocate is never
more than the file's own size.
"""

from __future__ import annotations

import pickle
import pickletools
import re
import struct
import zipfile
from pathlib import Path

import torch

from deepepochs.errors import CheckpointError

__all__ = ["MAX_RECORDS", "check_archive", "load_plain", "pickled_globals", "refused_types"]

#: The most records a file may hold: one per tensor storage (a model's tensors and its optimizers' states)
#: plus a few of metadata; a million covers models far larger than any one file holds.
MAX_RECORDS = 1 << 20

# The records of metadata `torch.save` writes besides `data.pkl` and `data/<key>`, with the most bytes each
# may hold (they hold a number, a word or an id).
_SMALL_RECORDS = {"version": 16, ".format_version": 16, ".storage_alignment": 16, "byteorder": 16,
                  ".data/version": 16, ".data/serialization_id": 64}
_STORAGE = re.compile(r"^data/\d+$")
_EOCD, _EOCD64_LOCATOR, _EOCD64 = b"PK\x05\x06", b"PK\x06\x07", b"PK\x06\x06"
_LOCAL_HEADER = 30  # the fixed part of a record's local header, before its name and extra field


def _directory_entries(f, size: int, path, what: str) -> int:
    """How many records the zip directory of the open file `f` (of `size` bytes) declares, read from its end
    record (and the zip64 end record it points to) without parsing the directory itself."""
    tail_size = min(size, 22 + 0xFFFF)  # the end record and the longest comment it may carry
    f.seek(size - tail_size)
    tail = f.read(tail_size)
    at = tail.rfind(_EOCD)
    if at < 0 or len(tail) - at < 22:
        raise CheckpointError(f"cannot read {what} {path}: the file is truncated or corrupt (no zip directory at"
                              " its end; torch.save writes a zip archive)")
    entries = struct.unpack("<H", tail[at + 10:at + 12])[0]
    if entries == 0xFFFF and at >= 20 and tail[at - 20:at - 16] == _EOCD64_LOCATOR:
        offset = struct.unpack("<Q", tail[at - 12:at - 4])[0]
        if offset + 56 > size:
            raise CheckpointError(f"{path}: its zip64 directory record lies past the end of the file ({offset} of"
                                  f" {size} bytes); the file is damaged")
        f.seek(offset)
        record = f.read(56)
        if record[:4] != _EOCD64:
            raise CheckpointError(f"{path}: its zip64 directory record is damaged")
        entries = struct.unpack("<Q", record[32:40])[0]
    return entries


def check_archive(path, what: str = "checkpoint") -> None:
    """`CheckpointError` naming `path` (a `what`, for the message) and the record unless the file is a zip
    archive such as `torch.save` writes, whose reading allocates no more than the file's size (see the module
    docstring)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        entries = _directory_entries(f, size, path, what)
        if entries > MAX_RECORDS:
            raise CheckpointError(f"{path}: its zip directory declares {entries} records, more than the {MAX_RECORDS}"
                                  " a checkpoint may hold; it was not read")
        try:
            infos = zipfile.ZipFile(f).infolist()
        except (zipfile.BadZipFile, OSError, ValueError, struct.error, EOFError) as e:
            raise CheckpointError(f"cannot read {what} {path}: the file is truncated or corrupt (its zip directory"
                                  f" is damaged: {type(e).__name__}: {e})") from None
    if len(infos) > MAX_RECORDS:
        raise CheckpointError(f"{path} holds {len(infos)} records, more than the {MAX_RECORDS} a checkpoint may"
                              " hold; it was not read")
    roots = {info.filename.split("/", 1)[0] for info in infos}
    if len(roots) != 1 or not infos:
        raise CheckpointError(f"{path} is not a file torch.save wrote: its records lie under {len(roots)} top"
                              f" folders ({sorted(roots)[:3]}), torch.save writes one")
    total = 0
    for info in infos:
        name = info.filename.split("/", 1)[1] if "/" in info.filename else ""
        where = f"{path}: record {info.filename!r}"
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{where} is compressed (zip method {info.compress_type}); torch.save stores"
                                  " records uncompressed, and a compressed one could ask for far more memory than"
                                  " the file's size. Re-save the state with torch.save; it was not read")
        if info.file_size != info.compress_size:
            raise CheckpointError(f"{where} declares {info.file_size} bytes but stores {info.compress_size}; the"
                                  " file is damaged and was not read")
        end = info.header_offset + _LOCAL_HEADER + len(info.orig_filename.encode()) + info.file_size
        if end > size:
            raise CheckpointError(f"{where} declares {info.file_size} bytes at offset {info.header_offset},"
                                  f" past the end of the {size}-byte file (a truncated or damaged file); it was not"
                                  " read")
        limit = _SMALL_RECORDS.get(name)
        if limit is not None and info.file_size > limit:
            raise CheckpointError(f"{where} declares {info.file_size} bytes; that kind of record holds at most"
                                  f" {limit}. The file is damaged and was not read")
        if limit is None and name != "data.pkl" and not _STORAGE.match(name):
            raise CheckpointError(f"{where} is of a kind torch.save never writes (its records are data.pkl,"
                                  f" data/<n> and {', '.join(sorted(_SMALL_RECORDS))}); it was not read")
        total += info.file_size
    if total > size:
        raise CheckpointError(f"{path}: its records declare {total} bytes together, more than the file's {size}"
                              " (records that overlap); it was not read")


_TYPE_PATTERNS = (re.compile(r"GLOBAL ([\w.]+)"), re.compile(r"got <class '([\w.]+)'>"),
                  re.compile(r"unrecognized function <[^>]*?([\w.]+)[ >]"), re.compile(r"but got ([\w.]+)"))


def refused_types(exc: BaseException, path=None) -> list[str]:
    """The types (or functions) a weights-only read of `path` refused, as dotted names: the one torch's
    message names, else those the file's pickle refers to (`pickled_globals`). Empty when the failure was
    no refusal."""
    if not isinstance(exc, pickle.UnpicklingError):
        return []
    text = str(exc)
    for pattern in _TYPE_PATTERNS:
        match = pattern.search(text)
        if match is not None:
            return [match.group(1)]
    return pickled_globals(path) if path is not None else []


# What `torch.save` itself refers to in the pickle of plain data: torch's tensor and storage rebuilding,
# and OrderedDict (a state_dict()).
_PLAIN_MODULES = ("torch", "collections")


def pickled_globals(path) -> list[str]:
    """The globals (`module.name`) the pickle of the file at `path` (checked by `check_archive`) refers to
    besides torch's own and OrderedDict, found by reading its opcodes without running any (every protocol:
    GLOBAL, INST, and STACK_GLOBAL after the two strings that name it). Empty when it cannot be read."""
    try:
        with zipfile.ZipFile(path) as archive:
            name = next(n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
            data = archive.read(name)
        found, strings, memo, top = [], [], {}, None
        for opcode, arg, _pos in pickletools.genops(data):
            kind = opcode.name
            if kind in ("GLOBAL", "INST"):
                found.append(str(arg).replace(" ", "."))
            elif kind == "STACK_GLOBAL" and len(strings) >= 2:
                found.append(f"{strings[-2]}.{strings[-1]}")
            if kind == "MEMOIZE":  # the memo keeps what is on top of the stack: a name may come back from it
                memo[len(memo)] = top
                continue
            if kind in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[arg] = top
                continue
            top = memo.get(arg) if kind in ("GET", "BINGET", "LONG_BINGET") else arg if "UNICODE" in kind else None
            if isinstance(top, str):
                strings = [*strings[-1:], top]
    except Exception:  # a pickle that cannot even be scanned: the caller reports a damaged file
        return []
    return list(dict.fromkeys(n for n in found if n.split(".", 1)[0] not in _PLAIN_MODULES))


def load_plain(path, what: str, mmap: bool = False, hint: str = ""):
    """`torch.load(path, weights_only=True)` onto the CPU after `check_archive`; every failure is a
    `CheckpointError` naming `path` (`what` says which kind of file it is): a refused type by its name,
    otherwise what failed; `hint` ends the refusal's message."""
    check_archive(path, what)
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:
        refused = refused_types(e, path)
        if refused:
            raise CheckpointError(
                f"{what} {path} holds an object of type {', '.join(refused)}, not only tensors, numbers, strings"
                f" and containers; it was not loaded, since unpickling it could run code from the file{hint}") from e
        reason = re.search(r"Unsupported operand \d+|Unsupported [^\n]*", str(e))
        if isinstance(e, pickle.UnpicklingError) and reason is not None:
            raise CheckpointError(f"{what} {path} holds pickle data the weights-only reader refuses ({reason.group(0)}:"
                                  " torch.save never writes it); it was not loaded") from e
        first = (str(e).strip().splitlines() or [""])[0]
        raise CheckpointError(f"cannot read {what} {path}: the file is truncated or corrupt ({type(e).__name__}:"
                              f" {first})") from e
