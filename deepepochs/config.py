"""`TrainerConfig`: the validated, typed record of a Trainer's keyword arguments."""

from __future__ import annotations

import os

import attrs

from deepepochs.errors import ConfigError

__all__ = ["DATA_ORDERS", "METRIC_PATCHES", "NONFINITE", "OTHER_NAMES", "PRECISIONS", "RUN_LOCKS", "STRATEGIES",
           "UNBOUNDED_EPOCHS", "VAL_POINT_KEY", "TrainerConfig", "check_choice", "check_run_name",
           "decimal_variable", "unknown_keywords"]

PRECISIONS = ("fp32", "fp16", "bf16")
#: Other libraries' precision names (Lightning's, plain numbers) and what they are here.
PRECISION_ALIASES = {
    "16-mixed": "'fp16' (float16 autocast with a GradScaler)",
    "16": "'fp16' (float16 autocast with a GradScaler)",
    16: "'fp16' (float16 autocast with a GradScaler)",
    "bf16-mixed": "'bf16' (bfloat16 autocast)",
    "32-true": "'fp32'",
    "32": "'fp32'",
    32: "'fp32'",
    "16-true": "'fp16' for autocast; for float16 weights convert the model yourself (model.half())",
    "bf16-true": "'bf16' for autocast; for bfloat16 weights convert the model yourself (model.bfloat16())",
}
#: Other libraries' names for Trainer arguments (Lightning, Accelerate, ignite, Keras) and ours.
OTHER_NAMES = {
    "max_epochs": "epochs=",
    "num_epochs": "epochs=",
    "n_epochs": "epochs=",
    "max_steps": "max_updates=",
    "max_iters": "max_updates=",
    "val_check_interval": "fit(val_every_n_updates=...)",
    "eval_steps": "fit(val_every_n_updates=...)",
    "accumulate_grad_batches": "gradient_accumulation_steps=",
    "grad_accum_steps": "gradient_accumulation_steps=",
    "gradient_clip_val": ("callbacks=[GradClipCallback(max_norm, norm_type=2)] (clipping by norm, as Lightning does"
                          " by default; GradClipCallback(max_value) clips by value)"),
    "gradient_clip_algorithm": "callbacks=[GradClipCallback(max_value, norm_type)]",
    "accelerator": "device= (e.g. 'cuda', 'cpu')",
    "devices": "device= (one process), or deepepochs.launch(main, num_processes=n) for several",
    "mixed_precision": "precision= ('fp32', 'fp16' or 'bf16')",
    "optimizer": "opt=",
    "optimizers": "opt= (a list)",
    "loss_fn": "loss=",
    "criterion": "loss=",
    "ckpt_path": "resume= (True, or a running id), or trainer.load_checkpoint(path)",
    "default_root_dir": "CheckCallback(ckpt_dir=...) and LogCallback(log_dir=...)",
    "enable_progress_bar": "log_tqdm=",
    "strategy_kwargs": "ddp_kwargs= or fsdp_kwargs=",
}
METRIC_PATCHES = ("auto", "tensor", "mean", "confusion")
NONFINITE = ("raise", "skip")
STRATEGIES = ("ddp", "fsdp")
#: The training orders (`deepepochs.data.sampling`): the DataLoader's own, or the global (seed, epoch) one.
DATA_ORDERS = ("loader", "global")
#: What a fit does when another live process trains the same run (`deepepochs.checkpoint.run_lock`).
RUN_LOCKS = ("error", "wait", "off")


def check_choice(name: str, value, choices, hint: str = "") -> None:
    """Raise `ConfigError` unless `value` is one of `choices`, naming the argument and the choices."""
    if value not in choices:
        accepted = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{name} must be one of {accepted} (got {value!r}){'; ' + hint if hint else ''}")


def decimal_variable(name: str, value: str, what: str = "environment variable") -> int:
    """The non-negative integer an environment variable holds, written in ASCII digits (blanks around them
    allowed), else a `ConfigError` naming the variable. Why not `int()` alone: it also takes other scripts'
    digits ('٣'), underscores ('1_0') and a sign, and raises a bare `ValueError` on superscripts ('²')."""
    text = value.strip()
    if not (text.isascii() and text.isdecimal()):
        raise ConfigError(f"{what} {name} must be a non-negative integer (got {value!r}), written in"
                          " the digits 0-9")
    return int(text)


