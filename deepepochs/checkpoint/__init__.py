"""Checkpoints: the public names of the modules below.

One reason to change per module:

- `format`: what a checkpoint file holds (the `Checkpoint` record and its keys, 0.6 conversion, which
  callbacks are monitors whose states it keeps).
- `read`: reading a file or a sharded checkpoint folder safely (weights only), its shards.
- `write`: a trainer's state as a `Checkpoint`, the rank-agreed save, the atomic write and the cleanup of
  killed saves' temporary files, `consolidate`.
- `load`: the fit check against a trainer and the all-or-nothing load.
- `find`: finding the most progressed checkpoint and honouring `Trainer(resume=...)`.
- `run_lock`: the lock a fit holds on its run folders, so that one live process trains a run.
- `background`: the host copy of a checkpoint and the thread that writes it beside training.
"""

from deepepochs.checkpoint.find import by_progress, find_checkpoint, find_checkpoints, resume_once, resume_scope
from deepepochs.checkpoint.format import (
    CONVERT_HINT,
    FORMAT_VERSION,
    SUFFIX,
    Checkpoint,
    monitors_in,
    monitors_of,
    plain_records,
)
from deepepochs.checkpoint.load import check_fits, copied_to_cpu, load_averages, load_into, load_model_state
from deepepochs.checkpoint.read import exists, modified_ns, read_checkpoint, read_weights
from deepepochs.checkpoint.write import (
    consolidate,
    remove,
    remove_stale_temps,
    retire,
    save,
    snapshot,
    write_atomic,
)
from deepepochs.errors import CheckpointError

__all__ = [
    "CONVERT_HINT",
    "FORMAT_VERSION",
    "SUFFIX",
    "Checkpoint",
    "CheckpointError",
    "by_progress",
    "check_fits",
    "consolidate",
    "copied_to_cpu",
    "exists",
    "find_checkpoint",
    "find_checkpoints",
    "load_averages",
    "load_into",
    "load_model_state",
    "modified_ns",
    "monitors_in",
    "monitors_of",
    "plain_records",
    "read_checkpoint",
    "read_weights",
    "remove",
    "remove_stale_temps",
    "resume_once",
    "resume_scope",
    "retire",
    "save",
    "snapshot",
    "write_atomic",
]
