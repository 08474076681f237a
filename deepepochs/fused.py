"""Fused edges (see spec/loop.py): the training loops that take one edge per micro-batch.

When nothing can observe the inner states of a micro-batch (`can_fuse`), the runner takes the spec's fused
edges and does inline, in the same order, what the actions along their paths do. `_window_batches` covers
every precision and accumulation; `_plain_batches` is one-batch windows in fp32 on the CPU, with the least
Python per batch (what PERF-1 measures on a tiny model: the few branches `_window_batches` adds for
windows, scaler and autocast measured ~0.5 % there). Both are bit-identical to the unfused path
(`Runner._train_batches`); tests/fsm/test_conformance.py checks that, and that each fused trace expands
to the unfused one. A change to what an action does must be made here too.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch

from deepepochs.data import batch_splitter, call_model, lookahead
from deepepochs.fsm.machine import load_spec
from deepepochs.tasks import BatchMetrics

__all__ = ["FUSED_OBSERVERS", "can_fuse", "loop_for", "reads_on_host"]


def _fused_edge_observers() -> tuple[str, ...]:
    """Hooks that run in a window/step/optimize state on a fused edge's path: any of them rules fusing out."""
    spec = load_spec()
    states = {s for f in spec.transitions if f.fuses for t in spec.fused_path(f) for s in (t.source, t.dest)}
    per_batch = {s for s in states if spec.state(s).layer in ("window", "step", "optimize")}
    return tuple(h.name for h in spec.hooks if per_batch & set(h.states))


FUSED_OBSERVERS = _fused_edge_observers()


def reads_on_host(device) -> bool:
    """Whether a loss value may be read per micro-batch (the CPU: no device to sync with). Elsewhere the
    window loop keeps losses on the device and checks finiteness once per task (PERF-2)."""
    return device.type == "cpu"


def can_fuse(runner, task) -> bool:
    """Whether `task`'s training micro-batches take the fused edges (see spec/loop.py): nothing may
    observe, or act in, the inner states of their paths."""
    from deepepochs.trainer import TrainerBase

    t, config = runner.t, runner.t.config
    hooks = t._hooks.by_event
    deferred_skip = config.nonfinite == "skip" and t._precision.scaler is None and not reads_on_host(t.device)
    return (config.fuse_steps and len(t._opts) == 1 and not t._clippers and t._dist.world_size == 1
            and not deferred_skip and getattr(task.step_fn, "__func__", None) is TrainerBase.train_step
            and not any(hooks[name] for name in FUSED_OBSERVERS))


def loop_for(runner, task):
    """The fused training loop for `task`, bound to `runner` (`loop(task, data, meters)`), or None when it
    must take every edge (`Runner._train_batches`)."""
    if not can_fuse(runner, task):
        return None
    t = runner.t
    plain = (t.config.gradient_accumulation_steps == 1 and t._precision.dtype is None
             and reads_on_host(t.device) and t.config.nonfinite == "raise")
    return functools.partial(_marked, _plain_batches if plain else _window_batches, runner)


def _marked(loop, runner, task, data, meters):
    """Run a fused `loop`, marking applied updates inline where the optimizer lets it
    (`Optimizers.marks_inline`); the loop then steps the step-wise scheduler itself (`scheduler`, else
    None). With a scaler the hook stays: it is what tells whether `scaler.step` stepped."""
    t = runner.t
    if t._precision.scaler is not None:
        return loop(runner, task, data, meters, None)
    with t._opts.marks_inline(0) as inline:
        return loop(runner, task, data, meters, t._opts.step_scheduler(0) if inline else None)


