"""What a step method may call on `self` (the trainer), and the default steps it overrides.

`StepMethods` is the part of `TrainerBase` that custom steps see: `self.loss(...)` (a `LossCall`, with deepepochs
0.6's `self.loss.optimize()` and `self.loss.do_metric(...)`), `self.do_metric`, `self.optimize`, `self.no_sync`,
`self.batch_patches`, the default `train_step` / `evaluate_step`, and the lookup of the step method a task runs.
Every call goes to the engine's step pieces (`deepepochs.engine.steps`), the one implementation the default step
uses too. `TrainerBase` derives from it and sets `_ctx`, the engine's `Context`; nothing else does.
"""

from __future__ import annotations

import torch

from deepepochs.compat import tell_once
from deepepochs.engine import steps
from deepepochs.engine.context import Context
from deepepochs.engine.stage_tasks import default_step
from deepepochs.errors import ConfigError

__all__ = ["LOSS_CALLS_ADD_UP", "LossCall", "StepMethods", "epochs_are_a_total", "expose_module_as_model"]


def epochs_are_a_total(trainer, epochs: int) -> None:
    """`fit(epochs=k)` on a trainer with epochs done: k is the total target (0.6.18 trained k more). A target
    the run has reached trains nothing, which only 0.6.18's reading can have meant: a `MigrationWarning`,
    once per process. A target ahead of the run reads as 0.7 code means it (the console's `E 6/15` says the
    total): one run-information line says what remains and what 0.6.18 did."""
    done = trainer.loop.completed_epochs
    if not done:
        return
    as_0618 = (f"deepepochs 0.6.18 trained {epochs} more: for that, pass"
               f" fit(epochs=trainer.loop.completed_epochs + {epochs})")
    if epochs <= done:
        tell_once("epochs-total", f"fit(epochs={epochs}) trains nothing: {epochs} is the run's total epoch"
                                  f" target and {done} are done; {as_0618}")
    else:
        trainer.console.note_once("epochs-total", f"fit(epochs={epochs}): {epochs} epochs in total, {done} done,"
                                                  f" {epochs - done} to train ({as_0618})")


LOSS_CALLS_ADD_UP = (
    "this step calls self.loss(...) with metrics again after an earlier such call in the same batch: the"
    " calls of one step add up (the batch's loss is their sum and its metrics cover every call's outputs);"
    " deepepochs 0.6.18 reported the last call's loss and metrics. For 0.6.18's values, pass do_metric=False"
    " to every call but the last and return {'loss': ValuePatch(last_loss.detach(), len(batch_y))} from the"
    " step (a returned 'loss' replaces the summed one)")


def expose_module_as_model(module) -> None:
    """Make `module.model` the module itself, as deepepochs 0.6's `trainer.model.model` (its model wrapper's
    `.model`) was, for a module that has no attribute `model` of its own. Set outside torch's module
    registry (`object.__setattr__`): the module's parameters, buffers, `state_dict()` and `repr` do not
    change."""
    if isinstance(module, torch.nn.Module) and not hasattr(module, "model"):
        object.__setattr__(module, "model", module)


class LossCall:
    """What `trainer.loss` returns: call it in a step; 0.6's `self.loss.optimize()`,
    `self.loss.do_metric(loss, model_out, batch_y)` and `self.loss.on_metric_callback(...)` work too."""

    __slots__ = ("_ctx",)

    def __init__(self, ctx: Context):
        self._ctx = ctx

    def __call__(self, model_out, batch_y=None, loss_adjust: float = 1.0, do_optimize: bool = True,
                 do_metric: bool | None = None, grad_accumulate: bool | None = None):
        """Compute the loss; in training also backpropagate it and (with `do_optimize`) ask for an update.

        `loss_adjust` weights this loss within the batch, e.g. `sub_batch_size / batch_size` when a step
        splits its batch by hand; the update then happens once per window via `self.optimize()`.
        `grad_accumulate=True` is older 0.6's name for `do_optimize=False`.

        As in 0.6.18, the call also computes the trainer's metrics on `(model_out, batch_y)` (so a step
        that only calls `self.loss(out, y)` reports them) and runs the `on_*_metrics` hooks. Several calls
        of one step add up (0.6.18 reported the last one's loss and metrics: a call making metrics after
        another of its step that did says so once, `LOSS_CALLS_ADD_UP`). `do_metric=False` leaves them
        out (a sub-batch, whose metrics come from `self.do_metric(...)` on the whole batch); older 0.6's
        `grad_accumulate=True` leaves them out too.
        In validation/test with `do_loss=False` it computes no loss and returns None.
        """
        if grad_accumulate is not None:  # older 0.6: an accumulating call made no metrics
            do_optimize = not grad_accumulate
            if do_metric is None:
                do_metric = do_optimize
        if do_metric is not None and not isinstance(do_metric, bool):
            raise ConfigError(f"do_metric must be True, False or None (got {do_metric!r})")
        ctx = self._ctx
        if do_metric is not False and ctx.task is not None and ctx.step_patches:
            # an earlier call of this step made the trainer's metrics too: both calls' losses and metrics add up
            tell_once("loss-calls-add-up", LOSS_CALLS_ADD_UP)
        return steps.user_loss(ctx, model_out, batch_y, loss_adjust, do_optimize, do_metric)

    def optimize(self, optimize_index=None) -> None:
        """0.6's `self.loss.optimize(optimize_index=None)`: `trainer.optimize(optimize_index)` (an update of
        those optimizers, None: all, on the window's last micro-batch)."""
        steps.optimize(self._ctx, optimize_index)

    def do_metric(self, loss=None, model_out=None, batch_y=None) -> None:
        """0.6's `self.do_metric(loss, model_out, batch_y)` after sub-batches of one batch: the trainer's
        metrics of the whole batch's `(model_out, batch_y)` and the `on_*_metrics` hooks (which receive
        `loss`). The loss statistics come from the `self.loss` calls already."""
        steps.step_metrics(self._ctx, loss, model_out, batch_y)

    on_metric_callback = do_metric  # the name of older 0.6 releases


