"""The trainer's TensorBoard writers: created on first use, shared by every logging callback; and
`CsvRecord`, the same run's epoch metrics as a CSV table beside the event files.

A run writes into `<log_dir>/<running_id>`. Every logging callback that asks for the same `log_dir` gets
the same `torch.utils.tensorboard.SummaryWriter`, so `fit` followed by `test` (and the log, interpretation
and analysis callbacks together) write one run. `SummaryWriter` starts a background thread that writes
event files; `Trainer.close()` flushes the writers and joins that thread, and so does the garbage collector
when it frees a trainer that was never closed (or the interpreter's exit), so that no thread outlives its
trainer. Only the main process writes: other ranks get a `NullWriter`, whose methods do nothing.
"""

from __future__ import annotations

import csv
import functools
import os
import struct
import weakref

from deepepochs.utils import every_step

__all__ = ["CSV_FILE", "DEFAULT_LOG_DIR", "CsvRecord", "NullWriter", "RunWriters", "add_hparams_record", "add_png"]

#: Where logs go when no logging callback names a folder.
DEFAULT_LOG_DIR = "./logs"
#: The CSV table of a run's metrics, in its run folder `<log_dir>/<running_id>`.
CSV_FILE = "metrics.csv"


class NullWriter:
    """A stand-in for `SummaryWriter` on non-main ranks: every method accepts anything and does nothing."""

    log_dir = None

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _noop

    def __bool__(self):
        return False


def _noop(*args, **kwargs):
    return None


class RunWriters:
    """The `SummaryWriter`s of one trainer: one per log folder, each writing the run folder
    `<log_dir>/<running_id>`, created lazily so that a trainer without logging callbacks writes nothing.

    Args:
        trainer: the owning trainer; its `running_id` (read when a writer is created), its callbacks
            (for the default folder) and `is_main_process` are used.
    """

    def __init__(self, trainer):
        self._trainer = trainer
        self._writers: dict[str, object] = {}
        self._closed = False
        # Closes the writers when this object is freed without close() (an unclosed trainer dropped): the
        # writer threads hold no reference to their trainer, so they would run until the process ends.
        self._finalizer = weakref.finalize(self, _close_writers, self._writers)

    def default_dir(self) -> str:
        """The folder used when a callback passes `log_dir=None`: the folder of the first writer already
        open, else the first `log_dir` named by an attached callback, else `DEFAULT_LOG_DIR`."""
        if self._writers:
            return next(iter(self._writers))
        for cb in self._trainer.callbacks:
            log_dir = getattr(cb, "log_dir", None)
            if isinstance(log_dir, (str, os.PathLike)):
                return os.fspath(log_dir)
        return DEFAULT_LOG_DIR

    def get(self, log_dir=None):
        """The writer of `log_dir` (None: `default_dir()`), created on first use on the main process."""
        if self._closed:
            raise RuntimeError("the trainer's TensorBoard writers were closed by trainer.close(); create a"
                               " new Trainer to log another run")
        # Keyed by absolute path, so './logs', 'logs' and Path('logs') share one writer (two writers on one
        # folder would split the run into two event files).
        key = os.path.abspath(os.fspath(log_dir) if log_dir is not None else self.default_dir())
        writer = self._writers.get(key)
        if writer is None:
            if not self._trainer.is_main_process:
                writer = NullWriter()
            else:
                # Imported here: torch.utils.tensorboard pulls in tensorboard, which a run without
                # logging callbacks never needs.
                from torch.utils.tensorboard import SummaryWriter

                writer = SummaryWriter(log_dir=os.path.join(key, str(self._trainer.running_id)))
            self._writers[key] = writer
        return writer

    def flush(self) -> None:
        """Write buffered events to disk now."""
        for writer in self._writers.values():
            writer.flush()

    def close(self) -> None:
        """Flush and close every writer (joining its writer thread); idempotent."""
        self._closed = True
        self._finalizer()  # runs `_close_writers` once


def _close_writers(writers: dict) -> None:
    """Close every writer in `writers` (joining its thread) and empty it: the others even if one fails (e.g.
    a full disk), raising the first error after them, and after a `KeyboardInterrupt` too (`every_step`)."""
    errors = []
    try:
        every_step([functools.partial(_close, writer) for writer in writers.values()], errors)
    finally:
        writers.clear()
    if errors:
        raise errors[0]


def _close(writer) -> None:
    """Close `writer`; when a `KeyboardInterrupt` cut its close (perhaps before its thread was joined),
    close it once more before the interrupt goes on: `SummaryWriter.close` can be repeated until it ends."""
    try:
        writer.close()
    except Exception:
        raise
    except BaseException:
        writer.close()
        raise


