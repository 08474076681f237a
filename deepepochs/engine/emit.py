"""`emit`: the one function that fires a callback hook (a loop event of the spec's hook table).

Where each hook fires is stated in the spec (`Hook.after` / `Hook.before`: the edge it follows or precedes);
the engine calls `emit` there, with the hook's name from the generated `Event` enum, and nothing else
calls a callback's hook method. `before` hooks run in registration order, `after` hooks in reverse
(`HookTable` orders them once, when callbacks are attached).
"""

from __future__ import annotations

from deepepochs.engine.context import Context

__all__ = ["emit", "wrap_handlers"]


def emit(ctx: Context, hook: str, *args) -> None:
    """Run hook `hook` of every attached callback that overrides it, as `method(trainer, *args)`.

    Hot callers pass the plain string value of an `Event` member (a dict lookup by the member itself
    hashes through `Enum.__hash__`, several times slower); an event nobody handles costs one lookup."""
    handlers = ctx.parts.hooks.by_event[hook]
    if handlers:
        facade = ctx.parts.facade
        for handler in handlers:
            handler(facade, *args)


def wrap_handlers(by_event: dict[str, tuple], wrap) -> dict[str, tuple]:
    """A hook table's `by_event` with each handler replaced by `wrap(event, handler)`, same order (a profiled
    run times each hook this way, `deepepochs.engine.profiling`)."""
    return {event: tuple(wrap(event, handler) for handler in handlers) for event, handlers in by_event.items()}
