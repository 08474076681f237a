"""Weight averaging: `EMACallback` (an exponential moving average of the weights) and `SWACallback`
(stochastic weight averaging), both built on torch's `torch.optim.swa_utils`.

The arithmetic is torch's: the averaged module is a `torch.optim.swa_utils.AveragedModel` (the callback's
`averaged` attribute), moved by its `update_parameters`, with `get_ema_multi_avg_fn` for the EMA, `SWALR`
for SWA's learning rates and `update_bn` for SWA's BatchNorm statistics. What deepepochs adds is when the
average moves: the engine calls `average_weights` at commit points only (the spec's `average_update`
action as an update commits, `average_epoch` at an epoch's end before its checkpoints are written), so
an update skipped for inf/NaN or a window a fault, Ctrl-C or preemption discarded never reaches it.

Where the average lives: its tensors are the run state's (`RunState.averages[average_id]` holds the
averaged module's `state_dict()`, whose tensors are the module's own, and its counters), so a rollback,
`find_lr`, a failed checkpoint load and an epoch's end that does not commit put it back with the rest of
the run, and every checkpoint and snapshot holds it under the `averages` key.

Under `strategy='fsdp'` the average is sharded like the parameters: `AveragedModel` is made over a module
tree mirroring the model's (`_mirror`) whose tensors are the model's own, so its deep copy holds DTensors
with the parameters' placements, each rank storing its shard only. torch's `update_parameters` then
moves them with the model's sharded parameters (elementwise DTensor arithmetic on each rank's shard, no
collective), and the sharded checkpoint writes them as it writes the model's DTensors: each rank its
shards, read back at any world size, `consolidate` assembling full tensors. The mirror has no `forward`:
evaluate the average with `evaluate=True` or `applied()`, which load its shards into the model's.
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings

import torch
from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn

from deepepochs.callbacks import bn_pass
from deepepochs.callbacks.base import Callback
from deepepochs.config import check_choice
from deepepochs.errors import ConfigError, DeepEpochsWarning

__all__ = ["EMACallback", "SWACallback"]


def _number(name: str, value, low: float, high: float, hint: str) -> float:
    """`value` as a float strictly between `low` and `high`, else a `ConfigError` naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low < value < high:
        raise ConfigError(f"{name} must be a number in ({low:g}, {high:g}){hint} (got {value!r})")
    return float(value)


def _flag(name: str, value) -> bool:
    """`value` if it is True or False, else a `ConfigError` naming `name`."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False (got {value!r})")
    return value


def _mirror(model: torch.nn.Module) -> torch.nn.Module:
    """Bare modules arranged as `model`'s submodules, holding `model`'s parameters (detached, as parameters)
    and buffers under the same names, in the same order: what `AveragedModel` may deep-copy when `model`
    itself refuses it (an FSDP2 `fully_shard` module), with `state_dict()` keys equal to `model`'s."""
    made, mirrored = {"": torch.nn.Module()}, {}
    for name, module in model.named_modules():
        if name:
            parent, _, leaf = name.rpartition(".")
            made[name] = torch.nn.Module()
            made[parent].add_module(leaf, made[name])
        for key, param in module.named_parameters(recurse=False):
            if id(param) not in mirrored:  # a tied parameter stays one, as `parameters()` lists it once
                mirrored[id(param)] = torch.nn.Parameter(param.detach(), requires_grad=False)
            made[name].register_parameter(key, mirrored[id(param)])
        for key, buffer in module.named_buffers(recurse=False):
            made[name].register_buffer(key, buffer.detach(),
                                       persistent=key not in module._non_persistent_buffers_set)  # noqa: SLF001
    return made[""]


