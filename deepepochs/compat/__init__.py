"""Names deepepochs 0.6 exported: the helpers that come back, and for the rest an
ImportError that names what replaces them.

The helpers (`deepepochs.compat.helpers`) are written from what 0.6 documented them to do;
`docs/MIGRATION.md` lists the decision for every 0.6 name. `removed(name)` backs the package's module
`__getattr__`: `from deepepochs import StopLoopException` raises an ImportError whose message says what to
use instead (an AttributeError would be turned into Python's generic "cannot import name" message by the
import machinery).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

from deepepochs.compat.helpers import (
    MetricValue,
    TensorDict,
    TensorTuple,
    batches,
    concat,
    flatten_dict,
    item_values,
    plot_confusion,
    sum_dicts,
    to_numpy,
)
from deepepochs.errors import ConfigError, DeepEpochsWarning, MigrationWarning

__all__ = [
    "ANNOUNCED",
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
    "told",
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
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # deepepochs/, not compat/

    def ours(filename: str) -> bool:  # the package's files, and the micro-batch code it generates
        return filename.startswith("<deepepochs") or os.path.abspath(filename).startswith(package)

    frame, level = sys._getframe(1), 1
    while frame is not None and ours(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(text, category, stacklevel=level + 1)


# The differences from deepepochs 0.6.18 this process has announced (`tell_once`): each is said at most once
# per process, however many trainers meet it (a test that needs one said again clears it).
ANNOUNCED: set[str] = set()


def told(key: str) -> bool:
    """Whether this process has announced the difference `key` (so its check can be skipped)."""
    return key in ANNOUNCED


def tell_once(key: str, text: str) -> None:
    """A `MigrationWarning` (`warn_at_user_code`) the first time this process meets the difference `key` from
    deepepochs 0.6.18; said at most once per process. The warning is for code whose meaning differs: code
    that means the same in 0.6.18 and 0.7 never reaches here. `warnings.filterwarnings('ignore',
    category=deepepochs.MigrationWarning)` silences all of them."""
    if key not in ANNOUNCED:
        ANNOUNCED.add(key)
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
