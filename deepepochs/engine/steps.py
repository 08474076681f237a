"""Inside a step: the default step, `loss` (backward with the micro-batch's share), `optimize` (the
optimize layer of the machine), `no_sync`, and the step result's checks.

The `Trainer` methods of the same names delegate here, so a custom step and the default step move the
machine through the same functions. Where does a micro-batch's loss get its share of the window? In
`loss`, here; the window's total is normalised once, in the `unscale_gradients` action.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch

from deepepochs import torch_private
from deepepochs.compat import tell_once, told
from deepepochs.data.batch_rules import call_model
from deepepochs.data.outputs import detached, label_split, metric_preds, unpicked_preds
from deepepochs.engine import actions, finite
from deepepochs.engine.context import Context
from deepepochs.engine.emit import emit
from deepepochs.errors import ConfigError
from deepepochs.fsm.events import Event, StateName, TriggerName
from deepepochs.patches import PatchBase, ValuePatch
from deepepochs.patches.selection import make_patches
from deepepochs.patches.streaming import is_metric_object
from deepepochs.protocols import monitors_in
from deepepochs.tasks import merge_stage_metrics, merge_values, metric_name

__all__ = [
    "backpropagate", "batch_patches", "check_metrics_without_targets", "check_step_result", "close_cut_window",
    "compute_loss", "count_batch", "custom_step", "default_step", "dict_batch_counted", "first_batch_checks",
    "forward", "loss", "loss_value", "name_by_key", "no_sync", "optimize", "padding_forward", "predict_step",
    "read_batch", "report_loss", "select_update", "step_metrics", "step_patches", "user_backward", "user_loss",
]

#: Per stage, the hooks a step fires: before and after the forward pass, before the metrics.
STEP_HOOKS = {
    "train": (Event.BEFORE_TRAIN_FORWARD.value, Event.AFTER_TRAIN_FORWARD.value, Event.TRAIN_METRICS.value),
    "val": (Event.BEFORE_VAL_FORWARD.value, Event.AFTER_VAL_FORWARD.value, Event.VAL_METRICS.value),
    "test": (Event.BEFORE_TEST_FORWARD.value, Event.AFTER_TEST_FORWARD.value, Event.TEST_METRICS.value),
}
BEFORE_BACKWARD, AFTER_BACKWARD = Event.BEFORE_BACKWARD.value, Event.AFTER_BACKWARD.value
BEFORE_OPTIMIZE, AFTER_OPTIMIZE = Event.BEFORE_OPTIMIZE.value, Event.AFTER_OPTIMIZE.value
# The hot triggers a step fires and the state it tests, as plain strings: looking a member up on an Enum
# class costs ~0.5 us, and hashing one in the machine's table as much again, per use.
BACKWARD, OPTIMIZE, CLIP = TriggerName.BACKWARD.value, TriggerName.OPTIMIZE.value, TriggerName.CLIP.value
APPLY_UPDATE, FINISH_UPDATE = TriggerName.APPLY_UPDATE.value, TriggerName.FINISH_UPDATE.value
END_BATCH = TriggerName.END_BATCH.value
OPTIMIZE_UNSCALED = StateName.OPTIMIZE_UNSCALED.value


def default_step(ctx: Context, batch_x, batch_y, stage: str):
    """The step every stage runs unless the user defines one: forward, the loss (in training: backward),
    metric patches, and in training the update. The patches are made before the update so that they are
    part of what the update commits. A compiled micro-batch (`deepepochs.engine.compiled`) calls the same
    pieces (`forward`, `loss_value`, `backpropagate`, `step_patches`, `select_update`) between its hops."""
    model_out = forward(ctx, batch_x, stage)
    value = None
    if stage == "train" or ctx.task.do_loss:
        value = loss(ctx, model_out, batch_y, 1.0, False)
    patches = step_patches(ctx, stage, batch_x, model_out, batch_y, value)
    if stage == "train":
        optimize(ctx, None)
    return patches


def forward(ctx: Context, batch_x, stage: str):
    """The step's forward pass between the stage's forward hooks; returns the model's output."""
    hooks = ctx.parts.hooks.by_event  # asked here first: a micro-batch no hook watches makes no emit call
    before_forward, after_forward, _ = STEP_HOOKS[stage]
    if hooks[before_forward]:
        emit(ctx, before_forward)
    model_out = call_model(ctx.model, batch_x)  # under the step's autocast (batches.train_batches)
    if hooks[after_forward]:
        emit(ctx, after_forward, model_out)
    return model_out


