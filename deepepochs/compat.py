"""Names deepepochs 0.6 exported: the helpers that come back, and for the rest an
ImportError that names what replaces them.

The helpers are written from what 0.6 documented them to do; `docs/MIGRATION.md` lists the decision for
every 0.6 name. `removed(name)` backs the package's module `__getattr__`: `from deepepochs import
StopLoopException` raises an ImportError whose message says what to use instead (an AttributeError would
be turned into Python's generic "cannot import name" message by the import machinery).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Mapping

import numpy as np
import torch

from deepepochs.errors import ConfigError, DeepEpochsWarning, MigrationWarning

__all__ = [
    "REMOVED",
    "MetricValue",
    "item_values",
    "moved",
    "TensorDict",
    "TensorTuple",
    "batches",
    "concat",
    "flatten_dict",
    "plot_confusion",
    "refuse_accelerate",
    "removed",
    "run_tensorboard",
    "sum_dicts",
    "tell_once",
    "to_numpy",
    "warn_at_user_code",
]


#: 0.6 names that do not come back, each with what replaces it.
REMOVED = {
    "StopLoopException": (
        "to stop training from a callback call trainer.request_stop(reason): the fit ends after the current"
        " epoch, with its checkpoints saved (CheckCallback(patience=...) does this for early stopping)"
    ),
    "LoopException": (
        "an error inside fit()/test() is re-raised as it is (not wrapped), with the flight record of the"
        " loop in its notes; catch the exception type you expect (deepepochs raises ConfigError,"
        " CheckpointError, DistributedError, InvalidTransition)"
    ),
    "CallbackException": (
        "callbacks raise deepepochs.ConfigError for configuration mistakes (e.g. a monitor naming a metric"
        " that does not exist); raise any exception of your own from a hook, fit() re-raises it unchanged"
    ),
    "Optimizers": (
        "pass several optimizers as a list, opt=[opt1, Optimizer(opt2, scheduler, sched_on='step')]; the"
        " trainer's trainer.opt is the sequence of deepepochs.Optimizer wrappers in optimize_index order"
    ),
    "LinearCosineScheduler": (
        "use PyTorch's schedulers, e.g. a linear warm-up then cosine decay over total steps: sched ="
        " torch.optim.lr_scheduler.SequentialLR(opt, [LinearLR(opt, start_factor=0.01, total_iters=warmup),"
        " CosineAnnealingLR(opt, T_max=total - warmup)], milestones=[warmup]), passed as"
        " Optimizer(opt, sched, sched_on='step')"
    ),
    # Internal helpers 0.6 exported through `from deepepochs import *`; none is part of 0.7's API.
    "make_runningid": (
        "name a run yourself: Trainer(running_id=f'{time.strftime(\"%Y%m%d-%H%M%S\")}-{task}-{seed}');"
        " without running_id the trainer names the run by its start time"
    ),
    "batch_size": (
        "the trainer infers a batch's sample count from its tensors; pass fit(batch_size=...)/EpochTask("
        "batch_size=...) an int or a function (batch_x, batch_y) -> int where it cannot, or use len(tensor)"
    ),
    "listify": "use list(x) (or [] for None, [x] for a single item) in your own code",
    "ddict": "use a plain dict, or types.SimpleNamespace(**d) for attribute access",
    "tensor_tuple": "use deepepochs.TensorTuple(items)",
    "compose_data": "use deepepochs.TensorTuple(items) for a tuple/list, deepepochs.TensorDict(d) for a dict",
    "clone_value": "use copy.deepcopy(value), or tensor.detach().clone()",
    "log_batch": "the console lines are written by the trainer (log_batch=True, log_tqdm=, log_long=)",
    "log_epoch": "the console lines are written by the trainer; records come back from fit()/test()",
    "info": "format metric values yourself, e.g. ' '.join(f'{k}: {v:.4f}' for k, v in metrics.items())",
    "print_out": "use print(...) (only the main process prints: check trainer.is_main_process)",
    "concat_dicts": "fit() returns per-epoch lists already: {'train': {name: [values]}, 'val': {...}}",
    "keyset": "use list(dict.fromkeys(k for d in dicts for k in d)) for the keys of several dicts in order",
    "detach_clone": "use deepepochs.TensorTuple(x).detach().clone() or tensor.detach().clone()",
    "check_path": "use os.makedirs(path, exist_ok=True)",
    "default_loss": (
        "pass loss=None to Trainer: the model's own loss (a scalar, or a dict with 'loss') is used"
    ),
    "SeriesPlots": "plot fit()'s records with matplotlib, or open TensorBoard on a LogCallback's folder",
    "Moveing": "use a running mean of your own, e.g. collections.deque(maxlen=n) and sum(q) / len(q)",
    "TopKQueue": "use heapq.nlargest(k, items), or InterpreteCallback(metric, k) for the k best/worst samples",
    "groupby_apply": "use torch.Tensor.index_reduce_ or scatter_reduce (reduce='mean', include_self=False)",
    "load_yaml": "use yaml.safe_load(open(path)) from PyYAML (not a dependency of deepepochs)",
    "CallbackPool": "pass callbacks=[...] to Trainer or call trainer.add_callbacks([...])",
    "DefaultCallback": (
        "the console output is the trainer's own (log_batch=, log_tqdm=, log_long=, show_info=); subclass"
        " deepepochs.Callback for behaviour of your own"
    ),
}


def removed(name: str):
    """The package's module `__getattr__`: raise ImportError for a 0.6 name that is gone, naming its
    replacement; AttributeError for any other missing name."""
    reason = REMOVED.get(name)
    if reason is None:
        raise AttributeError(f"module 'deepepochs' has no attribute {name!r}")
    raise ImportError(f"deepepochs.{name} (deepepochs 0.6) was removed: {reason}. See docs/MIGRATION.md.",
                      name=name)


def moved(module: str, names: dict[str, str] | None = None, target: str = "deepepochs"):
    """A module `__getattr__` for deepepochs 0.6's import paths (`deepepochs.loops`, `deepepochs.tools`,
    `deepepochs.optimizer`, `deepepochs.patches.ConfusionPatch`, `deepepochs.trainer.EpochTask`): a name of
    `names` (`{name: module it lives in now}`; None: any name `target` has) is returned from where it lives
    now, with a `DeprecationWarning` naming that path; a 0.6 name that is gone raises `removed`'s ImportError.
    The warning is raised from the `__getattr__` call, so it points at the user's import line."""
    import importlib

    def __getattr__(name: str):
        home = target if names is None else names.get(name)
        if name.startswith("__") or home is None:
            if name in REMOVED:
                removed(name)
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name, None)
        if value is None:
            if name in REMOVED:
                removed(name)
            raise AttributeError(f"module {module!r} has no attribute {name!r} (and {home} has none either)")
        warnings.warn(f"{module}.{name} is deepepochs 0.6's import path; import it as `from {home} import {name}`",
                      DeprecationWarning, stacklevel=2)
        return value

    return __getattr__


