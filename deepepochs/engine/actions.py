"""The spec's guards and actions, each implemented once, in a registry keyed by the spec's names.

Every guard and action is a function of the run-time `Context`. `bind(ctx)` hands them to the machine,
which calls them for an edge fired on its own; a compiled micro-batch (`deepepochs.engine.compiled`)
calls the same functions directly, looked up here when a trainer's task starts. `check_registry(spec)`
fails when a spec name has no implementation or the registry has one the spec does not name;
registering a name twice fails at import.

Commit points (spec actions marked `commit=True`, last on their edge but for after-commit actions):
`commit_update` after an update was applied with its step-wise scheduler (or skipped and the scale
updated), then `release_interrupts` raises a Ctrl-C held during the update; `commit_epoch` after an
epoch's end. Rollback (`discard_window`) returns the trainer to the last of them. No action reads the
machine's state: what differs between edges is which actions the spec puts on them.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable

import torch

from deepepochs.engine import buffers, callback_states, carried, kept_grads, position
from deepepochs.engine.context import Context
from deepepochs.engine.emit import emit
from deepepochs.engine.finite import window_finite
from deepepochs.engine.generators import put_back_host_state, remember_random_state
from deepepochs.engine.registry import ACTIONS, GUARDS, action, guard
from deepepochs.engine.runstate import record_row
from deepepochs.errors import DeepEpochsWarning, Preempted
from deepepochs.fsm.events import ActionName, Event
from deepepochs.fsm.machine import load_spec
from deepepochs.patches import ValuePatch

__all__ = ["ACTIONS", "FOLDS", "GUARDS", "action", "batch_token", "bind", "check_registry", "check_registry_once",
           "folded", "guard", "record_row"]



def check_registry(spec) -> None:
    """Raise `RuntimeError` unless the registry implements exactly the spec's guards and actions."""
    for kind, table, names in (("guard", GUARDS, {g.name for g in spec.guards}),
                               ("action", ACTIONS, {a.name for a in spec.actions})):
        missing, extra = sorted(names - set(table)), sorted(set(table) - names)
        if missing or extra:
            raise RuntimeError(f"{kind}s without an implementation: {missing}; implemented but not in the"
                               f" spec: {extra}")


@functools.cache
def check_registry_once() -> None:
    """`check_registry` against the package's spec, once per process."""
    check_registry(load_spec())


def bind(ctx: Context) -> tuple[dict, dict]:
    """`(guards, actions)`: name -> zero-argument callable bound to `ctx`, looked up in the registry now
    (so a test may wrap registry entries before a trainer is built)."""
    return ({name: functools.partial(fn, ctx) for name, fn in GUARDS.items()},
            {name: functools.partial(fn, ctx) for name, fn in ACTIONS.items()})


#: Actions that a trainer's configuration makes do nothing, each with the test on `Parts` that says so and
#: why. A compiled micro-batch (`deepepochs.engine.compiled`) leaves them out, with the reason as a
#: comment; every other path calls them (each also returns early on its own when it has nothing to do).
FOLDS: dict[str, tuple[Callable[[object], bool], str]] = {
    ActionName.SYNC_GRADIENTS.value: (lambda parts: parts.dist.world_size == 1,
                                      "one process: no gradient sync to switch"),
    ActionName.SKIP_GRADIENT_SYNC.value: (lambda parts: parts.dist.world_size == 1,
                                          "one process: no gradient sync to switch"),
    ActionName.CLIP_GRADIENTS.value: (lambda parts: not parts.clippers, "no gradient clipper is attached"),
    ActionName.UPDATE_SCALER.value: (lambda parts: parts.precision.scaler is None, "no GradScaler (fp32/bf16)"),
    ActionName.AVERAGE_UPDATE.value: (lambda parts: not parts.averagers, "no weight average is attached"),
}


def folded(parts) -> dict[str, str]:
    """`{action: why}` for the actions `FOLDS` says this configuration makes do nothing."""
    return {name: why for name, (test, why) in FOLDS.items() if test(parts)}


# ---- guards: side-effect free, real bools ------------------------------------------------------------
@guard
def epochs_remaining(ctx: Context) -> bool:
    return ctx.loop.completed_epochs < ctx.loop.target_epochs