def add_png(writer, tag: str, png: bytes, global_step: int | None = None) -> None:
    """Write already-encoded PNG bytes as an image summary (no decoding, so no imaging library needed).

    `SummaryWriter.add_image` wants a pixel array; a PNG rendered by Graphviz only needs its size, which
    the PNG header (IHDR chunk: width and height at bytes 16-24) gives.
    """
    if isinstance(writer, NullWriter):
        return
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"add_png needs PNG bytes (got a header of {png[:8]!r})")
    from tensorboard.compat.proto.summary_pb2 import Summary

    width, height = struct.unpack(">II", png[16:24])
    colorspace = _PNG_COLORSPACE.get(png[25], 3)
    image = Summary.Image(height=height, width=width, colorspace=colorspace, encoded_image_string=png)
    _file_writer(writer).add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), global_step)


#: PNG colour type (IHDR byte 25) -> TensorBoard colorspace (1 grey, 2 grey+alpha, 3 RGB, 4 RGBA).
_PNG_COLORSPACE = {0: 1, 4: 2, 2: 3, 3: 3, 6: 4}


def add_hparams_record(writer, hparams: dict, metrics: dict) -> None:
    """Write an HParams session into the writer's own run folder.

    `SummaryWriter.add_hparams` would open a second writer in a sub-folder, so the hyper-parameters would
    land in a run apart from the curves. Writing the three HParams summaries (experiment, session start,
    session end) into the run itself makes `<log_dir>/<running_id>` the session: the HParams dashboard
    lists one row per run, with the run's scalars named in `metrics` as its columns (the caller writes
    those scalars, with `add_scalar`, into the same run).

    Args:
        writer: a `SummaryWriter` (a `NullWriter` does nothing).
        hparams: `{name: value}`; values other than bool/int/float/str are written as their `str()`.
        metrics: `{tag: float}`, e.g. `{'loss/test': 0.31}`; only the tags are recorded here.
    """
    if isinstance(writer, NullWriter):
        return
    from torch.utils.tensorboard.summary import hparams as hparams_summaries

    clean = {str(k): v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in hparams.items()}
    experiment, start, end = hparams_summaries(clean, dict(metrics))
    file_writer = _file_writer(writer)
    for summary in (experiment, start, end):
        file_writer.add_summary(summary)


def _file_writer(writer):
    # SummaryWriter keeps its FileWriter behind `_get_file_writer()`, the accessor every add_* method
    # uses; raw summaries (pre-encoded images, HParams) have no public add_* method.
    return writer._get_file_writer()


class CsvRecord:
    """A run's metrics as a CSV table: one row per epoch and stage, the values the console prints
    (unrounded), readable with the standard library's `csv.DictReader`.

    Columns: `epoch` (1-based; a test row holds the epochs completed when it ran), `stage` (`train`,
    `val`, `test`), then one column per metric in the order they first appear (empty where a row's stage
    has no such metric). The file is rewritten whole, through a temporary file and a rename, at every row
    (a few kilobytes), so a reader never sees half a row and a metric first reported later (a test
    metric) joins the header. An existing file is continued: a resumed run keeps the rows before it, and
    training epoch `e` again replaces the train and val rows of epoch `e` and later.

    Args:
        path: the CSV file (`<log_dir>/<running_id>/metrics.csv`).
    """

    def __init__(self, path):
        self.path = os.fspath(path)
        self.rows: list[dict] = []
        if os.path.exists(self.path):
            with open(self.path, newline="") as f:
                self.rows = [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(f)]

    def add(self, epoch: int, stage: str, metrics) -> None:
        """Append the row of `stage` at `epoch` (`{name: number}`) and rewrite the file."""
        if stage == "train":  # epoch `epoch` trained (again): what a run before the resume logged from it on goes
            self.rows = [r for r in self.rows if r["stage"] == "test" or int(r["epoch"]) < epoch]
        self.rows.append({"epoch": int(epoch), "stage": stage, **{k: float(v) for k, v in metrics.items()}})
        names = list(dict.fromkeys(k for row in self.rows for k in row if k not in ("epoch", "stage")))
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        temporary = f"{self.path}.tmp{os.getpid()}"
        with open(temporary, "w", newline="") as f:
            table = csv.DictWriter(f, ["epoch", "stage", *names], restval="")
            table.writeheader()
            table.writerows(self.rows)
        os.replace(temporary, self.path)