class StepMethods:
    """The trainer's methods for step methods (see the module docstring); `TrainerBase` derives from it."""

    _ctx: Context  # set by TrainerBase.__init__

    @property
    def loss(self) -> LossCall:
        """`self.loss(model_out, batch_y=None, loss_adjust=1.0, do_optimize=True)`: compute the loss; in
        training also backpropagate it and (with `do_optimize`) ask for an update. See
        `LossCall.__call__`."""
        return LossCall(self._ctx)

    def do_metric(self, loss=None, model_out=None, batch_y=None) -> None:
        """In a custom step that split its batch by hand (`self.loss(..., do_optimize=False,
        do_metric=False)` per sub-batch): the trainer's metrics of the whole batch and the `on_*_metrics`
        hooks, as deepepochs 0.6 did; `loss` is what the hooks receive."""
        self.loss.do_metric(loss, model_out, batch_y)

    def optimize(self, optimize_index=None, closure=None):
        """Request an update of optimizers `optimize_index` (None = all). It happens only on the window's
        last micro-batch; earlier calls let gradients accumulate.

        The gradients are those the step backpropagated: with `self.loss(...)`, `self.backward(loss)` or its
        own `loss.backward()` (then the update takes them as they are: under accumulation divide the loss
        yourself, or use `self.backward(loss)`, which weighs each micro-batch as `self.loss` does).
        `closure`: for LBFGS and other optimizers whose `step` takes a closure, the function that zeroes the
        gradients (`self.zero_grad()`), re-evaluates the model, backpropagates and returns the loss; each
        optimizer then steps as `opt.step(closure)`, and the loss it returns (the closure's first) is returned
        and reported as the batch's loss. Returns None without a closure.
        """
        return steps.optimize(self._ctx, optimize_index, closure)

    def zero_grad(self, optimize_index=None) -> None:
        """Zero the gradients of optimizers `optimize_index` (None = all; set to None, as torch's
        `opt.zero_grad()`): what an LBFGS closure does first, `def closure(): self.zero_grad(); ...`. Outside a
        closure it drops the gradients the window accumulated so far."""
        opts = self._ctx.parts.opts
        opts.zero_grad(opts.indices(optimize_index))

    def backward(self, loss) -> None:
        """Backpropagate `loss` in a custom training step as `self.loss(...)` does, without computing or
        reporting a loss: the backward hooks run, a micro-batch's share of its accumulation window and the
        fp16 GradScaler's scale are applied. Then call `self.optimize(...)`. (Lightning's
        `self.manual_backward(loss)`.) Report the loss by returning it: `{'loss': loss.detach()}`."""
        steps.user_backward(self._ctx, loss)

    @property
    def carried(self) -> dict:
        """State a step carries from one batch to the next (an RNN's hidden state, a running queue): a dict
        to read and write in steps. What it holds at each committed update is kept with the run, so a
        rollback puts it back, a mid-epoch snapshot stores it (per process) and a resume continues with it;
        values are tensors, numbers, strings and lists, tuples or str-keyed dicts of them."""
        return self._ctx.carried

    def no_sync(self):
        """Context in which backward does not all-reduce gradients (DDP); a no-op in one process."""
        return steps.no_sync(self._ctx)

    # ---- the default steps (override in a subclass or an EpochTask) ----
    @default_step
    def train_step(self, batch_x, batch_y, **step_args):
        """Default training step: forward, loss and backward, metric patches, the update."""
        return steps.default_step(self._ctx, batch_x, batch_y, "train")

    @default_step
    def evaluate_step(self, batch_x, batch_y, **step_args):
        """Default validation/test step: forward, loss, metric patches (no gradients)."""
        return steps.default_step(self._ctx, batch_x, batch_y, self._ctx.loop.stage)

    # ---- deepepochs 0.6's names, as its steps use them ----
    @property
    def current_batch_size(self) -> int:
        """The sample count of the batch being run (0.6's `self.current_batch_size`)."""
        return self._ctx.batch_n

    @property
    def max_epochs(self) -> int:
        """The epoch target (0.6's `self.max_epochs`; `trainer.config.epochs`)."""
        return self._ctx.parts.config.epochs

    @property
    def main_process(self) -> bool:
        """True on rank 0 and in one process (0.6's `self.main_process`; `trainer.is_main_process`)."""
        return self._ctx.parts.dist.is_main

    def print(self, *args, **kwargs) -> None:
        """`print(...)` on rank 0 only (0.6's `self.print`)."""
        if self._ctx.parts.dist.is_main:
            print(*args, **kwargs)

    def batch_patches(self, model_out, batch_y, metrics=None) -> dict:
        """`{name: Patch}` for `metrics` (default: the current task's) under the trainer's metric_patch."""
        return steps.batch_patches(self._ctx, model_out, batch_y, metrics)