@guard
def stop_requested(ctx: Context) -> bool:
    return ctx.loop.stop is not None


@guard
def val_due(ctx: Context) -> bool:
    return ctx.loop.val_due


@guard
def window_boundary(ctx: Context) -> bool:
    return ctx.loop.window_boundary


@guard
def grads_finite(ctx: Context) -> bool:
    return ctx.loop.finite.get(ctx.loop.opt_index, True)


@guard
def has_save_requests(ctx: Context) -> bool:
    return bool(ctx.loop.save_requests)


@guard
def resume_pending(ctx: Context) -> bool:
    return ctx.loop.resume_pending


@guard
def snapshot_due(ctx: Context) -> bool:
    return ctx.loop.snapshot_due


@guard
def stop_signalled(ctx: Context) -> bool:
    return ctx.loop.stop_signal is not None


@guard
def closure_given(ctx: Context) -> bool:
    return ctx.loop.closure is not None


@guard
def grads_present(ctx: Context) -> bool:  # asked only for an optimize without a backward trigger: a short scan
    opts = ctx.parts.opts
    return any(p.grad is not None for i in ctx.loop.update_indices for group in opts[i].opt.param_groups
               for p in group["params"])


@guard
def scales_losses(ctx: Context) -> bool:
    return ctx.parts.precision.scaler is not None


# ---- fit and epoch -----------------------------------------------------------------------------------
@action
def resume_checkpoint(ctx: Context) -> None:
    """Load what `resume=` asks for; the file (or a finished run's record) brings the run's history, which
    is what `fit()` returns, so a finished run's fit trains nothing and returns its records.

    The engine's resume step: the checkpoint layer's policy (`Parts.resumer`, given the facade: checkpoints
    load into a trainer) writes the run state and clears `loop.resume_pending`; a fit's training tasks
    (`loop.resume_tasks`) are what a snapshot's position is checked against."""
    resumer = ctx.parts.resumer
    if resumer is None:  # nothing can load checkpoints here: nothing to honour
        ctx.loop.resume_pending = False
        return
    resumer(ctx.parts.facade)


@action
def start_epoch(ctx: Context) -> None:
    loop = ctx.loop
    loop.epoch = loop.completed_epochs + 1
    loop.stop = None
    ctx.last_metrics = {}
    ctx.parts.dist.set_epoch(loop.epoch)


@action
def report_early_stop(ctx: Context) -> None:
    loop = ctx.loop
    ctx.parts.console.info(f"Stopped early after epoch {loop.completed_epochs}: {loop.stop.reason}")


@action
def step_epoch_schedulers(ctx: Context) -> None:
    """Step epoch-wise schedulers with this epoch's loss; their states before are kept until the epoch
    commits, so a rollback before `commit_epoch` undoes this step instead of losing or repeating it. With
    validation points (`val_every_n_updates`) the schedulers step at each point instead, with its validation
    loss (ReduceLROnPlateau follows the points), kept until `commit_val_point`; the point before the first
    update (`val_at_start`) steps none: nothing was trained yet."""
    loop = ctx.loop
    if loop.val_every is not None and (not loop.val_point_open or loop.run.updates == 0):
        return  # an epoch's end on the update clock (they stepped at its points), or the point at update 0
    opts = ctx.parts.opts
    before = opts.epoch_scheduler_state()
    ctx.epoch_undo.append(lambda: opts.load_epoch_scheduler_state(before))
    train, val = ctx.last_metrics.get("train", {}), ctx.last_metrics.get("val", {})
    opts.step_epoch(train.get("loss"), val.get("loss"))


@action
def save_checkpoints(ctx: Context) -> None:
    """Run the saves callbacks requested here. At a validation point inside an epoch the files record that
    point's position, as a mid-epoch snapshot does (`LoopState.save_position`: `position.capture` once, at
    the first save that asks, so a request that saves nothing starts no collective under DDP)."""
    loop = ctx.loop
    requests = list(loop.save_requests)
    loop.save_requests.clear()
    loop.save_position = functools.cache(functools.partial(position.capture, ctx)) if loop.val_point_open else None
    try:
        for save in requests:
            save()
    finally:
        loop.save_position = None


