"""The helpers deepepochs 0.6 exported that come back, written from what 0.6 documented them to do: tensor
containers (`TensorTuple`, `TensorDict`), splitting and joining batches, metric values that answer `.item()`,
dict helpers, `to_numpy` and `plot_confusion`. `deepepochs.compat` re-exports them."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from deepepochs.errors import ConfigError

__all__ = [
    "MetricValue",
    "TensorDict",
    "TensorTuple",
    "batches",
    "concat",
    "flatten_dict",
    "item_values",
    "plot_confusion",
    "sum_dicts",
    "to_numpy",
]


class _TensorConversions:
    """`.to(...)`, `.cpu()`, `.detach()`, `.clone()`, `.float()`, `.long()`, `.int()`, `.data` and `.device`
    for a container of tensors: each applies to every tensor item through the container's `_map`."""

    def _map(self, fn):
        raise NotImplementedError

    def _items(self):
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        first = next((t for t in self._items() if isinstance(t, torch.Tensor)), None)
        return torch.device("cpu") if first is None else first.device

    @property
    def data(self):
        return self._map(lambda t: t.data)

    def to(self, *args, **kwargs):
        return self._map(lambda t: t.to(*args, **kwargs))

    def cpu(self):
        return self._map(torch.Tensor.cpu)

    def detach(self):
        return self._map(torch.Tensor.detach)

    def clone(self):
        return self._map(torch.Tensor.clone)

    def float(self):
        return self._map(torch.Tensor.float)

    def long(self):
        return self._map(torch.Tensor.long)

    def int(self):
        return self._map(torch.Tensor.int)


class TensorTuple(_TensorConversions, tuple):
    """A tuple of tensors that moves and converts like one tensor: `.to(...)`, `.cpu()`, `.detach()`,
    `.clone()`, `.float()`, `.long()`, `.int()`, `.data` and `.device` (the first tensor's). Items that are
    not tensors are kept as they are.

    Example:
        >>> out = TensorTuple([torch.zeros(2), torch.ones(2)]).to('cpu').detach()
    """

    def __new__(cls, tensors=()):
        if isinstance(tensors, torch.Tensor):
            tensors = (tensors,)
        return super().__new__(cls, tensors)

    def _map(self, fn) -> TensorTuple:
        return type(self)(fn(t) if isinstance(t, torch.Tensor) else t for t in self)

    def _items(self):
        return self


class TensorDict(_TensorConversions, dict):
    """A dict of tensors with the same conversions as `TensorTuple`, applied to every tensor value."""

    def _map(self, fn) -> TensorDict:
        return TensorDict((k, fn(v) if isinstance(v, torch.Tensor) else v) for k, v in self.items())

    def _items(self):
        return self.values()


