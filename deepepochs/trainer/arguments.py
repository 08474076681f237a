"""The `Trainer`'s arguments, checked and resolved before anything is built.

A bad argument fails in the constructor (or at the call that takes it), never at batch 10,000: each message
names the argument, what it takes and what came. `Trainer.__init__` calls `check_keywords` and
`check_arguments`, then builds the policies from what they return; `TrainerConfig` (`deepepochs.config`)
validates the options that are plain values.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable

import attrs
import torch

from deepepochs.compat import refuse_accelerate
from deepepochs.config import check_run_name, unknown_keywords
from deepepochs.errors import ConfigError
from deepepochs.parallel.fsdp import FSDPConfig, check_strategy_kwargs
from deepepochs.parallel.strategy import check_ddp_kwargs

__all__ = ["TrainerArgs", "check_arguments", "check_call", "check_int", "check_keywords", "check_targets",
           "resolve_device", "to_device"]


def check_keywords(device, opt, unknown: dict, init: Callable) -> None:
    """Refuse keyword arguments `init` (the constructor) does not take: 0.6's Accelerate arguments, each with
    its replacement, and other libraries' names for ours (max_epochs -> epochs=)."""
    refuse_accelerate(device, opt, unknown)
    if unknown:
        known = [n for n in inspect.signature(init).parameters if n not in ("self", "unknown")]
        raise unknown_keywords("Trainer()", unknown, known)


@attrs.define(frozen=True)
class TrainerArgs:
    """The constructor's arguments that need more than a type check, resolved.

    Attributes:
        resume: False, True or a run id (0.6's int ids as strings).
        running_id: the run's name as given (a str), or None for one made from the start time.
        device: the training device before the distributed policy picks this rank's (`resolve_device`).
        ddp_kwargs: `DistributedDataParallel`'s keyword arguments (checked against its signature).
        fsdp: the `FSDPConfig` of strategy='fsdp', or None.
        target_key: `targets='<key>'`, or None.
        pick_targets: `targets=callable`, wrapped to check what it returns, or None.
    """

    resume: bool | str
    running_id: str | None
    device: torch.device
    ddp_kwargs: dict
    fsdp: FSDPConfig | None
    target_key: str | None
    pick_targets: Callable | None


def check_arguments(model, loss, resume, running_id, device, strategy, ddp_kwargs, fsdp_kwargs,
                    targets) -> TrainerArgs:
    """Check the constructor's arguments (all of them, in one place, before anything is built) and resolve
    those that need it; see `TrainerArgs`."""
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module (got {type(model).__name__})")
    if loss is not None and not callable(loss):
        raise ConfigError(f"loss must be a callable loss(model_out, batch_y) or None (got {type(loss).__name__})")
    if isinstance(resume, int) and not isinstance(resume, bool):
        resume = str(resume)  # 0.6 took run ids as ints too: resume=1 is the run running_id=1 wrote
    if isinstance(running_id, int) and not isinstance(running_id, bool):
        running_id = str(running_id)
    if not (resume is False or resume is True or isinstance(resume, str)):
        raise ConfigError(f"resume must be False, True or a running id (a string or an int) (got {resume!r})")
    if isinstance(resume, str):
        check_run_name(resume, "resume")
    if running_id is not None:
        check_run_name(running_id, "running_id")
    ddp_kwargs = check_ddp_kwargs(ddp_kwargs)
    fsdp = check_strategy_kwargs(strategy, ddp_kwargs, fsdp_kwargs)
    target_key, pick_targets = check_targets(targets)
    return TrainerArgs(resume=resume, running_id=running_id, device=resolve_device(device), ddp_kwargs=ddp_kwargs,
                       fsdp=fsdp, target_key=target_key, pick_targets=pick_targets)


def resolve_device(device) -> torch.device:
    """`Trainer(device=...)` as a `torch.device`: None is CUDA when available, else the CPU (MPS only when
    asked for); a device that is not available here is refused."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device must be a torch.device or a string like 'cpu', 'cuda', 'cuda:1', 'mps'"
                          f" (got {device!r})") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={device!r} but CUDA is not available; use device='cpu' or None")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        available = ", ".join(["'cpu'", *(["'cuda'"] if torch.cuda.is_available() else [])])
        raise ConfigError(f"device={device!r} but MPS is not available here; available: {available}")
    return dev


def check_targets(targets) -> tuple[str | None, Callable | None]:
    """`Trainer(targets=...)` as (target_key, pick_targets): a dict-batch key, or a callable
    `(batch_x, model_out) -> (preds, targets)` wrapped so that a wrong result fails naming the callable."""
    if targets is None:
        return None, None
    if isinstance(targets, str):
        if not targets:
            raise ConfigError("targets must be None, a non-empty dict-batch key or a callable (got '')")
        return targets, None
    if not callable(targets):
        raise ConfigError(f"targets must be None, the key of the label field of dict batches (a str), or a callable"
                          f" fn(batch_x, model_out) -> (preds, targets) (got {type(targets).__name__})")

    def pick(batch_x, model_out):
        pair = targets(batch_x, model_out)
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            size = f" of length {len(pair)}" if isinstance(pair, (tuple, list)) else ""
            raise ConfigError(f"the targets callable must return a (preds, targets) pair (got"
                              f" {type(pair).__name__}{size})")
        return pair

    return None, pick


def check_int(name: str, value, minimum: int = 1) -> int:
    """`value` if it is an int (not a bool) of at least `minimum`, else a `ConfigError` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        wanted = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ConfigError(f"{name} must be {wanted} (got {value!r})")
    return value


def to_device(device, what: str) -> torch.device | None:
    """A call's `device=` argument (e.g. `predict(device=...)`) as a `torch.device`, or None as given."""
    if device is None:
        return None
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"{what} device must be None or a device such as 'cpu' or 'cuda' (got {device!r})") from e


def check_call(call: str, closed: bool, running: str | None, running_thread) -> None:
    """Refuse a public call (`fit`, `test`, ...) on a closed trainer, or while `running` ('fit', 'test', ...)
    runs: from another thread (a Trainer runs one call at a time) or from inside a callback (re-entry)."""
    if closed:
        raise RuntimeError("this Trainer was closed; create a new one")
    if running is not None and running_thread is not threading.current_thread():
        raise RuntimeError(f"{call}() was called from thread {threading.current_thread().name!r} while {running}()"
                           f" runs in thread {getattr(running_thread, 'name', '?')!r}; a Trainer runs one call at a"
                           f" time: wait for {running}() to return, or give each thread its own Trainer and model")
    if running is not None:
        raise RuntimeError(f"{call}() was called from inside a callback while {running}() runs; a callback"
                           " can ask for a stop (trainer.request_stop) or a save (trainer.request_save)")
