"""State that callbacks keep (a callback with `state_dict()` and `load_state_dict(state)`, such as a program's
own EMA object kept in a callback): run state, kept and restored as `trainer.carried` is.

Each such callback is known by a stable name (`key`): its class name, with its `state_key` attribute in
brackets when it has one (`PlainEMA`, `PlainEMA[fast]`), as Lightning names stateful callbacks; two with one
name are refused when attached. deepepochs' own callbacks whose state has a field of its own (checkpoint
monitors and `SnapshotCallback`, found by their `monitor_id`) are not among them.

A callback changes its state in its hooks: those of an update (`on_after_optimize`, `on_after_train_batch`)
run after its commit, those of the next window's batches before the next. So the run state keeps a copy of
every state where the hooks of a commit point are done and nothing else began (`RunState.callbacks`,
`keep`: at the fit's start, as each window opens, at the training stage's end, as a validation point of the
update clock opens, at each epoch's commit) and a rollback loads that copy back (`put_back`): a refit
continues from the states the last commit point left. A run without such callbacks pays one check per
window.

Every checkpoint file holds them under `callbacks`, by name (`now`, `stored`; read back by `load`): the
states as they are when the file is written, which is at a commit point (a snapshot after an update's
hooks, or after a rollback put them back; an epoch's end; outside a fit). A callback that holds tensors,
modules or optimizers of its own without those two methods is named once, in a warning, at the first file
written (`warn_unsaved`): a resume cannot give it back what it held.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref

import torch

from deepepochs.engine import position
from deepepochs.engine.carried import copied
from deepepochs.engine.context import Context
from deepepochs.errors import ConfigError, DeepEpochsWarning

__all__ = ["forget", "keep", "key", "load", "now", "put_back", "stateful", "stored", "warn_unsaved", "write"]


def key(callback) -> str:
    """The stable name `callback`'s state is kept under: its class's name, `[state_key]` appended when it
    has a `state_key` that is not None."""
    name = type(callback).__qualname__
    state_key = getattr(callback, "state_key", None)
    return name if state_key is None else f"{name}[{state_key}]"


def _keeps_state(callback) -> bool:
    return (callable(getattr(callback, "state_dict", None)) and callable(getattr(callback, "load_state_dict", None))
            and not isinstance(getattr(callback, "monitor_id", None), str))


def stateful(callbacks) -> dict:
    """The callbacks among `callbacks` whose state is run state, by `key`, in order; a `ConfigError` when
    two share a name."""
    found = {}
    for callback in callbacks:
        if _keeps_state(callback):
            name = key(callback)
            if name in found:
                raise ConfigError(f"two callbacks keep their state under the name {name!r} (got {found[name]!r}"
                                  f" and {callback!r}); give each a distinct state_key attribute, e.g."
                                  " callback.state_key = 'fast'")
            found[name] = callback
    return found


def keep(ctx: Context, fresh: bool = False) -> None:
    """A commit point: the run state's `callbacks` becomes a copy of every stateful callback's state as it is
    now (`fresh`, at a fit's start: also when there is none, so nothing of an earlier fit is kept)."""
    callbacks = ctx.parts.stateful
    if callbacks or fresh:
        ctx.run.callbacks = {name: copied(cb.state_dict()) for name, cb in callbacks.items()} or None


def write(callbacks: dict, saved: dict | None) -> None:
    """Load a copy of each state of `saved` (by name) into the callback of that name among `callbacks`;
    states of callbacks not attached are ignored, callbacks without a state in `saved` keep theirs."""
    for name, state in (saved or {}).items():
        callback = callbacks.get(name)
        if callback is not None:
            callback.load_state_dict(copied(state))


def put_back(ctx: Context) -> None:
    """Rollback: every stateful callback as the last commit point of the running fit kept it; the copies
    are then dropped (as `carried.put_back` does), the next fit takes them afresh."""
    write(ctx.parts.stateful, ctx.run.callbacks)
    forget(ctx)


def forget(ctx: Context) -> None:
    """The fit is over: nothing is kept outside a fit."""
    ctx.run.callbacks = None


def now(callbacks: dict) -> dict:
    """The states a checkpoint file holds: the callbacks' as they are (files are written at commit points)."""
    return {name: cb.state_dict() for name, cb in callbacks.items()}


def stored(states: dict) -> dict | None:
    """The states as a file holds them (`position.encode`: tensors on the CPU, dicts and tuples tagged), or
    None when there are none; a state a file cannot hold is left out with a `DeepEpochsWarning` naming its
    callback (a resume then leaves that callback as it is)."""
    out = {}
    for name, state in states.items():
        try:
            out[name] = position.encode(state)
        except TypeError as e:
            warnings.warn(f"a checkpoint cannot store the state of callback {name} ({e}): its state_dict() may hold"
                          " tensors, numbers, strings and lists, tuples or str-keyed dicts of them; a resume"
                          " leaves that callback as it is", DeepEpochsWarning, stacklevel=3)
    return out or None


def load(callbacks: dict, saved: dict | None, device: torch.device) -> None:
    """Give each callback of `callbacks` its state from a file's `callbacks` (`saved`, by name); nothing
    when the file has none (an older file)."""
    if saved:
        write(callbacks, {name: position.decode(state, device) for name, state in saved.items()})


def _held(value) -> bool:
    return isinstance(value, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer))


_WARNED: weakref.WeakSet = weakref.WeakSet()  # the callbacks `warn_unsaved` named


def _warned(callback) -> bool:
    try:
        return callback in _WARNED
    except TypeError:  # unhashable, or not weakly referable
        return False


def warn_unsaved(callbacks, model: torch.nn.Module, optimizers) -> None:
    """Warn once per callback that holds tensors, modules or optimizers of its
    own (not the trainer's model, its parts or parameters, nor its optimizers) as attributes without
    `state_dict()` and `load_state_dict()`: a file cannot give them back (what it collects in lists, such as
    records of a run, is not named).
    deepepochs' own callbacks keep their state elsewhere (the weight averages in the run state)."""
    trainers = {id(m) for m in model.modules()} | {id(p) for p in model.parameters()} | {id(o) for o in optimizers}
    for callback in callbacks:
        if _warned(callback) or _keeps_state(callback) or type(callback).__module__.startswith("deepepochs."):
            continue
        names = []
        for attr, value in getattr(callback, "__dict__", {}).items():
            if _held(value) and id(value) not in trainers:
                names.append(attr)
        if names:
            with contextlib.suppress(TypeError):  # an unhashable callback (a dataclass with eq) is named again
                _WARNED.add(callback)
            warnings.warn(f"callback {key(callback)} holds {', '.join(names)} (tensors, modules or optimizers),"
                          " which no checkpoint holds: a resume or a rollback leaves them as they are. Give it"
                          " state_dict() and load_state_dict(state) methods to have them saved and restored",
                          DeepEpochsWarning, stacklevel=3)