def unknown_keywords(owner: str, unknown, known) -> TypeError:
    """The error for keyword arguments `owner` does not take: each named with our argument when it is
    another library's name for one (`OTHER_NAMES`), else with the closest of `known`, if any."""
    import difflib  # only on this error path

    parts = []
    for name in unknown:
        ours = OTHER_NAMES.get(name)
        close = difflib.get_close_matches(name, list(known), n=1)
        hint = f" (did you mean {ours}?)" if ours else f" (did you mean {close[0]}=?)" if close else ""
        parts.append(f"{name!r}{hint}")
    return TypeError(f"{owner} got unexpected keyword argument(s): {', '.join(parts)}")


def _precision(_instance, attribute, value):
    alias = PRECISION_ALIASES.get(value) if isinstance(value, (str, int)) else None
    hint = f"{value!r} is another library's name: use {alias}" if alias else "use 'fp16' for float16 autocast"
    check_choice(attribute.name, value, PRECISIONS, hint)


#: The most bytes a run name may take: one folder name, which file systems limit to 255 bytes.
MAX_RUN_NAME_BYTES = 255


def check_run_name(name: str, argname: str) -> None:
    """Raise ConfigError unless `name` can be one folder name under a checkpoint or log folder: a
    non-empty string without path separators, not `.` or `..` (so it can never point outside them), of
    printable characters the file system encodes, at most `MAX_RUN_NAME_BYTES` bytes long."""
    if not isinstance(name, str):
        raise ConfigError(f"{argname} must be a str (or an int): it becomes a folder under ckpt_dir and log_dir"
                          f" (got {type(name).__name__})")
    bad = (not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name or os.path.isabs(name))
    if bad:
        raise ConfigError(f"{argname} must be a plain folder name (no path separators, not '.' or '..'): it"
                          f" becomes a folder under ckpt_dir and log_dir (got {name!r})")
    control = sorted({c for c in name if ord(c) < 32 or ord(c) == 127})
    if control:
        raise ConfigError(f"{argname} must hold printable characters only: it becomes a folder name (got {name!r},"
                          f" with {', '.join(map(repr, control))})")
    try:
        size = len(os.fsencode(name))
    except UnicodeError:
        raise ConfigError(f"{argname} holds characters this file system cannot store in a folder name (got"
                          f" {name!r}); use letters, digits, '-', '_' and '.'") from None
    if size > MAX_RUN_NAME_BYTES:
        raise ConfigError(f"{argname} must be at most {MAX_RUN_NAME_BYTES} bytes long, a folder name's limit (got"
                          f" {size} bytes: {name[:40]!r}...); use a shorter name")


def _choice(choices, hint=""):
    def check(_instance, attribute, value):
        check_choice(attribute.name, value, choices, hint)

    return check


def _data_order(_instance, attribute, value):
    if value is not None:
        check_choice(attribute.name, value, DATA_ORDERS,
                     "'loader' (one process) trains on the DataLoader's own order, 'global' on the (seed, epoch)"
                     " order every world size shares; leave it unset (None) for 'loader' in one process and"
                     " 'global' under several")


#: The epoch target of a fit with an update budget and no epoch target (`Trainer(max_updates=N)` alone):
#: more epochs than any run has, so the budget ends the fit (`TrainerConfig.epoch_target`).
UNBOUNDED_EPOCHS = 2**40
#: The column of the validation records that holds each validation point's update count (the update clock:
#: `fit(val_every_n_updates=M)` records one row per validation point, when it commits).
VAL_POINT_KEY = "updates"


