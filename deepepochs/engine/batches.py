"""The batch loops: one for training micro-batches, one for evaluation batches.

A training micro-batch moves the machine through the spec's hot edges: `begin_window` (the window's
first), `begin_batch`, then the step's `backward` and `optimize` (and on the window's last micro-batch
`clip`, `apply_update` per optimizer, `finish_update`), then `end_batch`. Either way it calls the
registry's guards and actions (`deepepochs.engine.actions`) and the step's pieces (`deepepochs.engine.steps`):

- compiled (`fuses`): the micro-batch runs the code generated from the spec's fused edges for this
  configuration (`deepepochs.engine.compiled`), which records the fused edge it took;
- every edge (`fuse_steps=False`, a custom step, several optimizers, or a callback hook that runs inside
  a micro-batch): each hop is fired (`LoopMachine.fire`), recorded in the flight record and probed.
"""

from __future__ import annotations

import functools
import itertools

from deepepochs.data.batch_rules import batch_splitter, lookahead
from deepepochs.data.outputs import label_split
from deepepochs.data.sampling import PaddingBatch
from deepepochs.engine import compiled, loader_starts, snapshot_trigger, steps
from deepepochs.engine.context import Context
from deepepochs.engine.emit import emit
from deepepochs.fsm.events import Event, TriggerName
from deepepochs.fsm.machine import load_spec
from deepepochs.tasks import BatchMetrics, step_kwargs

__all__ = ["BATCH_HOOKS", "FUSED_OBSERVERS", "eval_batches", "fuses", "train_batches"]

# The hot triggers of the batch loops, as plain strings (an Enum member costs ~0.5 us per lookup).
BEGIN_WINDOW, BEGIN_BATCH = TriggerName.BEGIN_WINDOW.value, TriggerName.BEGIN_BATCH.value
END_BATCH = TriggerName.END_BATCH.value

#: Per stage, the hooks fired around a batch (before its step, after it), as the spec names them.
BATCH_HOOKS = {
    "train": (Event.BEFORE_TRAIN_BATCH.value, Event.AFTER_TRAIN_BATCH.value),
    "val": (Event.BEFORE_VAL_BATCH.value, Event.AFTER_VAL_BATCH.value),
    "test": (Event.BEFORE_TEST_BATCH.value, Event.AFTER_TEST_BATCH.value),
}


def _fused_edge_observers() -> tuple[str, ...]:
    """Hooks that run in a window/step/optimize state on a fused edge's path: any of them rules fusing out
    (the hook could read the flight record, which a fused micro-batch records as one edge)."""
    spec = load_spec()
    states = {s for f in spec.transitions if f.fuses for t in spec.fused_path(f) for s in (t.source, t.dest)}
    per_batch = {s for s in states if spec.state(s).layer in ("window", "step", "optimize")}
    return tuple(h.name for h in spec.hooks if per_batch & set(h.states))


FUSED_OBSERVERS = _fused_edge_observers()


def fuses(ctx: Context) -> bool:
    """Whether training micro-batches run the compiled fused edges: asked for (`fuse_steps`), no hook
    observes their paths, and the step is the default one with one optimizer, whose micro-batches take
    exactly a fused edge's path (a custom step may take any path, e.g. update twice, and is fired edge by
    edge)."""
    hooks = ctx.parts.hooks.by_event
    return (ctx.parts.config.fuse_steps and ctx.task.step_fn is None and len(ctx.parts.opts) == 1
            and not any(hooks[name] for name in FUSED_OBSERVERS))


