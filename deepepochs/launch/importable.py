"""Whether spawned children can import ``main``, checked in the parent before any process starts.

A spawned child is a fresh interpreter that imports ``main`` by name; a lambda, a nested function, a
function of a notebook or one defined only under the script's ``if __name__ == '__main__':`` cannot be
found there, and would fail late and obscurely in every child. The errors say why and how to fix it.
"""

from __future__ import annotations

import ast
import pickle
import sys
from collections.abc import Callable
from typing import Any

from deepepochs.errors import ConfigError

__all__ = ["_check_importable"]

_IMPORTABLE_FIX = (
    "define main at the top level of an importable .py file and call launch(main) under "
    "`if __name__ == '__main__':` (in a notebook, save main to a module, import it and pass the imported "
    "function), or pass num_processes=1 to run it in this process"
)


def _check_importable(main: Callable[[], Any]) -> None:
    """Raise ConfigError when spawned children could not import ``main``.

    A spawned child is a new interpreter: it receives ``main`` pickled *by reference* (module name plus
    qualified name) and imports it again. That fails for objects that have no importable name, and it
    fails late and obscurely (an AttributeError in every child), so we check in the parent first.
    """
    name = getattr(main, "__qualname__", None) or getattr(main, "__name__", None) or repr(main)
    if getattr(main, "__name__", None) == "<lambda>":
        raise ConfigError(f"main is a lambda, which child processes cannot import; {_IMPORTABLE_FIX}")
    if "<locals>" in name:
        raise ConfigError(
            f"main ({name!r}) is defined inside another function, which child processes cannot import; "
            f"{_IMPORTABLE_FIX}"
        )
    # A script run as ``python train.py`` is fine: spawn re-imports it in each child as ``__mp_main__``.
    # An interactive session or a notebook kernel has a ``__main__`` without a file to re-import.
    if getattr(main, "__module__", None) == "__main__" and not hasattr(sys.modules["__main__"], "__file__"):
        raise ConfigError(
            f"main ({name!r}) is defined in an interactive session or notebook, whose code child processes "
            f"cannot import; {_IMPORTABLE_FIX}"
        )
    guard = _defined_only_under_main_guard(main)
    if guard is not None:
        raise ConfigError(
            f"main ({name!r}) is defined under `if __name__ == '__main__':` (line {guard} of "
            f"{sys.modules['__main__'].__file__}); child processes import the script without running that "
            f"block, so they cannot find main; {_IMPORTABLE_FIX}"
        )
    try:
        pickle.loads(pickle.dumps(main))
    except Exception as exc:
        raise ConfigError(
            f"main ({name!r}) cannot be pickled for the child processes "
            f"({type(exc).__name__}: {exc}); {_IMPORTABLE_FIX}"
        ) from exc


def _defined_only_under_main_guard(main: Callable[[], Any]) -> int | None:
    """The line where the script run as ``__main__`` defines ``main``'s name inside an
    ``if __name__ == '__main__':`` block, when nothing at its top level defines that name too; else None.

    A spawned child imports the script under another name (``__mp_main__``), so such a block never runs
    there and the child cannot find ``main``. Read from the script's source; a source that cannot be read
    or parsed gives None (the child's own error then carries its traceback)."""
    if getattr(main, "__module__", None) != "__main__" or "." in getattr(main, "__qualname__", "."):
        return None
    path = getattr(sys.modules["__main__"], "__file__", None)
    try:
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
    except (OSError, TypeError, SyntaxError, ValueError):
        return None
    name = main.__name__
    guarded_line = None
    for node in tree.body:
        if _is_main_guard(node):
            guarded_line = guarded_line or next(
                (inner.lineno for inner in ast.walk(node) if name in _names_bound(inner)), None)
        elif any(name in _names_bound(inner) for inner in ast.walk(node)):
            return None  # defined (or imported) outside the guard as well
    return guarded_line


def _is_main_guard(node: ast.stmt) -> bool:
    """Whether `node` is ``if __name__ == '__main__':`` (either operand order)."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare) or len(node.test.ops) != 1:
        return False
    sides = [node.test.left, *node.test.comparators]
    return (isinstance(node.test.ops[0], ast.Eq)
            and any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides)
            and any(isinstance(x, ast.Constant) and x.value == "__main__" for x in sides))


def _names_bound(node: ast.AST) -> set[str]:
    """The module-level names `node` itself binds (a def, a class, an assignment target, an import)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        return {node.id}
    return set()
