"""What a :class:`~deepepochs.patches.confusion.ConfusionPatch` may compute from its matrix: the names and functions
its ``metrics=`` accepts (this package's metrics, or a user's ``fn(cm)``), validated into (key, kind) pairs.
"""

from __future__ import annotations

import functools
import inspect

from deepepochs.errors import ConfigError
from deepepochs.metrics.counting import confusion_matrix
from deepepochs.metrics.functions import accuracy, f1, precision, recall

__all__ = ["DEFAULT_CONFUSION", "_CONFUSION_FUNCTIONS", "_CONFUSION_NAMES", "_confusion_specs"]

DEFAULT_CONFUSION = ("accuracy", "precision", "recall", "f1")
"""The metrics a ConfusionPatch computes by default."""

_CONFUSION_NAMES = ("accuracy", "precision", "recall", "f1", "confusion_matrix")
_CONFUSION_FUNCTIONS = {
    accuracy: "accuracy",
    precision: "precision",
    recall: "recall",
    f1: "f1",
    confusion_matrix: "confusion_matrix",
}

# deepepochs.metrics: the package whose functions take (preds, targets), whichever of its modules holds them.
_PACKAGE = __name__.rpartition(".")[0]


def _of_this_package(fn) -> bool:
    """Whether ``fn`` is defined in a module of :mod:`deepepochs.metrics`."""
    module = getattr(fn, "__module__", None) or ""
    return module == _PACKAGE or module.startswith(_PACKAGE + ".")


def _confusion_specs(metrics) -> tuple[tuple[str, object], ...]:
    """Normalise ``metrics=`` into (result key, metric kind) pairs, validating every entry. The kind is a
    name of :data:`_CONFUSION_NAMES`, or a user's function of the confusion matrix (called as ``fn(cm)``)."""
    items = (metrics,) if isinstance(metrics, str) or callable(metrics) else tuple(metrics)
    names = ", ".join(repr(name) for name in _CONFUSION_NAMES)
    if not items:
        raise ConfigError(f"metrics must name at least one of {names} (got an empty sequence)")
    specs = []
    for item in items:
        if isinstance(item, str) and item in _CONFUSION_NAMES:
            specs.append((item, item))
        elif isinstance(item, str) or not callable(item):
            raise ConfigError(
                f"metrics of a ConfusionPatch must be among {names} (got {item!r}); "
                "the deepepochs.metrics functions of those names work too"
            )
        else:
            # unwrap follows __wrapped__, so a renamed wrapper made with functools.wraps is recognised.
            base = inspect.unwrap(item)
            kind = next((k for fn, k in _CONFUSION_FUNCTIONS.items() if base is fn), None)
            name = getattr(item, "__name__", None) or type(item).__name__
            if kind is None:
                # deepepochs 0.6's pattern: any other function takes the confusion matrix itself, fn(cm).
                # A partial of one of deepepochs.metrics' functions still wants (preds, targets): refused.
                inner = inspect.unwrap(item.func) if isinstance(item, functools.partial) else None
                try:
                    inspect.signature(item).bind(None)
                    takes_matrix = not _of_this_package(inner)
                except (TypeError, ValueError):
                    takes_matrix = False
                if not takes_matrix:
                    raise ConfigError(
                        "metric_patch='confusion' supports only the deepepochs.metrics functions accuracy, "
                        "precision, recall, f1 and confusion_matrix, and functions of one confusion matrix "
                        f"fn(cm) -> value (got {name!r}); use metric_patch='tensor' for other metrics"
                    )
                kind = item
            specs.append((name, kind))
    keys = [key for key, _ in specs]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"metrics of a ConfusionPatch must have distinct names (got {keys})")
    return tuple(specs)