def _count(name: str, value, low: int, meaning: str) -> int:
    """`value` if it is an int >= `low`, else a `ConfigError` naming `name` and what it means."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an int >= {low}{meaning} (got {value!r})")
    return value


class _WeightAverage(Callback):
    """What both averages share: the `AveragedModel`, its place in the run state, and evaluation with it."""

    average_id = ""

    def __init__(self, buffers: str, evaluate: bool):
        check_choice(f"{type(self).__name__} buffers", buffers, ("average", "copy"),
                     "'average' averages BatchNorm statistics like the weights, 'copy' takes the model's")
        self.buffers = buffers
        self.evaluate = _flag(f"{type(self).__name__} evaluate", evaluate)
        #: The averaged module: a `torch.optim.swa_utils.AveragedModel` (made when the callback is attached).
        self.averaged: AveragedModel | None = None
        self._state: dict | None = None
        self._backup = None

    def _make(self, model: torch.nn.Module) -> AveragedModel:
        raise NotImplementedError

    def _check_sharded(self, model: torch.nn.Module) -> None:
        """Refuse what cannot run on a sharded model (nothing, unless a subclass says so)."""

    def on_attach(self, trainer) -> None:
        """Make the averaged module from the trainer's model and put its state in the run state."""
        name = type(self).__name__
        model = trainer.raw_model
        if next(iter(model.parameters()), None) is None:
            raise ConfigError(f"{name} needs a model with parameters to average (got a"
                              f" {type(model).__name__} without any)")
        if trainer.dist.shards_model:
            self._check_sharded(model)
        same = [cb for cb in trainer.callbacks if getattr(cb, "average_id", None) == self.average_id]
        if len(same) > 1:
            raise ConfigError(f"two {name}s are attached (average_id {self.average_id!r}); keep one, or give"
                              " the second another average_id")
        self.averaged = self._make(_mirror(model) if trainer.dist.shards_model else model)
        self._state = None
        self._registered(trainer)

    def _registered(self, trainer) -> dict:
        """This average's entry of the run state (its tensors the averaged module's own), registered again
        when the run state lost it (a restore of a state captured before the callback was attached)."""
        run = trainer.loop.run
        if run.averages is None:
            run.averages = {}
        state = run.averages.get(self.average_id)
        if state is None or state is not self._state:
            if self._state is None:
                self._state = {"model": self.averaged.state_dict(), "updates": 0, "epochs": 0}
            run.averages[self.average_id] = self._state
        return self._state

    @property
    def updates(self) -> int:
        """How many times the average was moved (committed updates for the EMA, epochs for SWA)."""
        return 0 if self._state is None else self._state["updates"]

    def on_before_fit(self, trainer, epochs):
        self._registered(trainer)

    # ---- evaluation with the average ----
    def _swap_in(self, trainer) -> None:
        if not self.evaluate or self.updates == 0 or self._backup is not None:
            return
        model = trainer.raw_model
        self._backup = {k: v.detach().clone() for k, v in model.state_dict().items()}
        trainer.dist.load_model_state_dict(model, self.averaged.module.state_dict())

    def _swap_out(self, trainer) -> None:
        backup, self._backup = self._backup, None
        if backup is not None:
            trainer.dist.load_model_state_dict(trainer.raw_model, backup)

    @contextlib.contextmanager
    def applied(self, trainer):
        """Inside, the trainer's model holds the average's weights (and buffers); on leaving, also by an
        error, its own come back. For what runs no hooks, such as `predict()`:
        `with ema.applied(trainer): preds = trainer.predict(dl)`."""
        if self.updates == 0:
            raise ConfigError(f"{type(self).__name__}.applied() needs an average, but none was taken yet (got"
                              " 0 updates); fit first")
        model = trainer.raw_model
        backup = {k: v.detach().clone() for k, v in model.state_dict().items()}
        trainer.dist.load_model_state_dict(model, self.averaged.module.state_dict())  # under FSDP: the shards
        try:
            yield trainer
        finally:
            trainer.dist.load_model_state_dict(model, backup)

    def on_before_val_epochs(self, trainer, tasks, epoch_idx):
        """Validate the average (`evaluate=True`): its weights go into the model until validation ends."""
        self._swap_in(trainer)

    def on_after_val_epochs(self, trainer, tasks, metrics, epoch_idx):
        self._swap_out(trainer)

    def on_before_test_epochs(self, trainer, tasks):
        """Test the average (`evaluate=True`); the model gets its own weights back afterwards."""
        self._swap_in(trainer)

    def on_after_test_epochs(self, trainer, tasks, metrics):
        self._swap_out(trainer)

    def on_interrupted(self, trainer, exception):
        """A failed validation or test must not leave the average's weights in the model."""
        self._swap_out(trainer)