def _rows(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.shape[0]
    if isinstance(obj, Mapping):
        return _rows(next(iter(obj.values())))
    return _rows(obj[0])


def _slice(obj, start: int, stop: int):
    if isinstance(obj, torch.Tensor):
        return obj[start:stop]
    if isinstance(obj, Mapping):
        return TensorDict((k, _slice(v, start, stop)) for k, v in obj.items())
    return TensorTuple(_slice(v, start, stop) for v in obj)


def batches(data, batch_size: int):
    """Split a batch into sub-batches of at most `batch_size` samples along dim 0, in order (the last one
    may be shorter), e.g. to accumulate gradients by hand in a custom step.

    Args:
        data: a tensor, or a tuple/list (yielding `TensorTuple` objects) or dict (yielding `TensorDict`
            objects) of tensors with the same number of rows.
        batch_size: the largest sub-batch, a positive int.

    Example:
        >>> for sub_x, sub_y in zip(batches(batch_x, 16), batches(batch_y, 16)):
        ...     self.loss(self.model(sub_x), sub_y, loss_adjust=len(sub_y) / len(batch_y), do_optimize=False)
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive int (got {batch_size!r})")
    if not isinstance(data, (torch.Tensor, Mapping, tuple, list)) or (not isinstance(data, torch.Tensor)
                                                                        and len(data) == 0):
        raise ConfigError(f"batches() splits a tensor or a non-empty tuple/list/dict of tensors (got"
                          f" {type(data).__name__})")
    n = _rows(data)
    for start in range(0, n, batch_size):
        yield _slice(data, start, min(start + batch_size, n))


def concat(parts, dim: int = 0):
    """Concatenate a list of tensors along `dim`; a list of tuples (or dicts) of tensors is concatenated
    position by position (key by key) into a `TensorTuple` (`TensorDict`): the inverse of `batches`.
    0-d tensors are stacked."""
    if not isinstance(parts, (list, tuple)) or not parts:
        raise ConfigError(f"concat() needs a non-empty list of tensors or of tuples/dicts of tensors (got"
                          f" {type(parts).__name__} of length {len(parts) if hasattr(parts, '__len__') else '?'})")
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.stack(list(parts)) if first.dim() == 0 else torch.cat(list(parts), dim=dim)
    if isinstance(first, Mapping):
        return TensorDict((k, concat([p[k] for p in parts], dim)) for k in first)
    if isinstance(first, (tuple, list)):
        return TensorTuple(concat(list(column), dim) for column in zip(*parts))
    raise ConfigError(f"concat() joins tensors, or tuples/dicts of tensors (got a list of {type(first).__name__})")


class MetricValue(float):
    """A metric value as a callback of the user's code receives it: a float that also answers `.item()`
    (deepepochs 0.6 handed hooks tensors, and 0.6 code calls `metrics['loss'].item()`). It pickles and
    copies as a plain float, so a record that keeps one holds nothing `torch.load(weights_only=True)`
    refuses."""

    __slots__ = ()

    def item(self) -> float:
        """The value as a plain float (what `tensor.item()` gave in 0.6)."""
        return float(self)

    def __reduce__(self):
        return (float, (float(self),))

    def __repr__(self) -> str:
        return float.__repr__(self)


class _ItemValues(Mapping):
    """A read-only view of a metrics mapping whose float values come as `MetricValue`s (computed lazily, so
    a batch's metrics are still synced only when a key is read)."""

    __slots__ = ("_metrics",)

    def __init__(self, metrics: Mapping):
        self._metrics = metrics

    def __getitem__(self, key):
        value = self._metrics[key]
        return MetricValue(value) if type(value) is float else value

    def __iter__(self):
        return iter(self._metrics)

    def __len__(self):
        return len(self._metrics)

    def __repr__(self) -> str:
        return repr(dict(self))


def item_values(metrics):
    """`metrics` (a mapping of metric values) as hooks of user callbacks see it: float values answer
    `.item()` (`MetricValue`); a dict becomes a new dict (the trainer's own records keep plain floats), a
    lazy mapping (a batch's metrics) a lazy view; anything else is returned as it is."""
    if isinstance(metrics, dict):
        return {k: MetricValue(v) if type(v) is float else v for k, v in metrics.items()}
    return _ItemValues(metrics) if isinstance(metrics, Mapping) else metrics


class _Sums(dict):
    """A dict whose keys also read as attributes (`sums.loss`), as 0.6's `sum_dicts` result did."""

    __slots__ = ()

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"sum_dicts(...) has no key {name!r} (keys: {sorted(map(str, self))})") from None


def sum_dicts(dicts):
    """Key-wise sum of dicts: `{k: d1[k] + d2[k] + ...}`; a key missing from some dicts sums the others.
    The keys read as attributes too (`sum_dicts(ds).loss`), as in 0.6."""
    out = _Sums()
    for d in dicts:
        for k, v in d.items():
            out[k] = v if k not in out else out[k] + v
    return out


def flatten_dict(d: Mapping, parent_key: str = "", sep: str = ".") -> dict:
    """A nested dict as one level, the keys of each level joined with `sep`, all behind `parent_key` when
    given: `{'a': {'b': 1}, 'c': 2}` -> `{'a.b': 1, 'c': 2}`; with `parent_key='p'`, `{'p.a.b': 1, 'p.c': 2}`.
    The argument order is deepepochs 0.6.18's, `(d, parent_key, sep)`."""
    out = {}
    for k, v in d.items():
        key = f"{parent_key}{sep}{k}" if parent_key else str(k)
        if isinstance(v, Mapping):
            out.update(flatten_dict(v, key, sep))
        else:
            out[key] = v
    return out


def to_numpy(data):
    """Tensors as NumPy arrays (detached, on the CPU), recursively through tuples, lists and dicts; other
    values are returned as they are."""
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu()
        if data.dtype == torch.bfloat16:  # NumPy has no bfloat16
            data = data.float()
        return data.numpy()
    if isinstance(data, Mapping):
        return {k: to_numpy(v) for k, v in data.items()}
    if isinstance(data, (tuple, list)):
        items = [to_numpy(v) for v in data]
        return type(data)(*items) if hasattr(data, "_fields") else type(data)(items)  # namedtuples too
    return data


def plot_confusion(cm, *args, **kwargs):
    """`plot_confusion(cm, class_names=None, normalize=False, title=None, cmap='Blues')`, or in deepepochs
    0.6.18's signature `plot_confusion(cm, class_num, class_names=None, norm_dec=2, cmap='Blues', info='')`
    (told apart by an int second argument, or `class_num=`): the same figure, 0.6.18's title
    ("Confusion matrix (<count>)" and `info`); `norm_dec` is accepted and, as in 0.6.18, changes nothing
    (the counts are drawn as integers). See `_plot_confusion` for the arguments.
    """
    legacy = "class_num" in kwargs or (args and isinstance(args[0], int) and not isinstance(args[0], bool))
    return _plot_confusion_0618(cm, *args, **kwargs) if legacy else _plot_confusion(cm, *args, **kwargs)


def _plot_confusion_0618(cm, class_num, class_names=None, norm_dec=2, cmap="Blues", info=""):
    """0.6.18's signature of `plot_confusion`."""
    counts = np.asarray(to_numpy(cm))
    if counts.ndim != 2 or counts.shape[0] != class_num:
        raise ConfigError(f"class_num must be the size of the [C, C] matrix cm (got class_num={class_num} for"
                          f" a matrix of shape {list(counts.shape)})")
    names = class_names if class_names and len(class_names) == class_num else None  # 0.6.18 ignored others
    title = f"Confusion matrix ({int(counts.sum())})" + (f"\n{info}" if info else "")
    return _plot_confusion(cm, names, title=title, cmap=cmap)


def _plot_confusion(cm, class_names=None, normalize: bool = False, title: str | None = None, cmap: str = "Blues"):
    """Draw a confusion matrix (rows: true class, columns: predicted class) with its counts in the cells;
    returns the matplotlib Figure (e.g. for `writer.add_figure` or `fig.savefig`).

    matplotlib is not a dependency of deepepochs: install it (`pip install matplotlib`) to use this.

    Args:
        cm: a `[C, C]` tensor or array of counts, e.g. from `deepepochs.metrics.confusion_matrix`.
        class_names: C labels for the axes (default 0..C-1).
        normalize: show each row as fractions of its true class (rows that are all zero stay zero).
        title: the figure's title.
        cmap: the matplotlib colour map.
    """
    cm = np.asarray(to_numpy(cm), dtype=np.float64)
    if cm.ndim != 2 or cm.shape[0] != cm.shape[1]:
        raise ConfigError(f"cm must be a square [C, C] matrix of counts (got shape {list(cm.shape)})")
    c = cm.shape[0]
    names = [str(i) for i in range(c)] if class_names is None else [str(n) for n in class_names]
    if len(names) != c:
        raise ConfigError(f"class_names must hold {c} names for a {c}x{c} matrix (got {len(names)})")
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("plot_confusion needs matplotlib, which deepepochs does not install: pip install"
                          " matplotlib") from e
    if normalize:
        rows = cm.sum(axis=1, keepdims=True)
        cm = np.divide(cm, rows, out=np.zeros_like(cm), where=rows > 0)
    fig = Figure(figsize=(1 + 0.6 * c, 1 + 0.6 * c))  # no pyplot: nothing global, works without a display
    ax = fig.add_subplot()
    ax.imshow(cm, cmap=cmap)
    ax.set_xticks(range(c), names, rotation=45)
    ax.set_yticks(range(c), names)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    high = cm.max() if cm.size else 0
    for i in range(c):
        for j in range(c):
            text = f"{cm[i, j]:.2f}" if normalize else f"{int(cm[i, j])}"
            ax.text(j, i, text, ha="center", va="center", color="white" if cm[i, j] > high / 2 else "black")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig
