"""What a trainer's training batches run, in a few lines: the head of `Trainer.explain()`, above the code.

Each line is read from the parts the engine holds (precision, accumulation, processes, whether the model
is compiled, what each update checks, which actions are left out and why, whether batches run the
generated code); the code itself comes from `deepepochs.engine.compiled`.
"""

from __future__ import annotations

import inspect
import textwrap

from deepepochs.engine import actions, compiled
from deepepochs.engine.batches import FUSED_OBSERVERS
from deepepochs.engine.context import Context
from deepepochs.engine.stage_tasks import resolve_step
from deepepochs.fsm.machine import load_spec
from deepepochs.torch_private import compiled_module

__all__ = ["explain", "summary"]

#: What a custom step's calls fire, for the lines `custom_step_text` prints above the spec's edges.
_CALLS = {
    "begin_batch": "a batch was read (before the step runs)",
    "backward": "self.loss(out, y) or self.backward(loss)",
    "optimize": "self.optimize(i[, closure=...]), or self.loss(...) with do_optimize",
    "clip": "inside the update", "apply_update": "inside the update, once per optimizer",
    "finish_update": "inside the update", "end_batch": "the step returned",
}


def _precision(parts) -> str:
    name = parts.precision.name
    if parts.precision.scaler is not None:
        return f"{name}: autocast to float16; a GradScaler scales the loss"
    if parts.precision.dtype is not None:
        return f"{name}: autocast to {str(parts.precision.dtype).removeprefix('torch.')}, no loss scaling"
    return f"{name}: no autocast"


def _checks(parts) -> str:
    """What every update checks before the optimizers step, and what follows when a check fails."""
    if parts.precision.scaler is not None:
        checks = ["the GradScaler's inf/NaN check of the unscaled gradients (a failing update is skipped, the"
                  " scale lowered)"]
    elif parts.config.nonfinite == "raise":
        checks = ["inf/NaN in the window's losses and gradients (nonfinite='raise': FloatingPointError)"]
    else:
        checks = ["inf/NaN in the window's losses and gradients (nonfinite='skip': the update is skipped)"]
    if parts.clippers:
        checks.append(f"gradient clipping ({len(parts.clippers)} clipper{'s' if len(parts.clippers) > 1 else ''})")
    return "; ".join(checks)


def _how(parts, step) -> str:
    """Whether training batches run the generated code below, or fire its edges one by one (and why)."""
    if step is not None:
        return f"your {_name(step)}, edge by edge (below: its source and the edges its calls take)"
    why = []
    if not parts.config.fuse_steps:
        why.append("fuse_steps=False")
    if len(parts.opts) != 1:
        why.append(f"{len(parts.opts)} optimizers")
    hooks = sorted(name for name in FUSED_OBSERVERS if parts.hooks.by_event[name])
    if hooks:
        why.append("callback hooks inside a batch: " + ", ".join(hooks))
    if why:
        return "edge by edge (" + "; ".join(why) + "): the same actions as the code below, each recorded"
    return "the generated code below, one call per batch (a custom training step fires edge by edge instead)"


def _name(step) -> str:
    return f"{type(step.__self__).__name__}.{step.__name__}" if hasattr(step, "__self__") else repr(step)


def explain(ctx: Context) -> str:
    """`Trainer.explain()`: the summary, then the code a training batch runs: the code generated from the
    spec for the default step, or a custom step's own source with the spec edges its calls take."""
    step = resolve_step(ctx.parts.facade, None, "train")
    return summary(ctx, step) + "\n" + (compiled.explain(ctx) if step is None else custom_step_text(step))


def custom_step_text(step) -> str:
    """A custom training step's source (where Python can find it), then the loop spec's edges that its calls
    take, each with its guards (`!`: not) and actions, or the error it raises."""
    try:
        lines, first = inspect.getsourcelines(step)
        where = f"{inspect.getsourcefile(step)}, line {first}"
        source = textwrap.dedent("".join(lines))
    except (OSError, TypeError):
        where, source = "its source is not available", ""
    spec = load_spec()
    out = [f"# The training step that runs is {_name(step)} ({where}), not the default step:", source]
    out.append("# The edges its calls take, from the loop spec (`python -m deepepochs graph --level batch`):")
    for trigger, call in _CALLS.items():
        out.append(f"# {trigger}: {call}")
        for t in spec.transitions:
            layer = spec.state(t.source).layer
            training = layer in ("window", "optimize") or layer == "step" and t.source.startswith("step_")
            if t.trigger != trigger or t.fuses or not training:
                continue
            then = f"error: {t.error}" if t.dest is None else (", ".join(t.actions) or "no action")
            guards = f" {t.guard_label}" if t.guard_label else ""
            out.append(f"#   {t.source} --{trigger}{guards}--> {t.dest or '(refused)'}: {then}")
    return "\n".join(out) + "\n"


def summary(ctx: Context, step=None) -> str:
    """A few comment lines saying what `ctx`'s training batches run: precision, accumulation, processes,
    whether the model is compiled, what each update checks, the actions left out and why, and how
    (`step`: the trainer's own training step method, or None for the default step)."""
    parts = ctx.parts
    k = parts.config.gradient_accumulation_steps
    world = parts.dist.world_size
    compiled = compiled_module(parts.eval_model) is not None
    by_reason: dict[str, list[str]] = {}
    for name, why in actions.folded(parts).items():
        by_reason.setdefault(why, []).append(name)
    left_out = "; ".join(f"{', '.join(names)} ({why})" for why, names in by_reason.items()) or "nothing"
    lines = [
        ("precision", _precision(parts)),
        ("accumulation", f"{k} batch{'es' if k > 1 else ''} per optimizer update"),
        ("processes", f"{world}" + (" (gradients all-reduced on each update's last batch)" if world > 1 else "")),
        ("model", "compiled with torch.compile" if compiled else
         "not compiled (compile_model=True, or Trainer(torch.compile(model)), compiles it)"),
        ("each update", _checks(parts)),
        ("left out", left_out),
        ("batches run", _how(parts, step)),
    ]
    width = max(len(label) for label, _ in lines)
    return "\n".join(["# This trainer's training batches, in short:",
                      *(f"#   {label:<{width}}  {text}" for label, text in lines)]) + "\n"