def train_batches(ctx: Context, data, meters, total: int | None = None) -> bool:
    """Run a training task's micro-batches from `data` (an iterable, iterated once here): the window and step
    layers of the machine. Each micro-batch is fetched just before its forward, as a plain loop fetches it.
    `total`: the task's batch count when it is exact (`batch_rules.exact_length`): the last batch is then
    known by counting. Else windows close by count, and one that the data's end cuts short updates once the
    data said it ended (`steps.close_cut_window`); except under DDP, where a window's last micro-batch must
    be known before its backward (it syncs gradients): there one batch is read ahead, except at a window's
    end (`batch_rules.lookahead`). With the update clock on (`Context.update_clock`), it is asked at the task's
    start and after each committed window; True when it stopped the task (`deepepochs.engine.update_clock`)."""
    parts, loop, machine = ctx.parts, ctx.loop, ctx.machine
    task = ctx.task
    before_batch, after_batch = BATCH_HOOKS["train"]
    before_hooks = parts.hooks.by_event[before_batch]  # no emit call for a hook nobody handles
    after_hooks = parts.hooks.by_event[after_batch]  # BatchMetrics is made only when a callback reads it
    k = parts.config.gradient_accumulation_steps
    loop.window_size = k
    ctx.hop = hop = machine.fire
    # The compiled micro-batch: from `task_train` a one-batch window (k=1) in one function; with k > 1 the
    # window opens on its own edge, then each micro-batch runs the function from `window_open`.
    micro_batch = None
    if fuses(ctx):
        micro_batch = compiled.bind(ctx)[compiled.ONE_BATCH_WINDOW if k == 1 else compiled.IN_WINDOW]
    split = batch_splitter(label_split(ctx.loss_fn), parts.device, parts.device.type == "cuda", task.batch_size,
                           parts.target_key, steps.dict_batch_counted(ctx))
    step_fn, step_args = task.step_fn, step_kwargs(task.step_fn, task.step_args)
    if step_fn is None:
        step_fn, step_args = functools.partial(steps.default_step, ctx), {"stage": "train"}
    else:
        step_fn = steps.custom_step(ctx, step_fn)
    autocast = parts.precision.autocast if parts.precision.dtype is not None else None
    console = parts.console
    log_batch = console.log_batch or console.log_tqdm
    snapshot_writer = ctx.snapshots
    clock = ctx.update_clock
    # The clock at the task's start: the budget was reached before this task, a stop was requested, or a
    # validation point is due. The point before the first update (`val_at_start`) runs before the data's
    # iterator is made (a DataLoader's draws its base seed from torch's generator), as a plain loop
    # evaluates before its `for batch in data`; later ones after it, where a resumed task's random streams
    # were put back (`continuation.TrainingBatches`).
    if clock is not None and loop.run.updates == 0 and clock():
        return True
    data = iter(data)
    if clock is not None and loop.run.updates and clock():
        return True
    data, guarded = snapshot_trigger.guard(ctx, data, "train")  # no batch is fetched once a signal arrived
    if ctx.profiler is not None:  # each fetch timed as the DataLoader's wait (`ProfileCallback`)
        data = ctx.profiler.fetching(data, "train", ctx.task.dataloader)
    # Each micro-batch is fetched just before its forward, as in `for batch in data: forward, backward;
    # every k: step`, so the data's random draws and the model's (dropout) interleave as in that loop.
    if k == 1:  # every batch closes its window
        batches = zip(data, itertools.repeat(True))
    elif total is not None:  # counted: a batch beyond `total` (a length that lied) still runs, closing its window
        batches = zip(data, itertools.chain(itertools.repeat(False, max(total - loop.batch_idx - 1, 0)),
                                            itertools.repeat(True)))
    elif parts.dist.world_size > 1:  # a window's last backward must sync gradients: known one batch ahead
        batches = lookahead(data, k)
    else:  # windows close by count; one the data's end cuts short updates after it (`close_cut_window`)
        batches = zip(data, itertools.repeat(False))
    try:
        for batch, is_last in batches:
            if micro_batch is not None:
                if k > 1 and loop.window_pos == 0:
                    hop(BEGIN_WINDOW)
                value, patches = micro_batch(ctx, meters, split, batch, is_last)
            else:
                if loop.window_pos == 0:
                    hop(BEGIN_WINDOW)
                batch_x, batch_y, n = steps.read_batch(ctx, split, batch, is_last)
                hop(BEGIN_BATCH)
                if before_hooks:  # hooks get 0-based indices, as in 0.6
                    emit(ctx, before_batch, batch_x, batch_y, loop.batch_idx - 1)
                if autocast is None:
                    result = step_fn(batch_x, batch_y, **step_args)
                else:
                    with autocast():  # forward and loss of default and custom steps alike
                        result = step_fn(batch_x, batch_y, **step_args)
                value, patches = steps.count_batch(ctx, meters, result, n)
                hop(END_BATCH)
            if after_hooks:
                emit(ctx, after_batch, BatchMetrics(value, patches), loop.batch_idx - 1)
            if log_batch:
                console.batch(loop.batch_idx, lambda value=value, patches=patches: BatchMetrics(value, patches),
                              meters.skipped, loop.run.updates)
            if snapshot_writer is not None and loop.window_pos == 0 and loop.window_committed:
                snapshot_trigger.commit_point(ctx, epoch_end=False)  # a window committed: a commit point
            if clock is not None and loop.window_pos == 0 and loop.window_committed and clock():
                if total is not None and loop.batch_idx >= total:
                    # The epoch's last batch: its iterator is asked once more, as a `for` loop asks it, so
                    # that a sampler's final draw (RandomSampler's) leaves its generator where that loop's is.
                    next(data, None)
                return True  # the update clock stopped the task: no further batch is read
        if loop.window_pos and steps.close_cut_window(ctx):  # the data ended inside a window: it updates
            if snapshot_writer is not None:
                snapshot_trigger.commit_point(ctx, epoch_end=False)
            if clock is not None and clock():
                return True
    except snapshot_trigger.FetchStopped as stop:  # a listed signal: stop before the next batch
        snapshot_trigger.stop_fetching(ctx, stop.signal)
    finally:
        if guarded is not None:
            guarded.close()
    return False