@action
def commit_epoch(ctx: Context) -> None:
    """The epoch is done for good: its count, its records, its epoch-wise scheduler steps, the model's
    buffers, the carried state, the callbacks' states and torch's generators as of now."""
    remember_random_state(ctx)
    buffers.keep(ctx)
    carried.keep(ctx)
    callback_states.keep(ctx)
    loop = ctx.loop
    loop.completed_epochs = loop.epoch
    loop.resume = None
    ctx.train_meters = None
    ctx.epoch_undo.clear()
    for stage, metrics in ctx.last_metrics.items():
        if stage in ctx.history:
            record_row(ctx.history[stage], metrics, aligned=stage == "train")


@action
def average_epoch(ctx: Context) -> None:
    """The epoch-wise weight averages (`SWACallback`) take the epoch's weights and step their learning-rate
    schedule. The averages live in the run state, which an epoch's end that does not commit puts back
    (`Driver._count_epoch`); the rates the schedule set are undone here, like an epoch-wise scheduler's."""
    averagers = ctx.parts.averagers
    if not averagers:
        return
    opts = ctx.parts.opts
    rates = [[group["lr"] for group in item.opt.param_groups] for item in opts.items]

    def undo():
        for item, lrs in zip(opts.items, rates):
            for group, lr in zip(item.opt.param_groups, lrs):
                group["lr"] = lr

    ctx.epoch_undo.append(undo)
    for average in averagers:
        average(ctx.parts.facade, "epoch")


# ---- the accumulation window -------------------------------------------------------------------------
@action
def open_window(ctx: Context) -> None:
    """A new window: no micro-batch, sample or update in it yet. The one function that empties a window's
    counters and flags: the rollback's `reset_loop` calls it too. The callbacks' states are kept here, as
    the hooks after the last update (`on_after_optimize`, `on_after_train_batch`) left them."""
    loop = ctx.loop
    loop.window_pos = 0
    loop.window_samples = 0
    loop.window_first_size = 0
    loop.window_updated = False
    loop.window_committed = False
    loop.update_open = False
    loop.own_gradients = False
    loop.finite.clear()
    callback_states.keep(ctx)  # what the hooks after the last update's commit left is that commit point's


@action
def count_micro_batch(ctx: Context) -> None:
    """Count the micro-batch `steps.read_batch` read (`ctx.batch_n` samples) in its window: its 1-based
    position, the window's sample count (the update's normaliser) and, for the first, the size the loss
    shares are based on (`steps.backpropagate`)."""
    loop, n = ctx.loop, ctx.batch_n
    loop.window_pos += 1
    if loop.window_pos == 1:
        loop.window_first_size = n
    loop.window_samples += n


@action
def sync_gradients(ctx: Context) -> None:
    ctx.parts.dist.set_grad_sync(True)


@action
def skip_gradient_sync(ctx: Context) -> None:
    ctx.parts.dist.set_grad_sync(False)


@action
def close_window(ctx: Context) -> None:
    loop = ctx.loop
    _fold_window(loop)
    loop.window_pos = 0


# ---- the update ----------------------------------------------------------------------------------------
@action
def keep_own_gradients(ctx: Context) -> None:
    """The step ran its own `loss.backward()`: no micro-batch share was applied (`steps.backpropagate`), so
    the update leaves the window's gradients as the step made them (`unscale_gradients`)."""
    ctx.loop.own_gradients = True