def warn_at_user_code(text: str, category: type[Warning]) -> None:
    """`warnings.warn(text, category)` attributed to the first caller outside the deepepochs package (the
    user's line that called `fit`, `test`, ...), however deep inside the library it is raised."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep

    def ours(filename: str) -> bool:  # the package's files, and the micro-batch code it generates
        return filename.startswith("<deepepochs") or os.path.abspath(filename).startswith(package)

    frame, level = sys._getframe(1), 1
    while frame is not None and ours(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(text, category, stacklevel=level + 1)


def tell_once(told: set, key: str, text: str) -> None:
    """A `MigrationWarning` (`warn_at_user_code`) the first time `key` is met in `told`, the set of what one
    trainer has said: a difference from deepepochs 0.6.18 is announced once per trainer."""
    if key not in told:
        told.add(key)
        warn_at_user_code(text, MigrationWarning)


_MIGRATION = "See docs/MIGRATION.md ('Accelerate arguments are gone')."


def _from_accelerate(obj, class_name: str) -> bool:
    """Whether `obj` is Hugging Face Accelerate's `class_name` (by name: Accelerate is not a dependency)."""
    cls = type(obj)
    return cls.__name__ == class_name and cls.__module__.split(".")[0] == "accelerate"


def refuse_accelerate(device, opt, legacy: dict) -> None:
    """`Trainer` arguments of deepepochs 0.6's Accelerate integration, refused before anything is built,
    each with what replaces it: `device=Accelerator(...)`, `auto_traindata_to_device=`, and optimizers
    returned by `accelerator.prepare` (which the trainer cannot step correctly). `legacy` holds the
    keyword arguments `Trainer` does not know; the trainer names any other one with its own error."""
    if _from_accelerate(device, "Accelerator"):
        precision = {"fp16": "'fp16'", "bf16": "'bf16'"}.get(str(getattr(device, "mixed_precision", "no")), "'fp32'")
        steps = getattr(device, "gradient_accumulation_steps", 1)
        raise ConfigError(
            "device=Accelerator(...) (deepepochs 0.6's Accelerate integration) is not supported: deepepochs"
            " does mixed precision, gradient accumulation and multi-process training itself. Pass"
            f" device=None (or 'cuda'/'cpu'), precision={precision}, gradient_accumulation_steps={steps} to"
            " Trainer, and start several processes with deepepochs.launch(main) or torchrun. " + _MIGRATION)
    if "auto_traindata_to_device" in legacy:
        raise TypeError(
            "Trainer() got the deepepochs 0.6 argument auto_traindata_to_device, which is gone: the trainer"
            " moves every batch to its device itself (inside a custom step that splits a batch, the"
            " sub-batches are on the device already), so drop the argument. " + _MIGRATION)
    for item in opt if isinstance(opt, (list, tuple)) else [opt]:
        inner = getattr(item, "opt", item)  # a deepepochs.Optimizer wrapper
        if _from_accelerate(inner, "AcceleratedOptimizer") or _from_accelerate(item, "AcceleratedOptimizer"):
            raise ConfigError(
                "opt is an Accelerate AcceleratedOptimizer (made by accelerator.prepare), which the trainer"
                " cannot step, scale or skip correctly: pass the torch optimizer itself (e.g. its"
                " .optimizer), and the scheduler unwrapped too; precision= and gradient_accumulation_steps="
                " replace what Accelerate did. " + _MIGRATION)