def _copy(averaged: list, current: list, _n_averaged) -> None:
    """A `multi_avg_fn` that makes the average a plain copy of the weights (ema_pytorch's and timm's updates
    before their `update_after_step`)."""
    torch._foreach_copy_(averaged, current)  # noqa: SLF001 (torch's public-in-practice foreach copy)


class EMACallback(_WeightAverage):
    """An exponential moving average of the model's weights, moved by committed updates.

    Args:
        decay: the weight of the old average at each update, in (0, 1); 0.999 when neither `decay` nor
            `half_life` is given. With `power` it is the decay's ceiling (ema_pytorch's `beta`).
        half_life: instead of `decay`, the number of updates after which an update's weight in the average
            has halved (`decay = 0.5 ** (1 / half_life)`).
        warmup: ramp the decay up over the first updates as `min(decay, (1 + n) / (10 + n))` after `n`
            updates (the warm-up of TensorFlow's EMA), so early weights fade fast.
        update_every: move the average at every `update_every`-th committed update only (after 0,
            `update_every`, `2 * update_every`, ... earlier ones), as ema_pytorch's `update_every`.
        start_update: while at most `start_update` committed updates came before, the average is a plain
            copy of the weights (ema_pytorch's and timm's `update_after_step`); 0 copies the first update only.
        power: the power warm-up of ema_pytorch and timm's `ModelEmaV3(use_warmup=True)`: after `n` earlier
            updates the decay is `1 - (1 + (n - start_update) / inv_gamma) ** -power`, clamped to
            `[min_decay, decay]`.
        inv_gamma: the warm-up's `inv_gamma` (timm's `warmup_gamma`), > 0.
        min_decay: the warm-up's floor (ema_pytorch's `min_value`), in [0, decay].
        decay_dtype: the dtype the warm-up's decay is computed in: torch.float64 (Python's floats, as timm
            computes it) or torch.float32 (as ema_pytorch computes it, on its step tensor).
        buffers: 'average' (BatchNorm statistics and other buffers averaged like the weights, torch's
            `use_buffers=True`) or 'copy' (the model's buffers copied after each update).
        evaluate: validation and `test()` evaluate the average; the model gets its training weights back
            afterwards.

    The average is `callback.averaged`, a `torch.optim.swa_utils.AveragedModel` (its `.module` is a copy
    of the model); torch's `update_parameters` with `get_ema_multi_avg_fn(decay)` moves it, so the first
    update copies the weights and each later one takes `decay * average + (1 - decay) * weights`. An update
    skipped for inf/NaN, or discarded by a rollback, never moves it; checkpoints and snapshots hold it.

    ema_pytorch's `EMA(model, beta=B, update_after_step=A, update_every=E, inv_gamma=G, power=P,
    min_value=M)`, its `update()` called after each optimizer step, is `EMACallback(B, update_every=E,
    start_update=A, power=P, inv_gamma=G, min_decay=M, decay_dtype=torch.float32)`; timm's
    `ModelEmaV3(model, decay=D, min_decay=M, update_after_step=A, use_warmup=True, warmup_gamma=G,
    warmup_power=P)` updated with `step=num_updates` is `EMACallback(D, start_update=A, power=P,
    inv_gamma=G, min_decay=M)`.

    Example:
        >>> ema = EMACallback(decay=0.999, evaluate=True)
        >>> trainer = Trainer(model, F.cross_entropy, opt, epochs=10, callbacks=[ema])
        >>> trainer.fit(train_dl, val_dl)  # validation metrics are the average's
        >>> ema.averaged.module  # the averaged model
    """

    average_id = "ema"

    def __init__(self, decay: float | None = None, *, half_life: float | None = None, warmup: bool = False,
                 update_every: int = 1, start_update: int = 0, power: float | None = None,
                 inv_gamma: float = 1.0, min_decay: float = 0.0, decay_dtype: torch.dtype = torch.float64,
                 buffers: str = "average", evaluate: bool = False):
        if decay is not None and half_life is not None:
            raise ConfigError(f"EMACallback takes decay or half_life, not both (got decay={decay!r},"
                              f" half_life={half_life!r}); half_life h means decay = 0.5 ** (1 / h)")
        if half_life is not None:
            h = _number("EMACallback half_life", half_life, 0, math.inf, " (updates)")
            decay = 0.5 ** (1.0 / h)
        self.decay = _number("EMACallback decay", 0.999 if decay is None else decay, 0, 1,
                             ", e.g. 0.999")
        self.warmup = _flag("EMACallback warmup", warmup)
        self.update_every = _count("EMACallback update_every", update_every, 1, ", the updates between moves")
        self.start_update = _count("EMACallback start_update", start_update, 0,
                                   ", the updates the average copies the weights for")
        if power is not None:
            _number("EMACallback power", power, 0, math.inf, ", e.g. 2/3")
            if warmup:
                raise ConfigError("EMACallback takes warmup=True or power, not both (got power="
                                  f"{power!r}); power is ema_pytorch's and timm's warm-up, warmup TensorFlow's")
        self.power = power
        self.inv_gamma = _number("EMACallback inv_gamma", inv_gamma, 0, math.inf, ", e.g. 1.0")
        if isinstance(min_decay, bool) or not isinstance(min_decay, (int, float)) or not 0 <= min_decay <= self.decay:
            raise ConfigError(f"EMACallback min_decay must be a number in [0, decay={self.decay:g}] (got"
                              f" {min_decay!r})")
        self.min_decay = float(min_decay)
        if decay_dtype not in (torch.float32, torch.float64):
            raise ConfigError("EMACallback decay_dtype must be torch.float32 (ema_pytorch's) or torch.float64"
                              f" (timm's) (got {decay_dtype!r})")
        self.decay_dtype = decay_dtype
        super().__init__(buffers, evaluate)

    def __repr__(self) -> str:
        schedule = "" if self.update_every == 1 else f", update_every={self.update_every}"
        schedule += "" if self.start_update == 0 else f", start_update={self.start_update}"
        if self.power is not None:
            schedule += (f", power={self.power!r}, inv_gamma={self.inv_gamma!r}, min_decay={self.min_decay!r},"
                         f" decay_dtype={self.decay_dtype}")
        return f"EMACallback(decay={self.decay!r}, warmup={self.warmup}{schedule}, buffers={self.buffers!r})"

    def _make(self, model):
        self._steady = get_ema_multi_avg_fn(self.decay)  # the constant decay's update, made once
        return AveragedModel(model, multi_avg_fn=self._steady, use_buffers=self.buffers == "average")

    def decay_at(self, updates: int) -> float:
        """The decay of the update that follows `updates` committed ones, past `start_update`: `decay`, or
        the power warm-up's clamped to `[min_decay, decay]` (op for op as ema_pytorch computes it in
        float32 and timm in float64), then TensorFlow's `(1 + n) / (10 + n)` ceiling with `warmup`."""
        decay = self.decay
        if self.power is not None:
            steps = updates - self.start_update
            if self.decay_dtype == torch.float32:  # ema_pytorch's arithmetic: on its step tensor, in float32
                steps = torch.tensor(steps, dtype=torch.float32)
            # timm's in Python floats (torch's float64 division by a number multiplies by its reciprocal)
            decay = 1 - (1 + steps / self.inv_gamma) ** -self.power
            decay = torch.as_tensor(decay, dtype=self.decay_dtype).clamp(self.min_decay, self.decay).item()
        if self.warmup:
            decay = min(decay, (1 + updates) / (10 + updates))
        return decay

    def _update_fn(self, n: int):
        """The `multi_avg_fn` of the update after `n` committed ones: a copy up to `start_update`, then the
        constant decay's (made once) or, with a warm-up, one made for `decay_at(n)`."""
        if n <= self.start_update:
            return _copy
        if self.power is None and not self.warmup:
            return self._steady
        return get_ema_multi_avg_fn(self.decay_at(n))

    def average_weights(self, trainer, at: str) -> None:
        """Called by the engine as an update commits (`at='update'`): at every `update_every`-th one the
        average takes the model's weights, copied up to `start_update`, at `decay_at` after."""
        if at != "update":
            return
        state = self._registered(trainer)
        n = state["updates"]
        if n % self.update_every == 0:
            averaged = self.averaged
            fn = self._update_fn(n)
            if fn is not averaged.multi_avg_fn:  # nn.Module's setattr is not free: only when the rule changes
                averaged.multi_avg_fn = fn
            averaged.update_parameters(trainer.raw_model)
        state["updates"] = n + 1