def eval_batches(ctx: Context, data, meters, stage: str, observed: bool = True, split=None) -> None:
    """Run a validation or test task's batches (no gradients; the caller holds `torch.no_grad`).

    `observed=False` (prediction) runs no batch hooks and prints no batch lines; `split` replaces the
    default batch splitting (`batch_rules.batch_splitter`). A `PaddingBatch` the policy adds (FSDP: every rank
    runs as many forwards as the others) runs the model's forward only: it is no batch of the task, so
    it fires no trigger, runs no step or hook and counts in no loss, metric or prediction."""
    parts, loop, task = ctx.parts, ctx.loop, ctx.task
    fire = ctx.machine.fire
    before_batch, after_batch = BATCH_HOOKS[stage]
    after_hooks = parts.hooks.by_event[after_batch] if observed else ()
    if split is None:
        split = batch_splitter(label_split(ctx.loss_fn), parts.device, parts.device.type == "cuda", task.batch_size,
                               parts.target_key, steps.dict_batch_counted(ctx))
    step_fn, step_args = task.step_fn, step_kwargs(task.step_fn, task.step_args)
    if step_fn is None:
        step_fn, step_args = functools.partial(steps.default_step, ctx), {"stage": stage}
    else:
        step_fn = steps.custom_step(ctx, step_fn)
    console, autocast = parts.console, parts.precision.autocast
    parts.dist.sync_eval_buffers(parts.raw_model)  # DDP: every rank evaluates rank 0's (the saved) buffers
    data, guarded = snapshot_trigger.guard(ctx, data, stage)  # a fetch a listed signal made fail stops the fit
    batches = loader_starts.start(ctx, parts.dist.pad_eval(data))
    if ctx.profiler is not None:  # each fetch timed as the DataLoader's wait (`ProfileCallback`)
        batches = ctx.profiler.fetching(batches, stage, task.dataloader)
    try:
        for batch in batches:
            if type(batch) is PaddingBatch:  # FSDP: this rank's shard has ended; its forward meets the others'
                with autocast():
                    steps.padding_forward(ctx, split(batch.batch)[0])
                continue
            loop.batch_idx += 1
            batch_x, batch_y, n = split(batch)
            ctx.batch_n, ctx.step_loss = n, None
            fire(BEGIN_BATCH)
            if observed:
                emit(ctx, before_batch, batch_x, batch_y, loop.batch_idx - 1)  # 0-based, as in training
            with autocast():
                result = step_fn(batch_x, batch_y, **step_args)
            patches = None if result is None else steps.check_step_result(result, n)
            value = None if (patches and "loss" in patches) else ctx.step_loss
            meters.add_batch(value, n, patches)
            meters.close_window()
            fire(END_BATCH)
            if after_hooks:
                emit(ctx, after_batch, BatchMetrics(value, patches), loop.batch_idx - 1)
            if observed:
                console.batch(loop.batch_idx, lambda value=value, patches=patches: BatchMetrics(value, patches))
    except snapshot_trigger.FetchStopped as stop:  # the signal killed the workers: stop at the last commit point
        snapshot_trigger.stop_fetching(ctx, stop.signal)
    finally:
        if guarded is not None:
            guarded.close()
