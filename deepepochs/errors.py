"""The few exception classes deepepochs raises, each subclassing the builtin it resembles."""

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DeepEpochsWarning",
    "DesyncError",
    "DistributedError",
    "InvalidTransition",
    "MigrationWarning",
    "Preempted",
    "RunLockedError",
]


class ConfigError(ValueError):
    """A user-supplied argument is invalid; the message names it, the accepted values and the received one."""


class InvalidTransition(RuntimeError):
    """A trigger was fired in a state that has no edge for it (names state, trigger and the allowed triggers)."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable or incompatible; the message names the path."""


class DistributedError(RuntimeError):
    """A distributed process failed or the process group is in an unusable state.

    Attributes:
        ranks: when a collective failed under a group deepepochs created, every rank's last place, from the
            ranks' heartbeats: rank -> {'state', 'stage', 'epoch', 'update', 'batch', 'collective',
            'seconds_since_heartbeat', 'seconds_in_place', 'callback', 'stop' (the reason of a stop this rank
            requested), 'alive'} (None: not known); else None.
    """

    ranks: dict | None = None


class DesyncError(DistributedError):
    """The ranks of a distributed run took different paths through the loop (a stop requested on one rank only,
    one rank's evaluation task ending while another still issues a collective in it): raised on every rank that
    sees it, at the point where the ranks compare their paths (a task's end, the fit's end) or when a collective
    failed, instead of a hang.

    Attributes:
        parting: the first transition since the ranks last agreed where their paths part, as a sentence.
        ranks: every rank's last place, as `DistributedError.ranks`.
    """

    parting: str | None = None


class RunLockedError(RuntimeError):
    """Another live process trains the same run (its folders are locked: `Trainer(run_lock=...)`); the message
    names the holder's pid, host, start time and lock file. Also raised when the folders cannot be locked."""


class DeepEpochsWarning(UserWarning):
    """Base class of warnings deepepochs emits (tests turn them into errors)."""


class MigrationWarning(DeepEpochsWarning):
    """Code whose meaning differs from deepepochs 0.6.18's met that difference (e.g. `fit(epochs=k)` below
    the epochs done, which 0.6.18 read as k more): said at most once per process, naming 0.6.18's behaviour
    and how to get it (docs/MIGRATION.md lists them); code that means the same in both gets none.
    Silence it with `warnings.filterwarnings('ignore', category=deepepochs.MigrationWarning)`."""


class Preempted(SystemExit):
    """A signal a `SnapshotCallback` listens for (e.g. SIGTERM from a cluster scheduler) stopped `fit` at a
    commit point, after a snapshot was written.

    A `SystemExit`: left uncaught, the script ends without a traceback and with exit status `code`
    (128 + the signal's number unless the callback was given `exit_code`), which a scheduler can requeue
    on; a `Trainer(resume=True)` in the requeued job continues from the snapshot. `except Exception` does
    not catch it.

    Attributes:
        code: the exit status.
        signal_name: the signal that arrived, e.g. 'SIGTERM' ('a peer rank's signal' under DDP on the ranks
            it did not reach).
        path: the snapshot written (None on ranks other than 0).
    """

    def __init__(self, code: int, signal_name: str, path=None):
        super().__init__(code)
        self.signal_name = signal_name
        self.path = path

    def __str__(self) -> str:
        where = f"; snapshot {self.path}" if self.path is not None else ""
        return f"preempted by {self.signal_name} at a commit point{where} (exit status {self.code})"