class SWACallback(_WeightAverage):
    """Stochastic weight averaging: the equal-weight average of the model's weights at the end of each
    epoch from `start_epoch` on (or after each committed update from `start_update` on), with torch's
    `SWALR` learning-rate schedule and `update_bn` at the fit's end.

    Args:
        start_epoch: the first epoch (1-based) whose end is averaged; it must lie within the fit's epochs.
        swa_lr: the rate `SWALR` anneals every optimizer's groups to, over `anneal_epochs` steps from the
            first average on (one step per average: per epoch, or per update with `start_update`); None
            leaves the rates alone.
        start_update: instead of `start_epoch`, the first committed update (1-based, counted over the run as
            `max_updates` counts) whose weights are averaged; from it on every committed update is averaged
            (an update skipped for inf/NaN is not) and `SWALR` steps after each. Under
            `Trainer(max_updates=N)` it must be at most N.
        anneal_epochs: steps of the annealing (`SWALR`'s `anneal_epochs`): epochs, or updates with
            `start_update`.
        anneal_strategy: 'cos' or 'linear' (`SWALR`'s).
        buffers: 'copy' (torch's default: the model's buffers are copied, and `update_bn` recomputes the
            BatchNorm statistics at the fit's end) or 'average'.
        bn_update: run `torch.optim.swa_utils.update_bn` at the fit's end (only when the model has BatchNorm
            layers, buffers='copy' and the average has moved; not under strategy='fsdp', where a model with
            BatchNorm layers needs bn_update=False). The pass is a stage of the fit with its own commit
            point: a preemption signal during it stops the fit at the last epoch's end, and the resumed run
            recomputes the statistics exactly; it leaves every generator as it found it.
        bn_data: the data the pass reads: a re-iterable such as a DataLoader or a list of batches (a batch
            or its first element is the model's input). None: the training DataLoaders as given, which must
            have a length and draw without replacement; an endless or resampled stream, a one-shot iterator
            or data without a length is refused when the fit starts, unless `bn_batches` bounds the pass
            over a DataLoader.
        bn_batches: read at most this many batches (an int >= 1) in the pass; None: all of them.
        evaluate: validation and `test()` evaluate the average.

    The rates `SWALR` sets come after an epoch-wise scheduler's step at the epoch's end; a step-wise
    scheduler keeps changing them during the epochs that follow, so use one or the other from the start.
    """

    average_id = "swa"

    def __init__(self, start_epoch: int | None = None, swa_lr: float | None = None, *,
                 start_update: int | None = None, anneal_epochs: int = 10, anneal_strategy: str = "cos",
                 buffers: str = "copy", bn_update: bool = True, bn_data=None, bn_batches: int | None = None,
                 evaluate: bool = False):
        if (start_epoch is None) == (start_update is None):
            raise ConfigError(f"SWACallback takes start_epoch or start_update, exactly one (got start_epoch="
                              f"{start_epoch!r}, start_update={start_update!r}); start_epoch=E averages each epoch"
                              " from epoch E on, start_update=U each committed update from update U on")
        if start_epoch is not None:
            _count("SWACallback start_epoch", start_epoch, 1, ", the first epoch averaged")
        else:
            _count("SWACallback start_update", start_update, 1, ", the first committed update averaged")
        self.start_epoch, self.start_update = start_epoch, start_update
        #: When the average moves: 'epoch' (its end) or 'update' (each committed update).
        self.every = "epoch" if start_update is None else "update"
        if swa_lr is not None:
            _number("SWACallback swa_lr", swa_lr, 0, math.inf, "")
        self.swa_lr = swa_lr
        self.anneal_epochs = _count("SWACallback anneal_epochs", anneal_epochs, 0, "")
        check_choice("SWACallback anneal_strategy", anneal_strategy, ("cos", "linear"))
        self.anneal_strategy = anneal_strategy
        self.bn_update = _flag("SWACallback bn_update", bn_update)
        if bn_batches is not None:
            _count("SWACallback bn_batches", bn_batches, 1, ", the most batches the BatchNorm pass reads, or None")
        bn_pass.check_bn_data(bn_data, bn_batches)
        self.bn_data, self.bn_batches = bn_data, bn_batches
        self._bn_sources: list = []
        self._bn_model = False  # whether the model has BatchNorm layers (set when attached)
        self._schedules = None
        super().__init__(buffers, evaluate)

    def __repr__(self) -> str:
        start = (f"start_epoch={self.start_epoch}" if self.start_update is None
                 else f"start_update={self.start_update}")
        return (f"SWACallback({start}, swa_lr={self.swa_lr!r}, anneal_epochs={self.anneal_epochs},"
                f" anneal_strategy={self.anneal_strategy!r})")

    def _make(self, model):
        return AveragedModel(model, use_buffers=self.buffers == "average")

    def on_attach(self, trainer) -> None:
        super().on_attach(trainer)
        self._bn_model = bn_pass.has_batch_norm(trainer.raw_model)

    def _check_sharded(self, model):
        """`update_bn` runs the averaged module's forward, which the sharded average's mirror lacks."""
        if self.bn_update and self.buffers == "copy" and bn_pass.has_batch_norm(model):
            raise ConfigError("SWACallback bn_update=True recomputes BatchNorm statistics with the averaged"
                              " model's forward, which strategy='fsdp' does not give it (got a model with"
                              " BatchNorm layers); pass bn_update=False, or buffers='average'")

    def on_before_fit(self, trainer, epochs):
        """Refuse a start after the fit's end (its last epoch, or its update budget): nothing would be
        averaged."""
        super().on_before_fit(trainer, epochs)
        budget = trainer.loop.target_updates
        if self.start_epoch is not None and self.start_epoch > epochs:
            raise ConfigError(f"SWACallback start_epoch must be at most the fit's epochs ({epochs}), or nothing"
                              f" is averaged (got {self.start_epoch})")
        if self.start_update is not None and budget is not None and self.start_update > budget:
            raise ConfigError(f"SWACallback start_update must be at most the fit's max_updates ({budget}), or"
                              f" nothing is averaged (got {self.start_update})")

    def _schedule(self, trainer, steps: int) -> list:
        """One `SWALR` per optimizer, positioned after `steps` steps (its rate follows from the optimizer's
        current one, which checkpoints hold, and its step count, which the run state holds)."""
        if self._schedules is None or self._schedules[0] != steps:
            schedules = [SWALR(item.opt, self.swa_lr, anneal_epochs=self.anneal_epochs,
                               anneal_strategy=self.anneal_strategy) for item in trainer.opt.items]
            for schedule in schedules:
                schedule._step_count = steps + 1  # noqa: SLF001 (SWALR reads its position from this count)
                schedule.last_epoch = steps
            self._schedules = (steps, schedules)
        return self._schedules[1]

    def _due(self, trainer, at: str) -> bool:
        if at != self.every:
            return False
        if at == "epoch":
            return trainer.loop.epoch >= self.start_epoch
        return trainer.loop.run.updates >= self.start_update  # an applied update is counted as it steps

    def average_weights(self, trainer, at: str) -> None:
        """Called by the engine at an epoch's end (`at='epoch'`) and as an update commits (`at='update'`):
        from `start_epoch` (epochs) or `start_update` (updates) on the average takes the model's weights and
        `SWALR` steps."""
        if not self._due(trainer, at):
            return
        state = self._registered(trainer)
        self.averaged.update_parameters(trainer.raw_model)
        state["updates"] += 1
        if self.swa_lr is not None:
            with warnings.catch_warnings():
                # SWALR made after the optimizers' first steps says its step comes before theirs: not so here
                warnings.filterwarnings("ignore", re.escape("Detected call of `lr_scheduler.step()`"), UserWarning)
                for schedule in self._schedule(trainer, state["epochs"]):
                    schedule.step()
            state["epochs"] += 1
            self._schedules = (state["epochs"], self._schedules[1])

    # ---- the BatchNorm pass (the engine's `deepepochs.engine.statistics_pass`) ----
    def _passes(self) -> bool:
        return self.bn_update and self.buffers == "copy" and self._bn_model

    def statistics_source(self, trainer, loaders: list) -> None:
        """At the fit's start: the data the pass reads, `bn_data` or the fit's training DataLoaders `loaders`,
        which are refused (`ConfigError`) when the pass could not read them again or would not end."""
        if not self._passes():
            return
        if self.bn_data is None:
            bn_pass.refuse_training_data(loaders, self.bn_batches)
        self._bn_sources = [self.bn_data] if self.bn_data is not None else list(loaders)

    def statistics_due(self, trainer) -> bool:
        """Whether the pass runs at this fit's end: the average moved (in this fit or before it)."""
        return self._passes() and self.updates > 0 and bool(self._bn_sources)

    def recompute_statistics(self, trainer, read) -> None:
        """Recompute the average's BatchNorm statistics (torch's `update_bn`) over the pass's data, each batch
        fetched through `read`, leaving every generator as it was; under DDP every rank then takes rank 0's
        statistics (one broadcast: the ranks' orders, and so the float sums, may differ)."""
        bn_pass.recompute(self.averaged, self._bn_sources, self.bn_batches, read, trainer.device)
        if trainer.world_size > 1:
            trainer.dist.broadcast_model(self.averaged)

    def on_after_fit(self, trainer):
        """Warn of a fit that ended before the start (its total was not known in advance: by epochs, or
        stopped early): nothing was averaged. (The BatchNorm pass ran before, as a stage of the fit.)"""
        if self.updates == 0:
            start = (f"start_epoch={self.start_epoch}" if self.start_update is None
                     else f"start_update={self.start_update}")
            warnings.warn(f"SWACallback averaged nothing: the fit ended at epoch {trainer.loop.epoch}, update"
                          f" {trainer.loop.run.updates}, before {start}; evaluate=True validated and tested the"
                          " model itself and applied() refuses. Start earlier or train longer",
                          DeepEpochsWarning, stacklevel=2)
