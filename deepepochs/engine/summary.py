"""What a trainer's training batches run, in a few lines: the head of `Trainer.explain()`, above the code.

Each line is read from the parts the engine holds (precision, accumulation, processes, whether the model
is compiled, what each update checks, which actions are left out and why, whether batches run the
generated code); the code itself comes from `deepepochs.engine.compiled`.
"""

from __future__ import annotations

from deepepochs.engine import actions
from deepepochs.engine.batches import FUSED_OBSERVERS
from deepepochs.engine.context import Context
from deepepochs.torch_private import compiled_module

__all__ = ["summary"]


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


def _how(parts) -> str:
    """Whether training batches run the generated code below, or fire its edges one by one (and why)."""
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


def summary(ctx: Context) -> str:
    """A few comment lines saying what `ctx`'s training batches run: precision, accumulation, processes,
    whether the model is compiled, what each update checks, the actions left out and why, and how."""
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
        ("batches run", _how(parts)),
    ]
    width = max(len(label) for label, _ in lines)
    return "\n".join(["# This trainer's training batches, in short:",
                      *(f"#   {label:<{width}}  {text}" for label, text in lines)]) + "\n"
