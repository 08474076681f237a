"""`Callback` and the table that dispatches loop events to the callbacks that handle them."""

from __future__ import annotations

import inspect

from deepepochs.compat import item_values
from deepepochs.errors import ConfigError
from deepepochs.fsm.events import CallbackHooks
from deepepochs.fsm.machine import load_spec

__all__ = ["Callback", "HookTable"]


class Callback(CallbackHooks):
    """Base class of callbacks: override the `on_*` methods you need (names and arguments come from the
    loop spec; see `deepepochs.Event`).

    `before` hooks run in the order callbacks were given, `after` hooks in reverse order, so a callback
    wraps the ones registered after it. A callback can stop the fit at the end of the epoch with
    `trainer.request_stop(reason)`.

    Indices passed to hooks are 0-based, as in deepepochs 0.6: `epoch_idx` is 0 in the first epoch and
    `batch_idx` is 0 for a task's first batch (the console shows `E 1/5`, and `trainer.loop.epoch` /
    `trainer.loop.batch_idx` count from 1).

    `idle_hooks` names overridden hooks that this instance does not use in its configuration (read when
    the callback is attached to a trainer): they are never called, and a per-batch one no longer keeps
    training batches off the machine's fused edges, which are much cheaper on a small model.

    Example:
        >>> class PrintLoss(Callback):
        ...     def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics,
        ...                        epoch_idx):
        ...         print(epoch_idx, train_metrics["loss"])
    """

    idle_hooks: frozenset[str] = frozenset()

    def __init__(self, priority=None):
        if priority is not None:  # 0.6's Callback(priority=...): refuse it with what to do instead
            raise TypeError(
                f"{type(self).__name__}: Callback(priority=...) (deepepochs 0.6) was removed: before hooks run in"
                " the order of Trainer(callbacks=[...]), after hooks in reverse; order that list instead"
                " (see docs/MIGRATION.md)"
            )


class HookTable:
    """Per event, the bound methods of the callbacks that override it, in dispatch order.

    Only overriding callbacks are listed, so an event nobody handles costs one empty-tuple loop.
    """

    def __init__(self, callbacks=()):
        self.callbacks: list[Callback] = []
        self.by_event: dict[str, tuple] = {}
        self.extend(callbacks)

    def extend(self, callbacks) -> None:
        """Attach more callbacks (checked now, not at batch 10,000)."""
        for cb in callbacks:
            check_callback(cb)
            self.callbacks.append(cb)
        self._compile()

    def attach(self, callbacks, trainer) -> list:
        """Attach `callbacks` (one or a list) to `trainer`: checked and added, then each one's
        `on_attach(trainer)` called. Returns the `clip` methods of those that clip gradients (the
        trainer's clippers, called by the clip_gradients action)."""
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        self.extend(callbacks)
        clippers = []
        for cb in callbacks:
            if callable(getattr(cb, "clip", None)):
                clippers.append(cb.clip)
            attach = getattr(cb, "on_attach", None)
            if callable(attach):
                attach(trainer)
        return clippers

    def close(self, trainer) -> list[Exception]:
        """Call every callback's `on_close(trainer)`, all of them even if some fail; returns what they
        raised, in order (the trainer raises the first once it has closed the rest)."""
        errors = []
        for cb in self.callbacks:
            closer = getattr(cb, "on_close", None)
            if callable(closer):
                try:
                    closer(trainer)
                except Exception as e:
                    errors.append(e)
        return errors

    def remove(self, callbacks) -> None:
        """Detach callbacks (by identity)."""
        ids = {id(c) for c in callbacks}
        self.callbacks = [c for c in self.callbacks if id(c) not in ids]
        self._compile()

    def _compile(self) -> None:
        by_event = {}
        for hook in load_spec().hooks:
            base = getattr(CallbackHooks, hook.name)
            handlers = [_handler(cb, hook) for cb in self.callbacks
                        if getattr(type(cb), hook.name, base) is not base
                        and hook.name not in getattr(cb, "idle_hooks", ())]
            by_event[hook.name] = tuple(reversed(handlers) if hook.is_after else handlers)
        self.by_event = by_event

    def __getitem__(self, event: str) -> tuple:
        return self.by_event[event]


#: hook arguments that hold metric values (`MetricValue`s for the user's callbacks)
METRIC_ARGS = frozenset({"metrics", "train_metrics", "val_metrics"})


def _binds_positionally(method, args) -> bool:
    try:
        inspect.signature(method).bind(*args)
    except TypeError:
        return False
    return True


def _handler(cb, hook):
    """What the table calls for `cb`'s `hook`: the bound method, called as `method(trainer, *args)`;
    wrapped when the method is the user's (not defined in deepepochs), whose metric arguments then answer
    `.item()` as 0.6's tensors did (`compat.item_values`), or when the method takes the arguments by
    keyword only (0.6 passed every hook argument by keyword: `def on_after_train_batch(self, trainer,
    **kwargs)`)."""
    method = getattr(cb, hook.name)
    names = ("trainer", *hook.args)
    by_keyword = not _binds_positionally(method, names)
    users = not (getattr(method, "__module__", None) or "").startswith("deepepochs.")  # where it is defined
    metric_at = [i for i, name in enumerate(hook.args) if name in METRIC_ARGS] if users else []
    if not by_keyword and not metric_at:
        return method

    def call(trainer, *args):
        if metric_at:
            args = list(args)
            for i in metric_at:
                args[i] = item_values(args[i])
        if by_keyword:
            return method(**dict(zip(names, (trainer, *args))))
        return method(trainer, *args)

    call.__name__ = call.__qualname__ = hook.name
    call.__wrapped__ = method
    return call


def check_callback(cb) -> None:
    """Raise `ConfigError` if `cb` is not a Callback or overrides a hook with an incompatible signature."""
    if not isinstance(cb, CallbackHooks):
        raise ConfigError(f"callbacks must be deepepochs.Callback instances (got {type(cb).__name__})")
    hooks = {hook.name for hook in load_spec().hooks}
    idle = getattr(cb, "idle_hooks", ())
    try:
        unknown = [idle] if isinstance(idle, str) else sorted(map(repr, set(idle) - hooks))
    except TypeError:  # not an iterable of hashable items
        unknown = [repr(idle)]
    if unknown:
        raise ConfigError(f"{type(cb).__name__}.idle_hooks must be a set of hook names such as"
                          f" 'on_after_train_batch' (see deepepochs.Event); got {idle!r}, not hooks: {unknown}")
    for hook in load_spec().hooks:
        method = getattr(type(cb), hook.name, None)
        if method is None or method is getattr(CallbackHooks, hook.name):
            continue
        args = ["trainer", *hook.args]
        method = getattr(cb, hook.name)
        if _binds_positionally(method, args):
            continue
        try:  # 0.6's keyword style, def on_after_train_batch(self, trainer, **kwargs)
            inspect.signature(method).bind(**dict.fromkeys(args))
        except TypeError:
            sig = inspect.signature(method)
            raise ConfigError(
                f"{type(cb).__name__}.{hook.name}{sig} cannot take the hook's arguments"
                f" ({', '.join(args)}), by position or by keyword; define it as"
                f" def {hook.name}(self, {', '.join(args)})"
            ) from None

