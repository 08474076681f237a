"""A trial fit: training that leaves no trace (the learning-rate finder's sweep, `deepepochs.training.lr_sweep`).

It runs the ordinary fit (the same steps, precision, accumulation and DDP handling) with only the given
callbacks attached and the console silent, starting a fresh epoch; whatever ends it (its callbacks end
it by raising), the model (every buffer included), what steps carry (`trainer.carried`), optimizers,
schedulers, GradScaler, every global generator and the run state (`deepepochs.engine.runstate`:
counters, records, meters, random state, data position) are put back as they were before it, so a field
added to the run state is restored without a change here.
"""

from __future__ import annotations

import copy

from deepepochs.engine import buffers, carried, runstate
from deepepochs.utils import rng_state, set_rng_state

__all__ = ["trial_fit"]


def trial_fit(driver, tasks, callbacks, more_epochs: int):
    """Train `tasks` for up to `more_epochs` epochs past the completed ones with only `callbacks` attached
    and nothing printed, then restore the trainer (see the module docstring); re-raises what ended it.

    A pending `resume=...` is honoured first, so the restore keeps what it loaded. The trial starts a fresh
    epoch: no early stop pending, no interrupted epoch continued (both come back afterwards)."""
    ctx = driver.ctx
    parts, run = ctx.parts, ctx.run
    driver.honour_resume()
    console, hooks = parts.console, parts.hooks
    saved_run = runstate.capture(run)
    model = {k: v.detach().clone() for k, v in parts.raw_model.state_dict().items()}
    model_buffers = buffers.copy_of(parts.raw_model)  # non-persistent ones too, which state_dict() leaves out
    live_carried = carried.copied(ctx.carried)  # what the sweep's steps carry must not reach the next fit
    opts = copy.deepcopy(parts.opts.state_dict())
    scaler = copy.deepcopy(parts.precision.state_dict())
    generators = rng_state()
    shown = (console.enabled, console.log_batch, console.log_tqdm, console.show_info, driver.header_done)
    attached = list(hooks.callbacks)
    try:
        run.stop, run.resume, run.train_meters = None, None, None
        hooks.remove(attached)
        hooks.extend(callbacks)
        console.enabled = console.log_batch = console.log_tqdm = console.show_info = False
        epochs = run.completed_epochs + more_epochs
        return driver.guarded("fit", lambda: driver.run_fit(tasks, [], 1, epochs))
    finally:
        hooks.remove(list(callbacks))
        hooks.extend(attached)
        console.enabled, console.log_batch, console.log_tqdm, console.show_info, driver.header_done = shown
        parts.raw_model.load_state_dict(model)
        buffers.write(parts.raw_model, model_buffers)
        carried.write(ctx.carried, live_carried)
        parts.opts.load_state_dict(opts)
        parts.opts.zero_grad(parts.opts.all_indices)
        parts.precision.load_state_dict(scaler)
        set_rng_state(generators)
        runstate.restore(run, saved_run)
