"""The model's buffers at commit points: what a forward changes besides the parameters.

A training forward changes the model's buffers (BatchNorm's `running_mean`, `running_var` and
`num_batches_tracked`, any tensor a module registered with `register_buffer`, persistent or not), and it
does so before the window's update commits. A rollback must therefore put them back as the last commit
point left them, or the refit would count the discarded window's forwards a second time. The run state
keeps them (`RunState.buffers`, by the names `named_buffers()` gives): taken afresh when a fit starts,
copied at every commit point (`keep`), written back into the model by the rollback (`put_back`) and
stored per rank in mid-epoch snapshots like every generic field of the run state.

The copies are made into tensors allocated when the fit starts, with one call per update (`BufferCopies`,
the fit's scratch in `Context.buffer_copies`), and written back in place, so the tensors the model (and
DDP, which broadcasts them before each forward) holds are never replaced.
"""

from __future__ import annotations

import attrs
import torch

from deepepochs.engine.context import Context
from deepepochs.torch_private import buffers_unchanged, copy_tensors

__all__ = ["BufferCopies", "copy_of", "forget", "keep", "put_back", "write"]


@attrs.define(slots=True, eq=False)
class BufferCopies:
    """Which tensors `keep` copies where: the buffers' owners (module, name), the buffer tensors as the
    modules held them when this was made, detached views of them (what is read), and the run state's
    copies (what is written, the values of `kept`)."""

    kept: dict
    owners: list
    live: list
    sources: list
    copies: list

    @classmethod
    def of(cls, model: torch.nn.Module, kept: dict) -> BufferCopies:
        """Pair each buffer of `model` with its copy in `kept` (`copy_of(model)`, by name)."""
        owners, live, copies = [], [], []
        for prefix, module in model.named_modules():
            for name, buffer in module.named_buffers(recurse=False):
                full = f"{prefix}.{name}" if prefix else name
                copy = kept.get(full)
                if copy is not None:  # None: a buffer shared under two names is kept once
                    owners.append((module, name))
                    live.append(buffer)
                    copies.append(copy)
        return cls(kept, owners, live, [b.detach() for b in live], copies)

    def current(self, kept: dict) -> bool:
        """Whether these pairs still describe `kept` and the model's buffers (none replaced since); a model
        without buffers has nothing to compare."""
        return kept is self.kept and (not self.owners or buffers_unchanged(self.owners, self.live))


def copy_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every buffer of `model` (persistent or not), by name, as independent copies."""
    return {name: buffer.detach().clone() for name, buffer in model.named_buffers()}


def keep(ctx: Context, fresh: bool = False) -> None:
    """A commit point: make the run state's `buffers` the model's buffers as they are now, copied into the
    tensors kept since the fit's start (`fresh`: into new ones, as when none are kept yet). One copy call
    per update; after a restore of the run state (an epoch's end undone) or when a module replaced a
    buffer instead of changing it in place, the copies are made anew by name."""
    run, copies = ctx.loop.run, ctx.buffer_copies
    if fresh or copies is None or run.buffers is None or not copies.current(run.buffers):
        model = ctx.parts.raw_model
        run.buffers = copy_of(model)
        ctx.buffer_copies = BufferCopies.of(model, run.buffers)
    elif copies.copies:
        copy_tensors(copies.copies, copies.sources)


def write(model: torch.nn.Module, buffers: dict[str, torch.Tensor] | None) -> None:
    """Copy `buffers` (by name) into the model's own buffer tensors, in place; names the model does not
    have, or of another shape, are left out."""
    if not buffers:
        return
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            saved = buffers.get(name)
            if saved is not None and saved.shape == buffer.shape:
                buffer.copy_(saved)


def put_back(ctx: Context) -> None:
    """Rollback: the model's buffers as the last commit point of the running fit left them. The kept
    copies are then dropped (`run.buffers` None): outside a fit nothing is kept, so a rollback of a test or
    predict never undoes what the user did to the model in between; the next fit takes them afresh."""
    write(ctx.parts.raw_model, ctx.run.buffers)
    forget(ctx)


def forget(ctx: Context) -> None:
    """The fit is over: nothing is kept outside a fit (see `put_back`)."""
    ctx.run.buffers = None
    ctx.buffer_copies = None