@action
def unscale_gradients(ctx: Context) -> None:
    """Unscale (fp16), decide finiteness per optimizer, and normalise by the window's real sample count.

    This begins the update, a critical section for SIGINT (held until `release_interrupts`).
    Each micro-batch backpropagated `loss * n_i / (k * n_first)` (`steps.loss`); the window's gradient is
    `sum(n_i * loss_i) / N` with N the window's samples over all ranks, so the factor here is
    `w * k * n_first / N` (DDP already averaged over the w ranks): exactly 1 for full windows of equal
    batches, which then cost no pass over the gradients. Non-finite gradients are left alone: their
    optimizer skips. Host syncs: fp16 reads all optimizers' inf flags at once (the read `GradScaler.step`
    would make); fp32/bf16 read one flag for the window's losses and gradients (`window_finite`).
    """
    ctx.signals.hold()
    parts, loop = ctx.parts, ctx.loop
    loop.update_open = True
    opts, indices, finite = parts.opts, loop.update_indices, loop.finite
    finite.clear()
    if parts.precision.scaler is None:
        grads = opts.grads(indices[0]) if len(indices) == 1 else [g for i in indices for g in opts.grads(i)]
        ok = window_finite(ctx, grads)
        for i in indices:
            finite[i] = ok
    else:
        finite.update(zip(indices, parts.precision.unscale([opts[i].opt for i in indices])))
    if loop.window_size > 1 and not loop.own_gradients:
        window_total = parts.dist.global_sum(loop.window_samples)  # a collective under DDP: every rank
        factor = parts.dist.world_size * loop.window_size * loop.window_first_size / window_total
        if factor != 1.0:
            seen = set()
            with torch.no_grad():
                for i in indices:
                    if finite[i]:
                        for g in opts.grads(i):
                            if id(g) not in seen:  # a parameter shared by two optimizers: scale it once
                                seen.add(id(g))
                                g.mul_(factor)


@action
def clip_gradients(ctx: Context) -> None:
    """Run each registered clipper as `clip(trainer, indices, finite)` on the unscaled gradients."""
    loop = ctx.loop
    for clip in ctx.parts.clippers:
        clip(ctx.parts.facade, loop.update_indices, loop.finite)


@action
def step_optimizer(ctx: Context) -> None:
    """Step optimizer `opt_index`, then its step-wise scheduler (sched_on='step'), as one unit.

    The scheduler follows exactly the applied updates. When `opt.step()` raises, the optimizer's post-hook
    (`Optimizers.bind_updates`, which marks `window_updated` the moment the update is applied) tells whether
    the update happened: after it (a later post-hook raised) the scheduler is stepped all the same and the
    error goes on to the rollback, which keeps the update; before it (a pre-hook), not at all."""
    loop = ctx.loop
    opts = ctx.parts.opts
    item = opts.items[loop.opt_index]
    if item.scheduler is None and loop.closure is None:  # the common case: no scheduler to ask about
        item.opt.step()
        return
    scheduler, opt = opts.step_scheduler(loop.opt_index), item.opt
    if scheduler is None:  # none, or an epoch-wise one
        _step(loop, opt)
        return
    updated, loop.window_updated = loop.window_updated, False
    try:
        _step(loop, opt)
    except BaseException:
        applied = loop.window_updated
        loop.window_updated = updated or applied
        if applied:
            scheduler.step()
        raise
    loop.window_updated = True
    scheduler.step()


def _step(loop, opt) -> None:
    """`opt.step()`, or `opt.step(closure)` for the step's closure (`steps.optimize`), whose first loss is
    kept in `loop.closure_loss`."""
    if loop.closure is None:
        opt.step()
    else:
        loop.closure_loss = opt.step(loop.closure)


@action
def skip_optimizer(ctx: Context) -> None:
    """Leave optimizer `opt_index` and its scheduler untouched; tell the callbacks."""
    emit(ctx, Event.SKIP_OPTIMIZE.value, ctx.loop.opt_index)


@action
def update_scaler(ctx: Context) -> None:
    """Hand this update's inf records to the scaler, which adjusts its scale once per iteration."""
    precision, loop = ctx.parts.precision, ctx.loop
    if precision.scaler is None:  # fp32/bf16
        return
    opts = ctx.parts.opts
    precision.finish([opts[i].opt for i in loop.update_indices], len(opts), batch_token(ctx))


@action
def zero_grad(ctx: Context) -> None:
    """Drop the updated optimizers' gradients (set to None: the next backward writes, not adds). The other
    optimizers' gradients stay, as after a plain loop's `opt.step(); opt.zero_grad()`, and add up until
    their optimizer's turn; what they hold now is this commit point's (`kept_grads.keep`)."""
    loop, opts = ctx.loop, ctx.parts.opts
    indices = loop.update_indices
    opts.zero_grad(indices)
    loop.update_open = False
    if len(indices) < len(opts.items) or loop.run.grads is not None:  # else nothing is left to keep
        kept_grads.keep(ctx)