def step_patches(ctx: Context, stage: str, batch_x, model_out, batch_y, value):
    """The default step's metrics: the stage's `on_*_metrics` hooks, then the task's metric patches (and,
    at a task's first batch, `first_batch_checks`); in training they are kept in `ctx.step_patches`, so a
    rollback after the update commits them. Returns the patches (None without metrics)."""
    task, metrics_hook = ctx.task, STEP_HOOKS[stage][2]
    if ctx.parts.hooks.by_event[metrics_hook]:
        emit(ctx, metrics_hook, value, model_out, batch_y, task)
    patches = None
    if task.all_metrics or ctx.first_batch:
        pick = ctx.parts.pick_targets
        preds, targets = (metric_preds(model_out, batch_y), batch_y) if pick is None else pick(batch_x, model_out)
        try:  # free when nothing raises (Python >= 3.11)
            patches = batch_patches(ctx, preds, targets) if task.all_metrics else None
        except Exception as e:
            if isinstance(preds, Mapping) and targets is not None:
                raise unpicked_preds(preds, f"the metrics {[metric_name(m) for m in task.all_metrics]}", e) from e
            raise
        if ctx.first_batch:
            first_batch_checks(ctx, stage, value, preds, targets, patches)
    if stage == "train":
        ctx.step_patches = patches
    return patches


def dict_batch_counted(ctx: Context):
    """What a task's batch splitter calls for a dict batch whose samples it counted (`batch_splitter`'s
    `counted_dict`): deepepochs 0.6.18 took the number of keys as the batch size, so it weighed every batch
    alike. That means the same as 0.7's weights while every batch has as many samples as the first; the
    first dict batch of another size says once per process how 0.6.18 differed. None once said, so later
    tasks pay nothing."""
    if told("dict-batch-size"):
        return None
    sizes = set()

    def counted(batch, n: int) -> None:
        sizes.add(n)
        if len(sizes) == 1:
            return  # every batch so far weighs the same in both versions
        tell_once("dict-batch-size",
                  f"a dict batch weighs its {n} samples (the first dimension of its tensors) in the epoch's loss"
                  f" and mean metrics; deepepochs 0.6.18 took its number of keys ({len(batch)}) as its size, so"
                  " every batch weighed the same, a short last batch too. For 0.6.18's weights pass"
                  f" batch_size={len(batch)} to fit()/test() (every batch then counts as that many samples)")

    return counted


def read_batch(ctx: Context, split, batch, is_last: bool):
    """Count a training micro-batch in its task (1-based `batch_idx`), decide whether it closes its window
    (`window_boundary`, which the `begin_batch` edge asks: `is_last`, the task's last batch, or the window's
    k-th), split it with `split` (`batch_rules.batch_splitter`) and clear the batch's scratch. Its place in the
    window is counted by the `begin_batch` edge (`count_micro_batch`). Returns `(batch_x, batch_y, n)`."""
    loop = ctx.loop
    loop.batch_idx += 1
    loop.window_boundary = is_last or loop.window_pos + 1 == loop.window_size
    batch_x, batch_y, n = split(batch)
    ctx.batch_n, ctx.step_loss, ctx.step_patches, ctx.batch_counted = n, None, None, False
    return batch_x, batch_y, n