def _optional_positive_int(_instance, attribute, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigError(f"{attribute.name} must be None or a positive int (got {value!r})")


def _epochs(instance, attribute, value):
    if value is None and instance.max_updates is not None:
        return  # unbounded: the update budget ends the fit
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        alone = "" if instance.max_updates is not None else ", or None with max_updates=N"
        raise ConfigError(f"epochs must be a positive int{alone} (got {value!r})")


def _positive_int(_instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{attribute.name} must be a positive int (got {value!r})")


def _positive_seconds(_instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigError(f"{attribute.name} must be a positive number of seconds, e.g. 600 (got {value!r})")


def _bool(_instance, attribute, value):
    if not isinstance(value, bool):
        raise ConfigError(f"{attribute.name} must be True or False (got {value!r})")


@attrs.define(frozen=True)
class TrainerConfig:
    """Options of a Trainer that are plain values (models, losses and callbacks are held elsewhere).

    Attributes:
        epochs: total epoch target; a resumed or repeated fit continues up to it. None (only with
            `max_updates`): unbounded, the update budget ends the fit.
        max_updates: total target in committed optimizer updates (an update skipped for inf/NaN counts), or
            None; with `epochs` too, whichever is reached first ends the fit.
        precision: 'fp32', 'fp16' (autocast + GradScaler) or 'bf16' (autocast, no scaler).
        gradient_accumulation_steps: DataLoader batches per optimizer update.
        metric_patch: how dataset-level metrics are aggregated: 'auto' (counts for the library's
            confusion-matrix metrics, other functions keep predictions), 'tensor', 'mean' or 'confusion';
            metric objects (torchmetrics) are streamed under every setting.
        nonfinite: fp32/bf16 behaviour on an inf/NaN loss in an update window: 'raise' or 'skip' the
            update (one host read per update, by design; fp16 relies on the GradScaler instead).
        split_batches: under DDP, divide each DataLoader's batch size by the world size.
        log_long, log_batch, log_tqdm, show_info: console options.
        compile_model: wrap the model in `torch.compile`.
        fuse_steps: where nothing can observe a micro-batch's inner states, take the spec's fused edges
            (one per micro-batch, see `spec/loop.py`); False takes every edge (a finer flight record,
            a little slower).
        strategy: with several processes, 'ddp' (replicated model) or 'fsdp' (FSDP2, sharded model).
        dist_timeout: seconds a collective may wait for the other ranks before the group fails (passed
            to `init_process_group` when the Trainer creates the group): a hung rank then ends the whole
            run with `DistributedError` instead of hanging it; joining the job waits as long at most.
            Default 600 (torch's default for gloo is 30 minutes).
        data_order: the training order of a plain DataLoader: 'loader' (one process only: the batches the
            DataLoader itself yields, as in a plain loop after the same seed), 'global' (the
            `DistributedSampler` order of (seed, epoch), the same for any world size), or None (the
            default: 'loader' in one process, 'global' under several).
        run_lock: what a fit does when another live process trains the same run (holds the lock on its
            checkpoint or log folder): 'error' (default) raises `RunLockedError` naming it, 'wait' waits for
            it to end, 'off' takes no lock (file systems without `flock`).
    """

    epochs: int | None = attrs.field(default=1000, validator=_epochs)
    precision: str = attrs.field(
        default="fp32", validator=_precision)
    gradient_accumulation_steps: int = attrs.field(default=1, validator=_positive_int)
    metric_patch: str = attrs.field(default="auto", validator=_choice(METRIC_PATCHES))
    nonfinite: str = attrs.field(default="raise", validator=_choice(NONFINITE))
    split_batches: bool = attrs.field(default=False, validator=_bool)
    log_long: bool = attrs.field(default=False, validator=_bool)
    log_batch: bool = attrs.field(default=True, validator=_bool)
    log_tqdm: bool = attrs.field(default=False, validator=_bool)
    show_info: bool = attrs.field(default=True, validator=_bool)
    compile_model: bool = attrs.field(default=False, validator=_bool)
    fuse_steps: bool = attrs.field(default=True, validator=_bool)
    strategy: str = attrs.field(
        default="ddp", validator=_choice(STRATEGIES, "'fsdp' shards the model with FSDP2 (fully_shard)"))
    dist_timeout: float = attrs.field(default=600, validator=_positive_seconds)
    data_order: str | None = attrs.field(default=None, validator=_data_order)
    run_lock: str = attrs.field(
        default="error", validator=_choice(RUN_LOCKS, "'error' fails when another process trains the run, 'wait'"
                                                      " waits for it to end, 'off' takes no lock"))
    max_updates: int | None = attrs.field(default=None, validator=_optional_positive_int)

    @property
    def epoch_target(self) -> int:
        """The epoch target a fit runs toward: `epochs`, or `UNBOUNDED_EPOCHS` when it is None (an update
        budget alone)."""
        return UNBOUNDED_EPOCHS if self.epochs is None else self.epochs
