"""Ctrl-C to the whole process group while a stage's spawn DataLoader workers are still importing (run as a
script in a session of its own by tests/test_worker_sigint.py).

For each stage (training, validation, test, prediction, the LR sweep) the workers note their pid in a folder
and sleep while importing this module; once all of them have, a thread sends SIGINT to the process group.
The stage must raise KeyboardInterrupt in the main process and roll back (the machine idle); the workers
must not die of it, nor of the stage's end while they still start (no traceback of theirs, no torch worker
error). Prints one line per stage: `<stage> <workers importing when signalled> <idle>`; with the argument
`persistent` (persistent workers) two more for a kept DataLoader, which then trains or tests to the end.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

MARKS_VARIABLE = "DEEPEPOCHS_TEST_WORKER_MARKS"
WORKERS = 2

# a spawn worker importing this module (its name is set before the import; its parent only after it)
if multiprocessing.current_process().name != "MainProcess" and os.environ.get(MARKS_VARIABLE):
    Path(os.environ[MARKS_VARIABLE], str(os.getpid())).touch()
    time.sleep(1.5)

import torch  # noqa: E402  (after the workers' mark: the signal must land while they import)
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from deepepochs import Trainer  # noqa: E402


def _loader(workers: int, persistent: bool = False) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    options = ({"num_workers": workers, "multiprocessing_context": "spawn", "persistent_workers": persistent}
               if workers else {})
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8, shuffle=True, **options)


def _interrupt_once_importing(marks: Path) -> None:
    """SIGINT to the process group once every worker has noted itself (or after 60 s)."""
    def run():
        deadline = time.monotonic() + 60
        while len(os.listdir(marks)) < WORKERS and time.monotonic() < deadline:
            time.sleep(0.01)
        os.killpg(0, signal.SIGINT)
    threading.Thread(target=run, daemon=True).start()


def _interrupted(name: str, marks: Path, run, *args) -> None:
    """`run(*args)` with a SIGINT to the process group once the workers it starts are importing; it must raise
    KeyboardInterrupt."""
    marks.mkdir()
    os.environ[MARKS_VARIABLE] = str(marks)
    _interrupt_once_importing(marks)
    try:
        run(*args)
    except KeyboardInterrupt:
        pass
    else:
        sys.exit(f"{name}: no KeyboardInterrupt")
    finally:
        del os.environ[MARKS_VARIABLE]


def main(persistent: bool) -> None:
    """Without `persistent`: every stage, each with DataLoaders made in the call. With it (persistent
    workers): training and test, first with a DataLoader made in the call (garbage after the interrupt),
    then with one kept, which the stage run again after the interrupt must still iterate."""
    stages = {
        "train": lambda t, data=None: t.fit(data or _loader(WORKERS, persistent)),
        "val": lambda t, data=None: t.fit(_loader(0), data or _loader(WORKERS, persistent)),
        "test": lambda t, data=None: t.test(data or _loader(WORKERS, persistent)),
        "predict": lambda t, data=None: t.predict(data or _loader(WORKERS, persistent)),
        "lr_sweep": lambda t, data=None: t.find_lr(data or _loader(WORKERS, persistent), num_steps=3),
    }
    if persistent:
        stages = {name: stages[name] for name in ("train", "test")}
    root = Path(tempfile.mkdtemp())
    for name, run in stages.items():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 2))
        trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), epochs=1,
                          device="cpu", log_batch=False, show_info=False)
        _interrupted(name, root / name, run, trainer)
        line = [name, len(os.listdir(root / name)), trainer.machine.state == "idle"]
        if persistent:  # the kept DataLoader: interrupted, then iterated again to its end
            kept = _loader(WORKERS, persistent)
            _interrupted(name, root / f"{name}-kept", run, trainer, kept)
            run(trainer, kept)
            line += [len(os.listdir(root / f"{name}-kept")), trainer.machine.state == "idle"]
        print(*line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] == ["persistent"])