def count_batch(ctx: Context, meters, result, n: int):
    """Put a step's result (`check_step_result`) and its loss into the task's meters; returns
    `(loss value, patches)`. A `loss` patch the step returned replaces the loss the trainer saw."""
    patches = None if result is None else check_step_result(result, n)
    value = None if patches and "loss" in patches else ctx.step_loss
    meters.add_batch(value, n, patches)
    ctx.batch_counted = True
    return value, patches


def first_batch_checks(ctx: Context, stage: str, value, preds, targets, patches) -> None:
    """A task's first batch, before its update: run its metrics on that batch, so that a metric returning
    a non-number is a ConfigError now, not after a whole epoch; at the fit's first training batch, also
    hand the checkpoint monitors (e.g. `CheckCallback`) the metric names each stage will report, worked out
    from this batch (the validation metrics run on it too), so a monitor naming no metric fails now.

    Only our own checks fail here: a metric that raises on one batch (e.g. an AUC seeing one class) is
    left to the task's end, where it runs on all the data. Costs one run of the metrics, once per task.
    `preds`, `targets`: what the metrics get for this batch (`Trainer(targets=...)` applied)."""
    ctx.first_batch = False
    names = _patch_names(patches, preds if isinstance(preds, Mapping) and targets is not None else None)
    if stage != "train" or ctx.monitor_check is None:
        return
    (train_tasks, val_tasks), ctx.monitor_check = ctx.monitor_check, None
    monitors = [m for m in monitors_in(ctx.parts.hooks.callbacks) if hasattr(m, "check_names")]
    if not monitors:
        return
    stages = {}
    if names is not None and len(train_tasks) == 1:
        stages["train"] = (["loss"] if value is not None else []) + names
    if val_tasks and all(task.step_fn is None for task in val_tasks):
        per_task = []
        with torch.no_grad():
            for task in val_tasks:
                task_names = _patch_names(batch_patches(ctx, preds, targets, task.all_metrics))
                if task_names is None:
                    break
                per_task.append(dict.fromkeys((["loss"] if task.do_loss else []) + task_names))
            else:
                stages["val"] = list(merge_stage_metrics(per_task, [task.name for task in val_tasks]))
    for monitor in monitors:
        monitor.check_names(stages)


def _patch_names(patches, unpicked=None) -> list[str] | None:
    """The metric names `patches` report, computed on what they hold (a non-number result: ConfigError);
    None when a metric raised its own error (left to the task's end), unless it got `unpicked`, a mapping
    output no rule picked the predictions from: then the error says how to pick them."""
    values, sources = {}, {}
    for name, patch in (patches or {}).items():
        try:
            result = patch.forward()
        except Exception as e:
            if unpicked is not None:
                raise unpicked_preds(unpicked, f"metric {name!r}", e) from e
            return None
        merge_values(values, sources, name, result, getattr(patch, "name", None))  # as at the task's end
    return list(values)


def predict_step(ctx: Context, outputs: list, device: torch.device | None, batch_x, batch_y) -> None:
    """Prediction's step: the forward pass only; its output is kept in `outputs`, detached and moved to
    `device` batch by batch (so predicting a large dataset does not fill the accelerator's memory)."""
    outputs.append(detached(call_model(ctx.model, batch_x), device))


def padding_forward(ctx: Context, batch_x) -> None:
    """The forward of a `PaddingBatch` (FSDP evaluation): the model's all-gathers happen, its output is
    dropped."""
    call_model(ctx.model, batch_x)


