"""Optimizers and LR schedulers: the `Optimizer` wrapper and the trainer's group of them."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence

import attrs
import torch

from deepepochs import torch_private
from deepepochs.config import check_choice
from deepepochs.errors import ConfigError, DeepEpochsWarning

__all__ = ["Optimizer", "Optimizers"]


def _is_optimizer(_instance, attribute, value):
    if not isinstance(value, torch.optim.Optimizer):
        raise ConfigError(f"{attribute.name} must be a torch.optim.Optimizer (got {_what(value)})")


def _what(value) -> str:
    """What was passed instead of an optimizer; an optimizer class gets the fix (make an instance), a
    learning-rate scheduler (as in `(opt, sched)`, a pair other libraries take) how to give it with its
    optimizer."""
    if isinstance(value, type) and issubclass(value, torch.optim.Optimizer):
        return (f"the class {value.__name__}, not an instance: pass an instance, e.g."
                f" {value.__name__}(model.parameters())")
    if isinstance(value, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        return (f"the learning-rate scheduler {type(value).__name__}: give a scheduler with its optimizer as"
                " Optimizer(opt, sched) (from deepepochs import Optimizer), e.g. Trainer(model, loss,"
                " Optimizer(opt, sched)); a list or tuple of optimizers is several optimizers")
    return type(value).__name__


def _sched_on(_instance, attribute, value):
    check_choice(attribute.name, value, ("epoch", "step"))


def _is_bool(_instance, attribute, value):
    if not isinstance(value, bool):
        raise ConfigError(f"{attribute.name} must be True or False (got {value!r})")


@attrs.define
class Optimizer:
    """An optimizer with an optional LR scheduler.

    Args:
        opt: the `torch.optim.Optimizer`.
        scheduler: an LR scheduler of `opt` (or None).
        sched_on: 'epoch' steps the scheduler after each epoch; 'step' after each update the optimizer
            actually made (a step skipped for inf/NaN gradients does not advance it).
        sched_with_loss: pass the epoch's loss to `scheduler.step(loss)` (e.g. ReduceLROnPlateau): the
            validation loss when validation ran, else the training loss. Only with sched_on='epoch'.

    Example:
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> Trainer(model, loss, Optimizer(opt, torch.optim.lr_scheduler.StepLR(opt, 10)))
    """

    opt: torch.optim.Optimizer = attrs.field(validator=_is_optimizer)
    # Checked when set too: a step-wise schedule sized by `trainer.estimated_updates` is attached after
    # the Trainer exists (`trainer.opt[0].scheduler = OneCycleLR(...)`); each update reads it then.
    scheduler: object = attrs.field(default=None, validator=lambda self, _a, value: _check_scheduler(self.opt, value))
    sched_on: str = attrs.field(default="epoch", validator=_sched_on)
    sched_with_loss: bool = attrs.field(default=False, validator=_is_bool)

    def __attrs_post_init__(self):
        if self.sched_with_loss and self.sched_on != "epoch":
            raise ConfigError("sched_with_loss=True needs sched_on='epoch' (got sched_on='step')")
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) and not self.sched_with_loss:
            raise ConfigError("a ReduceLROnPlateau scheduler steps with the loss it watches: pass"
                              f" Optimizer(opt, scheduler, sched_with_loss=True) (got sched_on={self.sched_on!r},"
                              " sched_with_loss=False)")

    @property
    def param_groups(self) -> list:
        """The optimizer's parameter groups (0.6's `trainer.opt.param_groups`)."""
        return self.opt.param_groups

    def get_current_lr(self) -> float:
        """The learning rate of the optimizer's first parameter group now (0.6's accessor)."""
        return self.opt.param_groups[0]["lr"]

    def get_last_lr(self) -> list | None:
        """The scheduler's `get_last_lr()` (one rate per parameter group), or None without a scheduler, as
        in 0.6."""
        return None if self.scheduler is None else self.scheduler.get_last_lr()


def _check_scheduler(opt, scheduler) -> None:
    if scheduler is not None and not callable(getattr(scheduler, "step", None)):
        raise ConfigError(f"scheduler must have a step() method (got {type(scheduler).__name__})")
    owner = getattr(scheduler, "optimizer", opt)
    if owner is not opt:
        # The scheduler would change the learning rate of an optimizer this wrapper never steps, and its
        # step-after-skip bookkeeping would follow the wrong optimizer.
        raise ConfigError("scheduler must schedule the optimizer it is wrapped with (got a scheduler of"
                          f" another {type(owner).__name__}); pass Optimizer(opt, scheduler_of_opt)")


class _MarkUpdate:
    """The step post-hook of `Optimizers.bind_updates`: records on the loop that an update was applied
    (`window_updated`), the moment it is, even if a later post-hook raises or the step was a user's own
    `opt.step()` inside a custom step. An object rather than a closure: `copy.deepcopy` of a trainer copies
    it with the optimizer, bound to the copy's loop (a closure would be shared and mark the original's)."""

    __slots__ = ("loop",)

    def __init__(self, loop):
        self.loop = loop

    def __call__(self, _optimizer, _args, _kwargs):
        if self.loop.stage == "train":
            self.loop.window_updated = True


class _RefuseOwnStep:
    """The step pre-hook of `Optimizers.bind_updates`: while its trainer trains, an optimizer steps only
    inside the trainer's update (`loop.update_open`). A step method's own `opt.step()` (Lightning's manual
    optimisation) would apply an update that no checkpoint, schedule, snapshot or rollback knows of and
    whose gradients are never zeroed: it is refused before anything changes, naming what to call."""

    __slots__ = ("index", "loop")

    def __init__(self, loop, index: int):
        self.loop, self.index = loop, index

    def __call__(self, optimizer, _args, _kwargs):
        loop = self.loop
        if loop.stage == "train" and not loop.update_open:
            i = self.index
            raise ConfigError(
                f"optimizer {i} ({type(optimizer).__name__}) was stepped directly (opt.step()) during training;"
                f" the trainer steps its optimizers itself, so that the update is counted, scheduled, checkpointed"
                f" and rolled back: in a custom step call self.optimize({i}) after the backward (self.loss(out, y),"
                f" self.backward(loss) or loss.backward()), and for an optimizer that takes a closure (LBFGS)"
                f" self.optimize({i}, closure=closure). Lightning's manual optimisation, self.manual_backward(loss);"
                f" opt.step(), becomes self.backward(loss); self.optimize({i})")


class Optimizers(Sequence):
    """The trainer's optimizers, in `optimize_index` order."""

    def __init__(self, opt, model: torch.nn.Module):
        if opt is None:
            params = [p for p in model.parameters() if p.requires_grad]
            items = [Optimizer(torch.optim.Adam(params, lr=1e-3))] if params else []
        else:
            raw = list(opt) if isinstance(opt, (list, tuple)) else [opt]
            items = []
            for i, o in enumerate(raw):
                if isinstance(o, Optimizer):
                    items.append(o)
                elif isinstance(o, torch.optim.Optimizer):
                    items.append(Optimizer(o))
                else:
                    raise ConfigError(
                        f"opt[{i}] must be a torch.optim.Optimizer or deepepochs.Optimizer (got"
                        f" {_what(o)})" if isinstance(opt, (list, tuple)) else
                        "opt must be None, a torch.optim.Optimizer, a deepepochs.Optimizer or a list of them"
                        f" (got {_what(o)})"
                    )
        self.items: list[Optimizer] = items
        self.all_indices = tuple(range(len(items)))
        #: the CPU finite check sums these optimizers' gradients (`torch_private.sums_pay_off`)
        self.sum_check = torch_private.sums_pay_off(
            [p for item in items for group in item.opt.param_groups for p in group["params"]])
        self._marks: list = []  # the hook handles of bind_updates, one per optimizer
        self._loop = None  # the loop state bind_updates marks

    def check_covers(self, model: torch.nn.Module) -> None:
        """Refuse optimizers that train none of `model`'s trainable parameters (ConfigError), and warn
        when some trainable parameters are in no optimizer: neither trains what the user expects."""
        if not self.items:
            return
        trainable = [p for p in model.parameters() if p.requires_grad]
        held = {id(p) for item in self.items for group in item.opt.param_groups for p in group["params"]}
        left = [p for p in trainable if id(p) not in held]
        if trainable and len(left) == len(trainable):
            raise ConfigError(f"opt holds none of the model's {len(trainable)} trainable parameters (tensors),"
                              " so nothing would train; build the optimizer from model.parameters()")
        if left:
            warnings.warn(f"{len(left)} of the model's {len(trainable)} trainable parameters (tensors) are in no"
                          " optimizer and will not train; add them to an optimizer or set requires_grad=False",
                          DeepEpochsWarning, stacklevel=3)

    def __getitem__(self, i):
        return self.items[i]

    def get_current_lr(self) -> list:
        """Each optimizer's `get_current_lr()`, a list in `optimize_index` order, also with one optimizer (a
        one-item list, as deepepochs 0.6.18's `trainer.opt.get_current_lr()` gave); `trainer.opt[i]` answers
        for one optimizer."""
        return [item.get_current_lr() for item in self.items]

    def get_last_lr(self) -> list:
        """Each optimizer's `get_last_lr()` (its scheduler's, None without one), a list as `get_current_lr`."""
        return [item.get_last_lr() for item in self.items]

    def __len__(self):
        return len(self.items)

    def indices(self, optimize_index) -> tuple[int, ...]:
        """Normalise `optimize_index` (None = all, an int, or a sequence of distinct ints) to a tuple."""
        if optimize_index is None:
            return self.all_indices
        if isinstance(optimize_index, int) and not isinstance(optimize_index, bool):
            if 0 <= optimize_index < len(self.items):
                return (optimize_index,)
            idx = (optimize_index,)
        else:
            try:
                idx = tuple(optimize_index)
            except TypeError:
                idx = (optimize_index,)
        valid = all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(self.items) for i in idx)
        if not valid or len(set(idx)) != len(idx):
            raise ConfigError(
                f"optimize_index must be None (all optimizers), an int or a sequence of distinct ints in"
                f" 0..{len(self.items) - 1} (got {optimize_index!r}); the trainer has {len(self.items)}"
                " optimizer(s)"
            )
        return idx

    def grads(self, index: int) -> list[torch.Tensor]:
        """The existing gradients of one optimizer's parameters (asked once per update: plain loops, which cost
        ~1.5k instructions less than a comprehension's function on Python 3.11)."""
        grads = []
        for group in self.items[index].opt.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is not None:
                    grads.append(g)
        return grads

    def bind_updates(self, loop) -> None:
        """Mark every applied update on `loop` (`loop.window_updated`), so a rollback never replays it.

        A step post-hook, registered when the trainer is built so that it runs before any post-hook
        registered later, sets the flag the moment the update is applied: a fault after that (another
        post-hook, a callback) then cannot replay the update. A skipped update (fp16 overflow) never calls
        `opt.step`. The step-wise scheduler is stepped by the `step_optimizer` action, not here. The hook
        acts only while its own trainer trains (`loop.stage == 'train'`): an optimizer stepped by user code
        between fits, or shared with a later trainer, marks nothing. A step pre-hook refuses a step
        outside the trainer's update while it trains (`_RefuseOwnStep`). `unbind_updates` removes the hooks.
        """

        self._loop = loop
        self._marks = [item.opt.register_step_post_hook(_MarkUpdate(loop)) for item in self.items]
        self._marks += [item.opt.register_step_pre_hook(_RefuseOwnStep(loop, i)) for i, item in enumerate(self.items)]

    def __deepcopy__(self, memo):
        """A copy whose optimizers carry the hooks of `bind_updates`, bound to the copied loop (torch's
        `Optimizer` drops its hooks when copied, so the copy's scheduler would never step)."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        for name, value in vars(self).items():
            if name != "_marks":  # handles of the original's hooks
                setattr(copied, name, copy.deepcopy(value, memo))
        copied._marks = []
        if self._marks:
            copied.bind_updates(copied._loop)
        return copied

    def unbind_updates(self) -> None:
        """Remove the hooks of `bind_updates`."""
        for handle in self._marks:
            handle.remove()
        self._marks = []

    def step_scheduler(self, index: int):
        """Optimizer `index`'s scheduler when it steps per update (sched_on='step'), else None."""
        item = self.items[index]
        return item.scheduler if item.sched_on == "step" else None

    def drop_stale_grads(self) -> None:
        """Zero the gradients a fit would otherwise start from (e.g. left by user code between fits); a
        parameter scan, so the common case (none left) skips `zero_grad` and its profiler wrappers."""
        for item in self.items:
            if any(p.grad is not None for group in item.opt.param_groups for p in group["params"]):
                item.opt.zero_grad(set_to_none=True)

    def zero_grad(self, indices: Sequence[int]) -> None:
        """Zero gradients (set to None, so the next backward writes instead of accumulating)."""
        for i in indices:
            self.items[i].opt.zero_grad(set_to_none=True)

    def step_epoch(self, train_loss: float | None, val_loss: float | None) -> None:
        """Step epoch-wise schedulers; those with `sched_with_loss` get the val loss, else the train loss."""
        for item in self.items:
            if item.scheduler is None or item.sched_on != "epoch":
                continue
            if item.sched_with_loss:
                loss = val_loss if val_loss is not None else train_loss
                if loss is None:
                    raise ConfigError("sched_with_loss=True needs a loss, but no loss was computed this"
                                      " epoch; keep do_val_loss=True or use sched_with_loss=False")
                item.scheduler.step(loss)
            else:
                with warnings.catch_warnings():
                    # Epoch-wise scheduling after an epoch whose every step was skipped by the fp16 scaler
                    # is intended; PyTorch would warn that optimizer.step() was not called.
                    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
                    item.scheduler.step()

    def epoch_scheduler_state(self) -> list:
        """The epoch-wise schedulers' states and their optimizers' learning rates, for
        `load_epoch_scheduler_state` (a rollback of an epoch's end that did not commit)."""
        return [(item.scheduler.state_dict(), [group["lr"] for group in item.opt.param_groups])
                if item.scheduler is not None and item.sched_on == "epoch" else None for item in self.items]

    def load_epoch_scheduler_state(self, state: list) -> None:
        """Restore `epoch_scheduler_state()` output."""
        for item, saved in zip(self.items, state):
            if saved is not None:
                item.scheduler.load_state_dict(saved[0])
                for group, lr in zip(item.opt.param_groups, saved[1]):
                    group["lr"] = lr

    def lrs(self) -> dict[str, float]:
        """Learning rates of every param group, named `lr` or `lr_<opt>_<group>`."""
        out = {}
        for i, item in enumerate(self.items):
            for j, group in enumerate(item.opt.param_groups):
                key = "lr" if len(self.items) == 1 and len(item.opt.param_groups) == 1 else f"lr_{i}_{j}"
                out[key] = float(group["lr"])
        return out

    def state_dict(self) -> dict:
        """Optimizer and scheduler states, as lists in `optimize_index` order (under FSDP the optimizers'
        hold this rank's shards)."""
        return {
            "optimizers": [item.opt.state_dict() for item in self.items],
            "schedulers": [None if item.scheduler is None else item.scheduler.state_dict()
                           for item in self.items],
        }

    def load_state_dict(self, state: dict, load_optimizer=None) -> None:
        """Restore `state_dict()` output; the number of optimizers must match. `load_optimizer(opt, state)`
        loads one optimizer's state (default `opt.load_state_dict(state)`)."""
        opts, scheds = state["optimizers"], state["schedulers"]
        if len(opts) != len(self.items):
            raise ConfigError(f"checkpoint has {len(opts)} optimizer states but the trainer has"
                              f" {len(self.items)}")
        load = load_optimizer or (lambda opt, saved: opt.load_state_dict(saved))
        for item, o, s in zip(self.items, opts, scheds):
            load(item.opt, o)
            if item.scheduler is not None and s is not None:
                item.scheduler.load_state_dict(s)
