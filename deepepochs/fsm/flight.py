"""Saved flight records: the last transitions of a failed run, as a file `python -m deepepochs graph --flight`
draws.

Two forms are read:

- JSON written by `save_flight_record(error_or_trainer, path)`: every transition the machine kept;
- text: any log holding the error's note (`deepepochs: ... raised in state ...; last transitions of the
  deepepochs loop (newest last):` then one `epoch E batch B: source --trigger--> dest` line per
  transition), e.g. a job's captured stderr. The last such block in the file is read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from deepepochs.errors import ConfigError
from deepepochs.fsm.machine import Record, load_spec

__all__ = ["FORMAT", "read_flight_record", "save_flight_record"]

FORMAT = "deepepochs-flight-record"
_HEADER = "last transitions of the deepepochs loop"
_LINE = re.compile(r"epoch (\d+) batch (\d+): (\w+) --(\w+)--> (\w+)")


def _records_of(source) -> list[Record]:
    """The records a trainer's machine kept, or those an error raised by fit()/test() carries."""
    machine = getattr(source, "machine", None)
    if machine is not None and hasattr(machine, "records"):
        return machine.records()
    records = getattr(source, "deepepochs_flight_record", None)
    if records is None:
        raise ConfigError("save_flight_record needs a Trainer or an error raised by its fit()/test() (one"
                          f" carrying `deepepochs_flight_record`); got {type(source).__name__}")
    return [Record(*r) for r in records]


def save_flight_record(source, path) -> Path:
    """Write the flight record of `source` (a Trainer, or an exception raised by its fit/test) as JSON.

    Returns the path. `python -m deepepochs graph --flight PATH --format svg -o crash.svg` draws it.
    """
    records = _records_of(source)
    data = {"format": FORMAT, "version": 1,
            "records": [dict(r._asdict()) for r in records]}
    if isinstance(source, BaseException):
        data["error"] = f"{type(source).__name__}: {source}"
    path = Path(path)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def _check(records: Sequence[Record], where: str) -> list[Record]:
    spec = load_spec()
    states, triggers = {s.name for s in spec.states}, {t.name for t in spec.triggers}
    for r in records:
        unknown = [n for n in (r.source, r.dest) if n not in states] + ([r.trigger] if r.trigger not in triggers
                                                                      else [])
        if unknown:
            raise ConfigError(f"{where}: the transition {r.source} --{r.trigger}--> {r.dest} names {unknown}, which"
                              " this version's loop does not have; was the record made by another version?")
    return list(records)


def read_flight_record(path) -> list[Record]:
    """The transitions recorded in `path` (JSON from `save_flight_record`, or text holding an error's
    flight record), oldest first. Raises `ConfigError` naming the file when it holds none."""
    path = Path(path)
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        raise ConfigError(f"flight record {str(path)!r} cannot be read: {e}") from e
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict) and data.get("format") == FORMAT:
        try:
            records = [Record(int(r["epoch"]), int(r["batch"]), r["source"], r["trigger"], r["dest"])
                       for r in data["records"]]
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"flight record {str(path)!r}: damaged JSON record ({e!r})") from e
        return _check(records, f"flight record {str(path)!r}")
    block = text[text.rfind(_HEADER):] if _HEADER in text else text
    records = [Record(int(e), int(b), s, t, d) for e, b, s, t, d in _LINE.findall(block)]
    if not records:
        raise ConfigError(f"flight record {str(path)!r} holds no transitions: expected the JSON written by"
                          " deepepochs.fsm.flight.save_flight_record or a log with lines like 'epoch 2 batch 3:"
                          " window_open --update_step--> task_train'")
    return _check(records, f"flight record {str(path)!r}")