def compute_loss(ctx: Context, model_out, batch_y) -> torch.Tensor:
    """The loss function's value (or the model's own loss with loss=None), checked to be a scalar."""
    loss_fn = ctx.loss_fn
    if loss_fn is None:
        value = model_out.get("loss") if isinstance(model_out, dict) else model_out
        if not isinstance(value, torch.Tensor):
            hint = ""
            if isinstance(model_out, (tuple, list)):
                at = [i for i, v in enumerate(model_out) if isinstance(v, torch.Tensor) and v.numel() == 1]
                hint = (f"; for a model returning its loss in a {type(model_out).__name__}, such as (logits, loss),"
                        f" pass loss=ModelLoss({at[-1] if at else 1}) (from deepepochs import ModelLoss)")
            raise ConfigError("with loss=None the model must return a scalar loss tensor or a dict with"
                              f" 'loss' (got {type(model_out).__name__}){hint}")
    else:
        try:  # free when nothing raises (Python >= 3.11)
            value = loss_fn(model_out, batch_y)
        except Exception as e:
            if batch_y is not None or isinstance(e, ConfigError):  # ModelLoss says what it got itself
                raise
            raise ConfigError(
                f"the loss function got batch_y=None and raised {type(e).__name__}: {e}. Dict batches carry no"
                " label by default (every field goes to the model); name the label field with"
                " Trainer(targets='<key>'), or pass loss=None and let the model compute its loss"
            ) from e
    if not (isinstance(value, torch.Tensor) and value.numel() == 1):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ConfigError(f"the loss must be a scalar tensor (got {shape}); reduce it, e.g. with .mean()")
    return value


def loss(ctx: Context, model_out, batch_y, loss_adjust: float, do_optimize: bool) -> torch.Tensor:
    """`Trainer.loss`: compute the loss; in training backpropagate its share of the window and maybe update.

    The batch's reported loss never holds the graph (a float, or a detached tensor); the sub-batch losses
    of a hand-split batch, weighted by `loss_adjust`, add up to the batch mean.
    """
    value = loss_value(ctx, model_out, batch_y, loss_adjust)
    if ctx.loop.stage != "train":
        return value
    ctx.hop(BACKWARD)
    backpropagate(ctx, value, loss_adjust)
    if do_optimize:
        optimize(ctx, None)
    return value


def loss_value(ctx: Context, model_out, batch_y, loss_adjust: float) -> torch.Tensor:
    """The loss (`compute_loss`); its value, weighted by `loss_adjust`, is added to the batch's reported
    loss `ctx.step_loss`."""
    value = compute_loss(ctx, model_out, batch_y)
    report_loss(ctx, value, loss_adjust)
    return value


def report_loss(ctx: Context, value: torch.Tensor, loss_adjust: float) -> None:
    """Add `value`, weighted by `loss_adjust`, to the batch's reported loss `ctx.step_loss`."""
    # On the CPU read as a float now (no device to wait for; the finite check and the meters need no
    # further tensor op); on an accelerator kept as a detached tensor, so no host sync is forced.
    reported = value.item() if finite.reads_on_host(value) else value.detach()
    if loss_adjust != 1.0:
        reported = reported * loss_adjust
    ctx.step_loss = reported if ctx.step_loss is None else ctx.step_loss + reported


def backpropagate(ctx: Context, value: torch.Tensor, loss_adjust: float) -> None:
    """Backpropagate the micro-batch's share of its window's loss, between the backward hooks (the
    `backward` edge was taken just before)."""
    loop, hooks = ctx.loop, ctx.parts.hooks.by_event
    if hooks[BEFORE_BACKWARD]:
        emit(ctx, BEFORE_BACKWARD, value)
    # This micro-batch's share of the window: n_i / (k * n_first); 1/k for a window of k equal batches.
    # The update (unscale_gradients) multiplies by k * n_first / N once, so a short tail window or a ragged
    # batch weighs each sample as a full window does. Dividing here, not at the update, keeps fp16
    # gradients in range while they add up.
    share = loss_adjust
    if loop.window_size > 1:
        share *= ctx.batch_n / (loop.window_size * loop.window_first_size)
    precision = ctx.parts.precision
    if precision.scaler is None:
        backward(ctx, value, share)
    else:
        # Every loss of one iteration is scaled with the same scale (see deepepochs.training.precision). Backward
        # leaves the step's autocast region: PyTorch advises against running backward under autocast.
        with precision.no_autocast():
            scaled = precision.scale(value if share == 1.0 else value * share, actions.batch_token(ctx))
            backward(ctx, scaled, 1.0)
    if hooks[AFTER_BACKWARD]:
        emit(ctx, AFTER_BACKWARD, value)