def _plain_batches(runner, task, data, meters, scheduler):
    """`_window_batches` for one-batch windows in fp32 on the CPU with nonfinite='raise', where a small
    model shows the loop's own cost most: one `window_step` edge per batch and only the work this case
    needs, inline (no window list, no scaler, no normalisation: the same results, bit for bit), even the
    splitter's check of an `(x, y)` pair (a call less per batch), and the backward started from a cached
    gradient of ones through `torch.autograd.backward` (`_backward`). The loss is checked to be a
    scalar on the task's first batch (a later one raises from `backward`); the task's loss sum and sample
    count are kept in locals, in the same order of additions as `TaskMeters.add_done`, and written back
    when the loop ends however it ends."""
    t, loop = runner.t, runner.t.loop
    step = t.machine.bound("window_step", "task_train")
    model, device, opt, loss_fn = t.model, t.device, t._opts[0].opt, t.loss_fn
    split = batch_splitter(loss_fn is not None, device, False, task.batch_size)
    pairs = loss_fn is not None and task.batch_size is None
    patches_of = t.batch_patches if task.all_metrics else None
    console = t._console
    log_batch = console.log_batch or console.log_tqdm
    isfinite, tensor, fold = math.isfinite, torch.Tensor, meters.fold_patches
    idx, value, n, patches, updating, checked = loop.batch_idx, 0.0, 0, None, False, False
    total, samples = meters.host_sum, meters.count
    seeds = {}  # the gradient of ones each backward starts from (_backward)
    try:
        for batch in data:
            idx += 1
            loop.batch_idx, loop.window_pos, loop.window_updated = idx, 1, False
            if pairs and type(batch) in (tuple, list) and len(batch) == 2:  # batch_splitter's check, inline
                batch_x, batch_y = batch
                if (type(batch_x) is tensor and type(batch_y) is tensor and batch_x.is_cpu and batch_y.is_cpu
                        and batch_y.dim()):
                    n = batch_y.shape[0]
                else:
                    batch_x, batch_y, n = split(batch)
            else:
                batch_x, batch_y, n = split(batch)
            model_out = model(batch_x) if type(batch_x) is tensor else call_model(model, batch_x)
            if checked:
                loss = loss_fn(model_out, batch_y)
            else:
                loss, checked = runner.compute_loss(model_out, batch_y), loss_fn is not None
            if patches_of is not None:
                patches = patches_of(model_out, batch_y)
            _backward(loss, 1.0, seeds)  # `loss.backward()` bit for bit, less a ones_like and a frame
            value = loss.item()
            if not isfinite(value):
                runner._raise_nonfinite()
            updating = True
            opt.step()
            loop.window_updated = True  # (so does the hook, if kept): from here on an interrupt keeps it
            if scheduler is not None:
                scheduler.step()
            updating = False
            total += value * n
            samples += n
            if patches:
                fold(patches)
            opt.zero_grad(set_to_none=True)
            loop.window_pos = 0
            step()
            if log_batch:
                console.batch(idx, lambda value=value, patches=patches: BatchMetrics(value, patches))
    finally:
        if updating and loop.window_updated:  # a post-hook or the scheduler failed after the update: it counts
            total += value * n
            samples += n
            if patches:
                fold(patches)
        if samples != meters.count:
            meters.host_sum, meters.count, meters.final = total, samples, None


def _backward(root: torch.Tensor, factor: float, seeds: dict) -> None:
    """`(root * factor).backward()`, bit for bit (the multiply's backward would hand exactly `factor` on),
    without the multiply, its backward node, the implicit `ones_like` and `Tensor.backward`'s frame: the
    backward starts from a gradient `factor` shaped as `root`, made once per task and share (`seeds`).
    ~17 µs per micro-batch on a tiny CPU model with a factor, ~3 µs without."""
    seed = seeds.get(factor)
    if seed is None or seed.dim() != root.dim():
        if len(seeds) >= 16:  # batch sizes that vary without bound (bucketing) must not grow the cache
            seeds.clear()
        seed = seeds[factor] = torch.full_like(root, factor)
    if type(root) is torch.Tensor:
        torch.autograd.backward((root,), (seed,))
    else:  # a tensor subclass keeps its own backward
        root.backward(seed)


