"""The few exception classes deepepochs raises, each subclassing the builtin it resembles."""

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DeepEpochsWarning",
    "DistributedError",
    "InvalidTransition",
    "LoopError",
]


class ConfigError(ValueError):
    """A user-supplied argument is invalid; the message names it, the accepted values and the received one."""


class InvalidTransition(RuntimeError):
    """A trigger was fired in a state that has no edge for it (names state, trigger and the allowed triggers)."""


class LoopError(RuntimeError):
    """Training failed inside the loop; wraps the original error and carries the flight record."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable or incompatible; the message names the path."""


class DistributedError(RuntimeError):
    """A distributed process failed or the process group is in an unusable state."""


class DeepEpochsWarning(UserWarning):
    """Base class of warnings deepepochs emits (tests turn them into errors)."""