def user_backward(ctx: Context, value) -> None:
    """`Trainer.backward`: a custom step's own loss backpropagated as `self.loss` does it (the `backward`
    trigger, the backward hooks, the micro-batch's share of its window, the GradScaler's scale), without
    computing or reporting a loss."""
    if ctx.loop.stage != "train":
        raise ConfigError("self.backward(loss) backpropagates in a training step only (the stage is"
                          f" {ctx.loop.stage!r})")
    if not (isinstance(value, torch.Tensor) and value.numel() == 1 and value.requires_grad):
        what = (f"a tensor of shape {tuple(value.shape)} requires_grad={value.requires_grad}"
                if isinstance(value, torch.Tensor) else type(value).__name__)
        raise ConfigError(f"self.backward(loss) takes a scalar loss tensor that requires grad (got {what})")
    ctx.hop(BACKWARD)
    if ctx.backward_loss is None or ctx.backward_loss[0] != ctx.loop.batch_idx:
        ctx.backward_loss = (ctx.loop.batch_idx, value.detach())  # the batch's first: what a rollback counts
    backpropagate(ctx, value, 1.0)


def user_loss(ctx: Context, model_out, batch_y, loss_adjust: float, do_optimize: bool,
              do_metric: bool | None = None):
    """`Trainer.loss` as a custom step calls it: `loss` with what 0.6 did around it.

    - In validation and test with `do_loss=False` (`fit(do_val_loss=False)`, `test(do_loss=False)`) the
      loss is neither computed nor reported, and None is returned.
    - The call makes the trainer's metric patches from `(model_out, batch_y)` and runs the stage's
      `on_*_metrics` hooks, so a step that only calls `self.loss(out, y)` keeps the trainer's metrics. In
      training the patches are made before the update, which commits them (as in `default_step`). As in
      0.6.18 every call makes them unless `do_metric=False` (0.6.18's hand-written accumulation passes it
      per sub-batch, then calls `do_metric` on the whole batch); `do_metric=None` is that default, except
      for older 0.6's `grad_accumulate=True` spelling (`LossCall`), which makes none.
    """
    task, loop = ctx.task, ctx.loop
    if task is None:  # called outside fit/test: just the loss
        return loss(ctx, model_out, batch_y, loss_adjust, do_optimize)
    stage = loop.stage
    training = stage == "train"
    value = loss(ctx, model_out, batch_y, loss_adjust, False) if training or task.do_loss else None
    if do_metric is None or do_metric:
        step_metrics(ctx, value, model_out, batch_y)
    if training and do_optimize:
        optimize(ctx, None)
    return value


def step_metrics(ctx: Context, value, model_out, batch_y) -> None:
    """A custom step's metrics for `(model_out, batch_y)`: the stage's `on_*_metrics` hooks, and the
    trainer's metric patches, added to those the step made already (returned with its result by
    `custom_step`). `value` is the loss the hooks receive."""
    task = ctx.task
    if task is None:
        raise RuntimeError("metrics can only be made inside a step of fit() or test()")
    emit(ctx, STEP_HOOKS[ctx.loop.stage][2], value, model_out, batch_y, task)
    if task.all_metrics:
        made, have = batch_patches(ctx, model_out, batch_y), ctx.step_patches
        if have:  # several calls in one step: their patches add up
            made = {name: have[name].add(patch) if name in have else patch for name, patch in made.items()}
            made = {**have, **made}
        ctx.step_patches = made