def _window_batches(runner, task, data, meters, scheduler):
    """One fused edge per micro-batch: `accumulate_step` inside a window, `update_step` or `skip_step`
    at its end, or for one-batch windows `window_step` or `window_skip_step`. Inline, in the unfused
    path's order, this does what that path's actions do when nothing observes it: forward, loss and
    metric patches (under autocast), backward of the loss weighted by the micro-batch's share of the
    window (scaled under fp16); at the window's end unscale (fp16), normalise by the window's samples
    (unscale_gradients), the finiteness decision (the scaler's inf check, or the window's losses: a host
    read on the CPU, a device flag checked at the task's end on an accelerator), the optimizer step and
    its step-wise scheduler (step_optimizer) or the skip, the scale update, zero_grad, and counting the
    window in the task's meters (close_window).

    Without a scaler, a micro-batch of a k-batch window starts its backward from its share of the window
    (`_backward`: one cached seed tensor per share) instead of backpropagating `loss * share`: the same
    gradients bit for bit, without the multiply, its backward node and the implicit `ones_like` (~17 µs
    per micro-batch on a tiny CPU model, more than the loop's own bookkeeping).

    A small model on the CPU shows the loop's own cost most (PERF-1), so the common cases cost no call
    they do not need: the splitter's check of an `(x, y)` pair of CPU tensors is inline, the loss is
    checked to be a scalar on the task's first micro-batch only (a later one raises from `backward`), one
    autocast context is entered per micro-batch, and on the host the task's loss sum and sample count are
    kept in locals, added in `TaskMeters.add_done`'s order and written back however the loop ends.

    `loop.window_pos` counts the open window's micro-batches and `loop.window_updated` (set by the
    optimizer's post-hook, or here when it is marked inline) marks an applied update, so an interrupt
    resumes exactly as on the unfused path. A window counts once its update is applied, even if a later
    post-hook or the scheduler fails (`finally`); its patches are made before the update, so unlike in a
    custom step no interrupt loses them."""
    t, loop, machine, config = runner.t, runner.t.loop, runner.t.machine, runner.t.config
    k = config.gradient_accumulation_steps
    if k == 1:  # one-batch windows: opening the window is part of the batch's one edge
        begin = inner = None
        updated_step, skipped_step = (machine.bound(e, "task_train") for e in ("window_step", "window_skip_step"))
    else:
        begin, inner = machine.bound("begin_window", "task_train"), machine.bound("accumulate_step", "window_open")
        updated_step, skipped_step = (machine.bound(e, "window_open") for e in ("update_step", "skip_step"))
    model, device, opt, loss_fn = t.model, t.device, t._opts[0].opt, t.loss_fn
    scaler, precision = t._precision.scaler, t._precision
    autocast = precision.autocast() if precision.dtype is not None else None  # entered once per micro-batch
    raise_nonfinite = config.nonfinite == "raise"
    host = reads_on_host(device)
    split = batch_splitter(loss_fn is not None, device, device.type == "cuda", task.batch_size)
    pairs = loss_fn is not None and task.batch_size is None and device.type == "cpu"
    patches_of = t.batch_patches if task.all_metrics else None
    console = t._console
    log_batch = console.log_batch or console.log_tqdm
    isfinite, tensor, fold, count = math.isfinite, torch.Tensor, meters.fold_patches, meters.add_done
    batches = lookahead(data) if k > 1 else zip(data, itertools.repeat(True))
    idx, pos, first, samples_in_window, value, n, patches = loop.batch_idx, 0, 0, 0, 0.0, 0, None
    window, finite, updating, checked = [], True, False, False  # window: its earlier micro-batches' counts
    seeds = {}  # a micro-batch's share of its window -> the gradient its backward starts from (_backward)
    total, samples = meters.host_sum, meters.count
    try:
        for batch, is_last in batches:
            if pos == 0:
                if begin is None:
                    loop.window_updated = False  # what opening a window does that this loop reads
                else:
                    begin()
            idx += 1
            pos += 1
            loop.batch_idx, loop.window_pos = idx, pos
            if pairs and type(batch) in (tuple, list) and len(batch) == 2:  # batch_splitter's check, inline
                batch_x, batch_y = batch
                if (type(batch_x) is tensor and type(batch_y) is tensor and batch_x.is_cpu and batch_y.is_cpu
                        and batch_y.dim()):
                    n = batch_y.shape[0]
                else:
                    batch_x, batch_y, n = split(batch)
            else:
                batch_x, batch_y, n = split(batch)
            if autocast is not None:  # AMP-1: forward, loss and patches (`with`, less a no-op context in fp32)
                autocast.__enter__()
            try:
                model_out = model(batch_x) if type(batch_x) is tensor else call_model(model, batch_x)
                if checked:
                    loss = loss_fn(model_out, batch_y)
                else:
                    loss, checked = runner.compute_loss(model_out, batch_y), loss_fn is not None
                if patches_of is not None:
                    patches = patches_of(model_out, batch_y)
            finally:
                if autocast is not None:
                    autocast.__exit__(None, None, None)
            if k == 1:
                factor = 1.0
            else:  # this micro-batch's share of the window (see Runner.loss)
                if pos == 1:
                    first, samples_in_window = n, 0
                samples_in_window += n
                factor = n / (k * first)
            if scaler is None:
                _backward(loss, factor, seeds)
            else:  # every loss of the window is scaled with the same scale
                _backward(scaler.scale(loss if factor == 1.0 else loss * factor), 1.0, seeds)
            if host:
                value = loss.item()
                if finite and not isfinite(value):
                    finite = False
            else:
                value = loss.detach()
            if pos < k and not is_last:
                window.append((value, n, patches))
                inner()
            else:
                updating = True
                if scaler is not None:
                    scaler.unscale_(opt)
                if k > 1:
                    norm = k * first / samples_in_window
                    if norm != 1.0:
                        torch._foreach_mul_(t._opts.grads(0), norm)
                if scaler is not None:
                    scaler.step(opt)  # steps (post-hook: window_updated) unless it found inf/NaN
                    scaler.update()
                    updated = loop.window_updated
                elif finite:
                    opt.step()
                    updated = loop.window_updated = True  # (so does the hook, if kept)
                    if scheduler is not None:
                        scheduler.step()
                elif raise_nonfinite:
                    runner._raise_nonfinite()
                else:
                    updated = False
                updating = False
                if host:  # TaskMeters.add_done, inline
                    for v, m, p in window:
                        total += v * m
                        samples += m
                        if p:
                            fold(p)
                    total += value * n
                    samples += n
                    if patches:
                        fold(patches)
                else:
                    for done in window:
                        count(*done)
                    count(value, n, patches)
                if window:
                    window.clear()
                finite = True
                opt.zero_grad(set_to_none=True)
                pos = loop.window_pos = 0
                if updated:
                    updated_step()
                else:
                    skipped_step()
            if log_batch:
                console.batch(idx, lambda value=value, patches=patches: BatchMetrics(value, patches))
    finally:
        if host and samples != meters.count:
            meters.host_sum, meters.count, meters.final = total, samples, None
        if updating and loop.window_updated:  # a post-hook or the scheduler failed after the update: it counts
            for done in window:
                count(*done)
            count(value, n, patches)
    if not host and meters.loss_sum is not None:  # PERF-2: a device flag per task, not a read per batch
        bad = ~torch.isfinite(meters.loss_sum)
        runner._pending_nonfinite = bad if runner._pending_nonfinite is None else runner._pending_nonfinite | bad
