"""`EpochTask` and the per-run accumulators of a task's loss and metric patches."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import numpy as np
import torch

from deepepochs.data.batch_rules import batch_size_of, check_batch_size
from deepepochs.errors import ConfigError

__all__ = [
    "STEP_NAMES", "TASK_SUFFIX_NOTE", "BatchMetrics", "EpochTask", "TaskMeters", "check_metric_names", "flatten_value",
    "ahead_of", "merge_stage_metrics", "merge_values", "metric_name", "per_class", "rename", "step_kwargs",
]

#: Step-method lookup order per stage: `step` first, then the stage's own, then `evaluate_step`.
STEP_NAMES = {
    "train": ("step", "train_step"),
    "val": ("step", "val_step", "evaluate_step"),
    "test": ("step", "test_step", "evaluate_step"),
}


def rename(metric, name=None):
    """Give a metric function a display name: `rename(fn, 'acc')`, or as a decorator `@rename('acc')`.

    For a metric that returns a dict, `name` is a prefix of its keys: `@rename('m.')` reports
    `{'m.p': ..., 'm.r': ...}` for a result `{'p': ..., 'r': ...}`, and `@rename('')` keeps the keys as
    they are (as in deepepochs 0.6). The function itself is unchanged; a wrapper is returned.

    Example:
        >>> @rename('val_')
        ... def pr(preds, targets):
        ...     return {'p': precision(preds, targets), 'r': recall(preds, targets)}
        >>> acc = rename(accuracy, 'acc')
    """
    if isinstance(metric, str) and name is None:  # @rename('name')
        prefix = metric
        return lambda fn: rename(fn, prefix)
    if not callable(metric):
        raise ConfigError(f"rename needs a metric function: rename(fn, 'name') or @rename('name') (got"
                          f" {type(metric).__name__})")
    if not isinstance(name, str):
        raise ConfigError(f"rename's name must be a string (got {type(name).__name__}: {name!r})")

    def renamed(*args, **kwargs):
        value = metric(*args, **kwargs)
        if isinstance(value, Mapping):
            return {f"{name}{key}": v for key, v in value.items()}
        if not name:
            raise ConfigError(f"rename(fn, '') is for metrics that return a dict; {metric_name(metric)!r}"
                              " returned one value: give it a name")
        return value

    # '' keeps a dict's keys; the metric still needs a name of its own to key its patches.
    renamed.__name__ = renamed.__qualname__ = name or metric_name(metric)
    renamed.__wrapped__ = metric
    return renamed


def metric_name(metric: Callable) -> str:
    """The display name of a metric function."""
    return getattr(metric, "__name__", None) or type(metric).__name__


class EpochTask:
    """One DataLoader of a stage, with its own metrics and step arguments.

    Subclasses may define `step`, `train_step`, `val_step`, `test_step` or `evaluate_step`; those take
    precedence over the trainer's methods of the same name. Inside them, trainer attributes such as
    `self.model`, `self.loss`, `self.optimize` and `self.device` are reachable through the task, and so
    are deepepochs 0.6's `self.current_batch_size`, `self.max_epochs`, `self.main_process` and
    `self.print(...)`; the task itself has 0.6's `batchs`, `get_batch_size(batch_x, batch_y)` and (on a
    validation task) `val_freq`.

    Args:
        dataloader: a DataLoader or any iterable of batches.
        metrics: a metric function or a list of them, added to the stage's metrics.
        do_loss: whether evaluation computes the loss.
        batch_size: the sample count of a batch when it cannot be inferred from tensor shapes: an int
            (every batch counts that many samples) or a function `(batch_x, batch_y) -> int`.
        name: the suffix of the task's metric names in its stage's records (`name='ood'` reports
            `loss_ood`, `accuracy_ood`); None: a stage's first task reports plain names and a later task's
            clashing names get its index (`loss_1`).
        **step_args: extra keyword arguments passed to the step methods. `step_args={...}` is passed as
            one keyword argument `step_args` as deepepochs 0.6.18 did, or unpacked (as older 0.6 releases
            did) to a step method that takes no argument of that name.

    Example:
        >>> trainer.fit(train_tasks=[EpochTask(train_dl, metrics=[accuracy])], val_dl=val_dl)
    """

    def __init__(self, dataloader, metrics=None, do_loss: bool = True, batch_size: int | Callable | None = None,
                 *, name: str | None = None, **step_args):
        if dataloader is None or not hasattr(dataloader, "__iter__"):
            raise ConfigError(f"dataloader must be an iterable of batches (got {type(dataloader).__name__})")
        if name is not None and (not isinstance(name, str) or not name.isidentifier()):
            raise ConfigError(f"EpochTask name must be None or a word of letters, digits and '_', the suffix of the"
                              f" task's metric names, e.g. name='ood' reports loss_ood (got {name!r})")
        #: The suffix of the task's metric names (`loss_<name>`), or None: a stage's first task reports plain
        #: names, later ones their index (`loss_1`) where a name clashes.
        self.name = name
        self.dataloader = dataloader
        self.own_metrics = as_metric_list(metrics, "metrics")  # the task's own; `metrics` adds the stage's
        self.do_loss = do_loss
        self.batch_size = check_batch_size(batch_size)
        given = step_args.get("step_args")  # deepepochs 0.6 took them as one dict too: step_args={...}
        if given is not None and not isinstance(given, Mapping):
            raise ConfigError(f"step_args must be a dict of keyword arguments for the step methods (got"
                              f" {type(given).__name__})")
        self.step_args = step_args
        # Filled in when a stage adopts the task (Runner.make_tasks):
        self.trainer = None
        self.stage: str | None = None
        self.all_metrics: list = []  # the stage's metrics followed by the task's own
        self.data = dataloader  # what is iterated: the DataLoader, sharded under DDP
        self.step_fn = None  # the step method chosen for the stage
        self.val_freq: int | None = None  # a validation task's fit(val_freq=...), as 0.6 set it

    @property
    def metrics(self) -> list:
        """The metrics the task computes: once a stage adopted it, the stage's and the task's own (as
        0.6.18's `self.metrics` in a step), before that the task's own (`own_metrics`)."""
        return self.all_metrics if self.stage is not None else self.own_metrics

    @metrics.setter
    def metrics(self, value) -> None:
        self.own_metrics = as_metric_list(value, "metrics")

    @property
    def batchs(self) -> int:
        """The number of batches of the task's data (0.6's name; `len(task)`)."""
        return len(self)

    def get_batch_size(self, batch_x, batch_y) -> int:
        """A batch's sample count under this task's `batch_size=` rule (0.6's method): the int itself, the
        function's result, or dim 0 of the first tensor of the label, then of the inputs."""
        return batch_size_of(batch_x, batch_y, self.batch_size)

    def __getattr__(self, name):
        # Only called for attributes the task lacks: fall back to the trainer so that step methods
        # written on a task can use self.model, self.loss, self.optimize, ...
        trainer = self.__dict__.get("trainer")
        if trainer is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(trainer, name)

    def __len__(self):
        return len(self.dataloader)

    def __repr__(self):
        return f"{type(self).__name__}(stage={self.stage!r}, dataloader={type(self.dataloader).__name__})"


def step_kwargs(step_fn, step_args: dict) -> dict:
    """The keyword arguments a task's step method gets: `step_args` as given, except that a dict given as
    `step_args={...}` is unpacked when the method cannot take a keyword argument named `step_args`
    (0.6.18 passed it as that one keyword, older 0.6 releases unpacked it)."""
    given = step_args.get("step_args")
    if step_fn is None or not isinstance(given, Mapping):
        return step_args
    try:
        params = inspect.signature(step_fn).parameters.values()
    except (TypeError, ValueError):
        return step_args
    takes_it = lambda p: p.kind == p.VAR_KEYWORD or (p.name == "step_args" and p.kind != p.POSITIONAL_ONLY)
    if any(takes_it(p) for p in params):
        return step_args
    rest = {key: value for key, value in step_args.items() if key != "step_args"}
    return {**given, **rest}


def check_metric_names(metrics, where: str) -> list:
    """The metrics without repeats of the same function; two different metrics of one name are refused,
    since the second would silently replace the first."""
    out, seen = [], {}
    for m in metrics:
        name = metric_name(m)
        if name in seen:
            if seen[name] is m:
                continue
            raise ConfigError(f"two different metrics of {where} are both named {name!r}; one would replace"
                              f" the other: give one another name with rename(fn, 'name') or @rename('name')")
        seen[name] = m
        out.append(m)
    return out


def ahead_of(first: list, then: list, keep_first: bool = False) -> list:
    """Two metric lists as one in deepepochs 0.6.18's order: `first`, then `then`, a metric both hold
    listed once, where `then` has it (or, with `keep_first`, where `first` has it)."""
    if keep_first:
        return [*first, *(m for m in then if not any(m is f for f in first))]
    return [*(m for m in first if not any(m is t for t in then)), *then]


def as_metric_list(metrics, argname: str) -> list:
    if metrics is None:
        return []
    items = list(metrics) if isinstance(metrics, (list, tuple)) else [metrics]
    for m in items:
        if not callable(m):
            raise ConfigError(f"{argname} must be a callable or a list of callables (got {type(m).__name__})")
    return items


class TaskMeters:
    """Loss sums and metric patches of one run of a task; the open window's part is kept apart so an
    interrupt can drop it without touching what completed windows contributed."""

    __slots__ = ("loss_sum", "host_sum", "host", "count", "patches", "window_losses", "window_patches",
                 "metrics", "final", "skipped")

    def __init__(self, metrics=()):
        self.loss_sum: torch.Tensor | None = None
        self.host_sum = 0.0
        self.host: bool | None = None
        self.count = 0
        self.patches: dict = {}
        self.window_losses: list = []
        self.window_patches: list = []
        self.metrics: dict = {metric_name(m): m for m in metrics}  # the metrics the patches were made for
        self.final: dict | None = None  # the task's metrics, once computed (see Runner._task_metrics)
        self.skipped = 0  # updates skipped for inf/NaN (nonfinite='skip', fp16 overflow)

    def add_batch(self, loss: float | torch.Tensor | None, n: int, patches: Mapping | None) -> None:
        """Record one batch into the open window."""
        if loss is not None:
            self.window_losses.append((loss, n))
        if patches:
            self.window_patches.append(patches)

    def close_window(self) -> None:
        """Fold the window into the task totals.

        On the CPU a loss is read as a Python float (no device to sync with, and ~5x cheaper than an in-place
        tensor add); on an accelerator the sum stays on the device (one async add, no host sync).
        """
        host = self.host
        for loss, n in self.window_losses:
            if type(loss) is not float:  # a float was read on the host already
                if host is None:  # decided once: reading .device per batch costs more than the add
                    host = self.host = loss.device.type == "cpu"
                loss = float(loss) if host else loss.detach()
            self.add_done(loss, n, None)
        if self.window_patches:  # no metrics: nothing to fold or clear
            for patches in self.window_patches:
                self.fold_patches(patches)
            self.window_patches.clear()
        self.window_losses.clear()

    def fold_patches(self, patches: Mapping) -> None:
        """Add one batch's metric patches to the task totals."""
        self.final = None
        for name, patch in patches.items():
            have = self.patches.get(name)
            # The first batch's patch is copied so that the accumulator never aliases a batch's own
            # patch (callbacks may still read that batch's values later).
            self.patches[name] = patch.copy() if have is None else have.add(patch)

    def add_done(self, loss: float | torch.Tensor, n: int, patches: Mapping | None) -> None:
        """Count one completed batch: `loss` is a float read on the host, or a detached device tensor
        (summed on the device, no sync)."""
        self.final = None
        if type(loss) is float:
            self.host_sum += loss * n
        elif self.loss_sum is None:
            self.loss_sum = loss.double() * n
        else:
            self.loss_sum.add_(loss, alpha=n)
        self.count += n
        if patches:
            self.fold_patches(patches)

    def loss_total(self) -> torch.Tensor | float | None:
        """Sum of sample-weighted losses (None when no loss was recorded)."""
        if self.count == 0:
            return None
        return self.host_sum if self.loss_sum is None else self.loss_sum + self.host_sum

    def discard_window(self) -> None:
        """Forget the open window's contributions."""
        self.window_losses.clear()
        self.window_patches.clear()

    def skip_window(self, updates: int) -> None:
        """The window's update was skipped (`updates` optimizers skipped, none stepped): its batches stay out
        of the task's loss and metrics, which describe the batches that trained."""
        self.skipped += updates
        self.discard_window()


class BatchMetrics(Mapping):
    """A batch's metrics, computed (and synced to the host) only when a key is read."""

    def __init__(self, loss: torch.Tensor | None, patches: Mapping | None):
        self._loss = loss
        self._patches = patches or {}
        self._values: dict | None = None

    def _compute(self) -> dict:
        if self._values is None:
            values = {} if self._loss is None else {"loss": float(self._loss)}
            sources = dict.fromkeys(values, "the loss")
            for name, patch in self._patches.items():
                merge_values(values, sources, name, patch.forward(), getattr(patch, "name", None))
            self._values = values
        return self._values

    def __getitem__(self, key):
        return self._compute()[key]

    def __iter__(self):
        return iter(self._compute())

    def __len__(self):
        return len(self._compute())


TASK_SUFFIX_NOTE = (
    "Note: several tasks of a stage report the same names: the first task's keep them (`loss`), later"
    " tasks' get their index (`loss_1`, `loss_2`, ...); deepepochs 0.6 showed only the last task's values."
    " Monitor e.g. CheckCallback('loss_1') for a later task, or name the tasks: EpochTask(dl, name='ood')"
    " reports `loss_ood`."
)


def merge_stage_metrics(per_task: list[Mapping], task_names: list | None = None) -> dict:
    """A stage's metrics from its tasks' in order: a task named by the user (`task_names[i]`, the tasks'
    `EpochTask(name=...)`) suffixes all of its names with it (`loss_ood`); an unnamed task's name that a
    previous task reported gets the task's index as a suffix (`loss`, `loss_1`)."""
    metrics = {}
    for i, task_metrics in enumerate(per_task):
        suffix = task_names[i] if task_names else None
        for name, value in task_metrics.items():
            if suffix is not None:
                name = f"{name}_{suffix}"
            elif name in metrics:
                name = f"{name}_{i}"
            metrics[name] = value
    return metrics


def per_class(name: str, values) -> dict[str, float]:
    """A per-class (vector-valued) metric as one entry per class: `{name}.0`, `{name}.1`, ... These names
    go wherever scalar metrics go: console lines, records, TensorBoard tags, checkpoint monitors."""
    return {f"{name}.{i}": float(v) for i, v in enumerate(values)}


def merge_values(values: dict, sources: dict, name: str, value, prefix: str | None = None) -> None:
    """Add metric `name`'s result to `values`; a key another metric (or the loss) reported already is an
    error, not a silent overwrite. `sources` maps each key to the metric that reported it. `prefix` (a
    patch's `name`, e.g. `ConfusionPatch(..., name='C.')` as in 0.6) goes before the keys of a dict result."""
    if prefix and isinstance(value, Mapping):
        value = {f"{prefix}{key}": v for key, v in value.items()}
    for key, v in flatten_value(name, value).items():
        if key in values:
            raise ConfigError(
                f"metrics {sources[key]!r} and {name!r} both report {key!r}; one would overwrite the other:"
                f" prefix a dict metric's keys with @rename('{name}.') or rename(fn, '{name}.')"
            )
        values[key] = v
        sources[key] = name


def flatten_value(name: str, value) -> dict[str, float]:
    """Turn a metric result into `{name: float}`; a dict result contributes its own keys, a 1-D tensor or
    array of per-class values one key per class (`per_class`)."""
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            out.update(flatten_value(str(k), v))
        return out
    if isinstance(value, torch.Tensor):
        if value.dim() == 1 and value.numel() > 1:
            return per_class(name, value.tolist())
        if value.numel() != 1:
            raise ConfigError(
                f"metric {name!r} must return a scalar, a 1-D tensor of per-class values or a dict of them (got"
                f" a tensor of shape {tuple(value.shape)}); reduce it to one number or one value per class"
            )
        return {name: float(value)}
    if isinstance(value, np.ndarray) and value.ndim == 1 and value.size > 1:
        return per_class(name, value.tolist())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {name: float(value)}
    if isinstance(value, np.generic) and value.size == 1:
        return {name: float(value)}
    raise ConfigError(
        f"metric {name!r} must return a number, a one-element tensor or a dict of them (got"
        f" {type(value).__name__}: {value!r:.60})"
    )