def name_by_key(result: dict) -> None:
    """A step's patch without a name of its own is named by its key, which then prefixes the keys of a dict
    result, as in deepepochs 0.6: `{'m_': TensorPatch(fn, ...)}` with fn returning `{'acc': ...}` shows
    `m_acc`. A patch given a name (`name='C.'`, or `name=''` to show the keys as they are) keeps it."""
    for key, patch in result.items():
        if isinstance(key, str) and getattr(patch, "name", None) is None:
            try:
                patch.name = key
            except AttributeError:  # a patch class with slots and no name: it shows its keys as they are
                pass


def custom_step(ctx: Context, step_fn):
    """A user's step method, returning the metric patches its `self.loss` calls made (`user_loss`) together
    with what it returns itself (its own entries win). The default step does not go through this."""

    def run(batch_x, batch_y, **step_args):
        ctx.step_patches = None
        result = step_fn(batch_x, batch_y, **step_args)
        if isinstance(result, dict):
            name_by_key(result)
        made = ctx.step_patches
        if made:
            if result is None:
                return dict(made)
            if isinstance(result, dict):
                return {**made, **result}
        return result

    return run


def backward(ctx: Context, root: torch.Tensor, share: float) -> None:
    """`(root * share).backward()`, bit for bit: the backward starts from a gradient `share` shaped as
    `root` (the multiply's backward would hand exactly that on), made once per share and kept in
    `ctx.seeds`, instead of a multiply, its backward node and an implicit `ones_like` per micro-batch."""
    seeds = ctx.seeds
    key = (share, root.dtype, root.dim())  # a loss has one element: its shape is its number of dimensions
    seed = seeds.get(key)
    if seed is None:
        if len(seeds) >= 16:  # batch sizes that vary without bound (bucketing) must not grow the cache
            seeds.clear()
        seed = seeds[key] = torch.full_like(root, share)
    if type(root) is torch.Tensor:
        torch_private.backward_seeded(root, seed)  # the seed matches root: torch's checks of the pair skipped
    else:  # a tensor subclass keeps its own backward
        root.backward(seed)


def select_update(ctx: Context, optimize_index) -> None:
    """Name the optimizers the coming update steps (`loop.update_indices`): all of them for None."""
    opts = ctx.parts.opts
    ctx.loop.update_indices = opts.all_indices if optimize_index is None else opts.indices(optimize_index)


def optimize(ctx: Context, optimize_index, closure=None):
    """`Trainer.optimize`: on the window's last micro-batch run the machine's optimize layer (unscale,
    clip, step or skip per optimizer, scaler update and zero_grad); earlier calls let gradients add up.

    With a `closure` (LBFGS and other optimizers whose `step` takes one) each optimizer steps as
    `opt.step(closure)`; what the step returns (the closure's first loss) is returned and added to the
    batch's reported loss. A step that ran its own `loss.backward()` fires `optimize` without a `backward`
    trigger; the spec's guards on that edge (`grads_present`, `closure_given`) decide what it does."""
    loop = ctx.loop
    if loop.stage != "train":
        return None
    if closure is None:
        _update(ctx, optimize_index)
        return None
    if not callable(closure):
        raise ConfigError(f"self.optimize(closure=...) takes a callable that re-evaluates the model and returns"
                          f" its loss, as opt.step(closure) does (got {type(closure).__name__})")
    loop.closure, loop.closure_loss = closure, None
    try:
        _update(ctx, optimize_index)
        value = loop.closure_loss
    finally:
        loop.closure = loop.closure_loss = None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        report_loss(ctx, value, 1.0)
    return value


def close_cut_window(ctx: Context) -> bool:
    """The data ended inside an open window, which nothing said would be its last (data without a length,
    or shorter than its length said: `batches.train_batches` fetched each micro-batch just before its
    forward): the window updates all optimizers now with its micro-batches' gradients, as a window closed by
    its last micro-batch does (`optimize` from `window_open`, the update's edges, `end_batch`). True when it
    committed an update (False: it backpropagated nothing and closed without one)."""
    if not _update(ctx, None):
        return False
    ctx.hop(END_BATCH)
    return True