@action
def remember_position(ctx: Context) -> None:
    """What a refit continues from besides the batch count: torch's generators, the model's buffers (what
    the window's forwards changed), the state the steps carry (`trainer.carried`) and a stateful loader's
    position and generators, all as they are right after the window's update (no batch is read ahead of a
    window's end)."""
    remember_random_state(ctx)
    buffers.keep(ctx)
    carried.keep(ctx)
    if ctx.data_source is not None:
        point, source = ctx.loop.resume, ctx.data_source
        ctx.data_state = (point.epoch, point.task_index, ctx.loop.batch_idx, source.holder.state_dict())
        ctx.run.data_generators = (point.epoch, point.task_index, [g.get_state() for g in source.generators])
        ctx.run.data_ended = (point.epoch, point.task_index, ctx.loop.batch_idx) if source.ended else None


@action
def average_update(ctx: Context) -> None:
    """The weight averages (`EMACallback`, `SWACallback` from `start_update`) take the update just applied, as
    part of its commit point: once per update in which an optimizer stepped (counted in `run.updates`
    already: `apply_update` commits it), never for one every optimizer skipped (inf/NaN), never for a
    window a rollback discards (its update never reaches this). A rollback completing an applied update
    whose end did not run calls it too (`discard_window`)."""
    averagers = ctx.parts.averagers
    if not averagers:
        return
    loop = ctx.loop
    if not any(loop.finite.get(i, True) for i in loop.update_indices):
        return
    for average in averagers:
        average(ctx.parts.facade, "update")


@action
def commit_update(ctx: Context) -> None:
    """The window's update is committed: the task's position moves past the window (the driver set the
    point to (epoch, task) when the task began) and the update is counted, once per window (an update skipped
    for inf/NaN counts too): the run state's `updates`, the update clock's and the snapshots' count (their
    `every_n_updates` are multiples of it)."""
    loop = ctx.loop
    if not loop.window_committed:
        # counted here, not at the commit point that follows: a Ctrl-C held during the update is raised
        # after this (release_interrupts), before it, and the window is committed all the same
        loop.run.updates += 1
    loop.window_committed = True
    loop.resume.batches_done = loop.batch_idx


@action
def release_interrupts(ctx: Context) -> None:
    """The update's critical section ends (it began in `unscale_gradients`): a Ctrl-C held since then is
    raised now, with the update committed."""
    ctx.signals.release()


# ---- snapshots (deepepochs.engine.snapshot_trigger) -------------------------------------------------------------
@action
def save_snapshot(ctx: Context) -> None:
    """Write a snapshot of this commit point: mid-epoch with its position (a collective under DDP: every
    rank's generator states go to rank 0), else the epoch's end."""
    ctx.loop.snapshot_due = False
    ctx.snapshot_path = ctx.snapshots.write_snapshot(ctx.parts.facade, position.capture(ctx))


@action
def stop_on_signal(ctx: Context) -> None:
    """End the fit here: raise `Preempted` (the interrupt edge's rollback finds nothing to discard)."""
    signal, ctx.loop.stop_signal = ctx.loop.stop_signal, None
    stop = Preempted(ctx.snapshots.exit_code(signal), signal, ctx.snapshot_path)
    if ctx.parts.dist.is_main:  # the process is about to end: say why where errors go, whatever show_info says
        text = str(stop)
        print(f"deepepochs: {text[0].upper()}{text[1:]}; resume=True continues from it", file=sys.stderr, flush=True)
    raise stop


