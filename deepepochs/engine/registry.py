"""The registry of the spec's guards and actions: name -> function of the run-time `Context`.

`deepepochs.engine.actions` holds the loop's guards and actions and the registry's checks; the update
clock's are in `deepepochs.engine.clock_rules`. Both register here; registering a name twice fails at import.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

__all__ = ["ACTIONS", "GUARDS", "action", "guard"]

GUARDS: dict[str, Callable] = {}
ACTIONS: dict[str, Callable] = {}


def _register(table: dict, kind: str, fn: Callable) -> Callable:
    if fn.__name__ in table:
        raise RuntimeError(f"{kind} {fn.__name__!r} is implemented twice")
    table[fn.__name__] = fn
    return fn


guard = functools.partial(_register, GUARDS, "guard")
action = functools.partial(_register, ACTIONS, "action")