def _update(ctx: Context, optimize_index) -> bool:
    """The `optimize` hop and, when it opens the update, the update's hops between the optimize hooks.
    True when the update ran."""
    loop, hop = ctx.loop, ctx.hop
    select_update(ctx, optimize_index)
    if hop(OPTIMIZE) != OPTIMIZE_UNSCALED:
        return False  # an inner micro-batch: gradients keep accumulating
    hooks = ctx.parts.hooks.by_event
    if hooks[BEFORE_OPTIMIZE]:
        emit(ctx, BEFORE_OPTIMIZE, optimize_index)
    hop(CLIP)
    for i in loop.update_indices:
        loop.opt_index = i
        hop(APPLY_UPDATE)  # grads_finite picks the step or the skip edge for optimizer i
    hop(FINISH_UPDATE)
    if hooks[AFTER_OPTIMIZE]:
        emit(ctx, AFTER_OPTIMIZE, optimize_index)
    return True


@contextlib.contextmanager
def no_sync(ctx: Context):
    """`Trainer.no_sync`: backward inside does not all-reduce gradients (a no-op in one process). On exit
    the setting the machine chose for this micro-batch comes back (sync only on a window's last)."""
    dist = ctx.parts.dist
    dist.set_grad_sync(False)
    try:
        yield
    finally:
        loop = ctx.loop
        dist.set_grad_sync(loop.window_boundary if loop.stage == "train" else True)


def batch_patches(ctx: Context, model_out, batch_y, metrics=None) -> dict:
    """`{name: Patch}` for `metrics` (default: the current task's) under the trainer's metric_patch."""
    metrics = ctx.task.all_metrics if metrics is None else metrics
    if not metrics:
        return {}
    if batch_y is None and not getattr(ctx.task, "targets_checked", True):
        check_metrics_without_targets(ctx, model_out, metrics)
    return make_patches(ctx.parts.config.metric_patch, metrics, model_out, batch_y)


def check_metrics_without_targets(ctx: Context, preds, metrics) -> None:
    """At a task's first batch without targets (dict batches, loss=None models), try each metric on it:
    one that needs targets fails now, with how to provide them, instead of after a whole epoch (a
    TensorPatch computes its metric only at the task's end)."""
    ctx.task.targets_checked = True
    why = ("with loss=None every item of a batch is a model input" if ctx.loss_fn is None
           else f"with loss={ctx.loss_fn!r} every item of a batch is a model input" if not label_split(ctx.loss_fn)
           else "dict batches pass every field to the model")
    for metric in metrics:
        if not callable(metric) or is_metric_object(metric):  # an object's update would change its state
            continue
        try:
            metric(preds, None)
        except Exception as e:
            raise ConfigError(
                f"metric {metric_name(metric)!r} needs targets, but the batches carry none ({why}), so it got"
                f" targets=None and raised {type(e).__name__}: {e}. Tell the trainer where the targets are:"
                " Trainer(targets='<key>') for the label field of dict batches, or Trainer(targets=fn) with"
                " fn(batch_x, model_out) -> (preds, targets), e.g. for a model that returns them"
            ) from e


def check_step_result(result, n: int):
    """A step's return value as `{name: Patch}` (tensors and numbers become `ValuePatch`es), or None."""
    if result is None:
        return None
    if not isinstance(result, dict):
        raise ConfigError(f"a step method must return None or a dict {{name: Patch}} (got {type(result).__name__})")
    for name, value in result.items():
        if not isinstance(value, PatchBase):
            if isinstance(value, (torch.Tensor, int, float)):
                result[name] = ValuePatch(value.detach() if isinstance(value, torch.Tensor) else value, n)
            else:
                raise ConfigError(f"step result {name!r} must be a Patch, a tensor or a number"
                                  f" (got {type(value).__name__})")
    return result