def run_tensorboard(log_dir, interactive: bool | None = None):
    """0.6's `run_tensorboard()` of the logging callbacks: start TensorBoard on `log_dir` and serve it in the
    foreground until Ctrl-C, as 0.6 did, when run from an interactive terminal; elsewhere (a script whose
    output goes to a file, a test, a notebook) warn with the command to run and return at once, so a
    finished script exits instead of hanging on a server.

    Args:
        log_dir: the folder of the runs (a logging callback's `log_dir`).
        interactive: whether to serve; None means "stdin and stdout are a terminal".

    Returns:
        TensorBoard's exit status when it was started and exited by itself, else None.
    """
    log_dir = os.fspath(log_dir)
    if interactive is None:
        interactive = all(stream is not None and stream.isatty() for stream in (sys.stdin, sys.stdout))
    how = (f"`tensorboard --logdir {log_dir}` in a shell, or `%load_ext tensorboard` and"
           f" `%tensorboard --logdir {log_dir}` in a notebook")
    if not interactive:
        warnings.warn(f"run_tensorboard() serves TensorBoard only from an interactive terminal; start it"
                      f" yourself: {how}", DeepEpochsWarning, stacklevel=3)
        return None
    print(f"TensorBoard on {log_dir} (press Ctrl-C to stop; or run {how})", flush=True)
    try:
        return subprocess.run([sys.executable, "-m", "tensorboard.main", "--logdir", log_dir],
                              check=False).returncode
    except KeyboardInterrupt:
        return None


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