# ---- rollback ------------------------------------------------------------------------------------------
@action
def discard_window(ctx: Context) -> None:
    """Rollback to the last commit point: drop every gradient the window added (what the last commit point
    left to optimizers that did not step comes back as it kept it), the interrupted update's scaler records,
    the window's loss sums and patches, save requests, and what an epoch's end did before it committed
    (the epoch count, epoch-wise scheduler steps, monitor states: `ctx.epoch_undo`); the model's buffers
    (BatchNorm statistics) come back as the last commit point kept them.

    A window whose update was applied is committed even if the fault came before `commit_update` ran (a
    later post-hook or the scheduler raised): its loss statistics stay and it is not replayed."""
    parts, loop = ctx.parts, ctx.loop
    ctx.signals.drop()
    unfinished = loop.window_updated and loop.update_open  # an applied update whose end did not run
    if unfinished:
        zero_grad(ctx)  # what it leaves is its commit point's
    parts.opts.zero_grad(parts.opts.all_indices)
    parts.dist.drop_unsynced_gradients()  # FSDP keeps a no-sync micro-batch's gradients outside `.grad`
    parts.precision.discard_step_state()
    parts.dist.set_grad_sync(True)
    meters = loop.meters
    if meters is not None and loop.stage == "train" and loop.window_pos:
        if loop.window_updated:  # applied: the update's commit point is completed now, with the position after it
            remember_position(ctx)
            if not loop.window_committed:
                commit_update(ctx)
            if unfinished:  # the weight averages take it, as its end would have (counted first, as it is there)
                average_update(ctx)
        if loop.window_committed:
            if not ctx.batch_counted:  # the step's update was applied, and it raised before returning
                _count_unreturned(ctx, meters)
            _fold_window(loop)
        else:
            meters.discard_window()
    while ctx.epoch_undo:  # epoch-end work of an epoch that did not commit, newest first
        ctx.epoch_undo.pop()()
    loop.save_requests.clear()
    buffers.put_back(ctx)  # last: the epoch-end undo above may have put back an earlier commit point's
    carried.put_back(ctx)  # likewise
    callback_states.put_back(ctx)  # likewise
    put_back_host_state(ctx)  # what the dropped window drew from Python and NumPy, where kept
    kept_grads.put_back(ctx)  # the gradients the optimizers that did not step kept, without this window's


def _count_unreturned(ctx: Context, meters) -> None:
    """The batch whose step applied its update and then raised (a hook after the update, the step's own code
    after `self.optimize()`): its loss counted once, as the step would have reported it. A loss the trainer
    computed (`self.loss`, the default step) is counted with its patches; the loss a custom step gave
    `self.backward(loss)` is counted as the `{'loss': loss.detach()}` it returns; a step that ran its own
    `loss.backward()` gave the trainer nothing to count, which a warning says."""
    own = ctx.backward_loss
    if ctx.step_loss is not None:
        meters.add_batch(ctx.step_loss, ctx.batch_n, ctx.step_patches)
    elif own is not None and own[0] == ctx.loop.batch_idx:
        meters.add_batch(None, ctx.batch_n, {"loss": ValuePatch(own[1], ctx.batch_n)})
    elif ctx.task is not None and ctx.task.step_fn is not None:
        warnings.warn(
            f"the training step of epoch {ctx.loop.epoch}, batch {ctx.loop.batch_idx} applied its update and then"
            " raised before returning its loss: the trainer never saw that loss (the step ran loss.backward()"
            " itself), so the epoch's training loss and metrics leave the batch out after the refit;"
            " backpropagate with self.backward(loss), or compute the loss with self.loss(...), to have it"
            " counted", DeepEpochsWarning, stacklevel=2)


@action
def reset_loop(ctx: Context) -> None:
    """After a rollback: no stage, task or window is open, so the next fit or test starts afresh."""
    loop = ctx.loop
    loop.stage = None
    loop.meters = None
    loop.val_point_open = False
    open_window(ctx)
    callback_states.forget(ctx)  # what open_window kept: outside a fit nothing is (the next fit keeps afresh)
    ctx.task = None
    ctx.model = ctx.parts.train_model


def _fold_window(loop) -> None:
    """Fold a finished window into its task's meters, or leave it out if its update was skipped (no
    optimizer stepped, some skipped for inf/NaN), counting the skipped updates."""
    if loop.window_updated or not loop.finite:  # the common case: the update was applied
        loop.meters.close_window()
        return
    skipped = sum(not ok for ok in loop.finite.values())
    if skipped:
        loop.meters.skip_window(skipped)
    else:
        loop.meters.close_window()


def batch_token(ctx: Context) -> tuple:
    """Identifies the current training iteration for the scaler (all losses of one batch share a scale)."""
    loop = ctx.loop
    return (loop.epoch, loop.batch_idx, id(loop.meters))


# The update clock's and the BatchNorm pass's guards and actions, in modules of their own; imported here so
# that the registry is complete wherever this module is (they import the registry, not this module).
from deepepochs.engine import clock_rules, statistics_pass  # noqa: E402, F401
