"""What a run reports to a tracker and where on the tracker's step axis: one definition that every
tracker callback reads (`LogCallback` for TensorBoard, `MLflowCallback` for MLflow), so that each gets the
same numbers at the same steps.

- `epoch_scalars`: an epoch's `<metric>/train` and `<metric>/val` values and the learning rates the epoch
  used (`lr`, or `lr/lr_<opt>_<group>` with several optimizers or parameter groups).
- `stage_scalars`: a stage's `<metric>/<stage>` values (a test's `<metric>/test`, a validation point's
  `<metric>/val`).
- `step_source(trainer)`: the step axis, one per clock. A fit by epochs (`EpochClock`): an epoch's records
  at its 1-based number, a test's at the count of completed epochs. A fit by updates (`UpdateClock`:
  `Trainer(max_updates=N)` or `fit(val_every_n_updates=M)`): every scalar at an update count, an epoch's
  records at the count its end reached, a validation point's at its own, a test's at the run's count.
  Also when a record is committed (a rollback can no longer discard it: a tracker that must never hold
  discarded work sends a record only then).
- `history_scalars(trainer)`: the metric records the run's history holds, each at its step: what a
  resumed job hands its tracker again, since the job it continues may have ended (SIGKILL) after a record
  committed and before it reached the tracker.
- `profile_scalars`: with a `ProfileCallback` attached, at a validation point of the update clock, the share of
  each cost category in the time since the previous point (`profile/<category>`).
- `watch_update_rates`: the learning rate of every applied update of each optimizer with a step-wise
  scheduler (`lr/update`, or `lr/lr_<opt>_<group>_update`), at that scheduler's count of updates.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from deepepochs.config import VAL_POINT_KEY

__all__ = ["EpochClock", "UpdateClock", "epoch_scalars", "history_scalars", "lr_tag", "profile_scalars",
           "stage_scalars", "step_source", "test_scalars", "watch_update_rates"]


def lr_tag(name: str) -> str:
    """The tag of a learning rate named by `Optimizers.lrs()`: `lr` alone, else under the `lr/` section."""
    return name if name == "lr" else f"lr/{name}"


def stage_scalars(stage: str, metrics: Mapping) -> dict[str, float]:
    """`{tag: value}` of a stage's metrics (`<metric>/<stage>`)."""
    return {f"{name}/{stage}": float(value) for name, value in metrics.items()}


def profile_scalars(trainer, step: int) -> dict[str, float]:
    """`{'profile/<category>': share}` of the time since the previous validation point (or the fit's start)
    up to the one at update `step`, when a profiler (`ProfileCallback`) is attached; else `{}`. Every tracker
    asking at one point gets the same numbers."""
    profiler = next((cb for cb in trainer.callbacks if callable(getattr(cb, "interval_shares", None))), None)
    if profiler is None:
        return {}
    return {f"profile/{category}": share for category, share in profiler.interval_shares(step).items()}


def epoch_scalars(train_metrics: Mapping, val_metrics: Mapping, lrs: Mapping) -> dict[str, float]:
    """`{tag: value}` of an epoch's end: its training and validation metrics, then its learning rates."""
    out = {**stage_scalars("train", train_metrics), **stage_scalars("val", val_metrics)}
    for name, lr in lrs.items():
        out[lr_tag(name)] = float(lr)
    return out


def test_scalars(metrics: Mapping) -> dict[str, float]:
    """`{tag: value}` of a test's metrics (`<metric>/test`)."""
    return stage_scalars("test", metrics)


class EpochClock:
    """The step axis of a fit by epochs: an epoch's records sit at its 1-based number (the console's
    `E 1/5`), a test's at the number of completed epochs (0 before any). Per-update learning rates
    (`watch_update_rates`) sit at their update counts, an axis of their own (`lr/update`)."""

    #: Whether every scalar sits at an update count (`UpdateClock`).
    by_updates = False

    def epoch_step(self, trainer, epoch_idx: int) -> int:
        """The step of the records of the epoch `epoch_idx` (0-based, as hooks receive it), read at its end."""
        return epoch_idx + 1

    def test_step(self, trainer) -> int:
        """The step of a test's records."""
        return trainer.loop.completed_epochs

    def val_point_step(self, trainer) -> int | None:
        """In a validation stage: the step of its records when it is a validation point of the update
        clock (its update count), else None (an epoch's end validates; its records are the epoch's)."""
        return trainer.loop.run.updates if trainer.loop.val_point_open else None

    @staticmethod
    def epoch_committed(epoch_idx: int) -> Callable:
        """`committed(trainer, step)` of the epoch `epoch_idx`'s records: whether its end committed (its
        `commit_epoch` ran; an epoch end that a rollback undid counts as not completed again)."""
        return lambda trainer, _step: epoch_idx < trainer.loop.completed_epochs

    def val_point_committed(self, trainer, step: int) -> bool:
        """Whether the validation point at `step` committed: its row is in the run's validation records
        (`commit_val_point` writes it; a rollback before that, or a resume from a snapshot taken before it,
        leaves it out)."""
        return step in trainer.history.get("val", {}).get(VAL_POINT_KEY, ())


class UpdateClock(EpochClock):
    """The step axis of a fit by updates (`Trainer(max_updates=N)` or `fit(val_every_n_updates=M)`): every
    scalar sits at an update count, the console's `U 500/1001`: an epoch's records (its training metrics
    and learning rates) at the count its end reached, a validation point's at its own, a test's at the
    run's count, so one chart never mixes two axes."""

    by_updates = True

    def epoch_step(self, trainer, epoch_idx: int) -> int:
        return trainer.loop.run.updates

    def test_step(self, trainer) -> int:
        return trainer.loop.run.updates


_EPOCHS = EpochClock()
_UPDATES = UpdateClock()


def step_source(trainer) -> EpochClock:
    """The step axis of `trainer`'s records (see the module docstring): the update clock's when the last
    fit counted updates."""
    loop = trainer.loop
    if getattr(loop, "target_updates", None) is not None or getattr(loop, "val_every", None) is not None:
        return _UPDATES
    return _EPOCHS


def history_scalars(trainer) -> list[tuple[int, dict[str, float]]]:
    """`(step, {tag: value})` of every epoch and validation point the run's history holds (committed
    records only: the history is the run's committed records), at the steps their hooks log them.

    Learning rates are not in the history, so they are not among these; nor, under the update clock, an
    epoch's records (the history does not hold the update count its end reached). An epoch's validation
    metrics are only when every epoch has them (with `fit(val_freq=k)` the history does not say which
    epochs validated)."""
    clock, history = step_source(trainer), trainer.history
    train, val = history.get("train", {}), dict(history.get("val", {}))
    points = val.pop(VAL_POINT_KEY, None)
    epochs = 0 if clock.by_updates else max((len(values) for values in train.values()), default=0)
    per_epoch_val = points is None and all(len(values) == epochs for values in val.values())
    out = []
    for index in range(epochs):
        train_metrics = {name: values[index] for name, values in train.items()}
        val_metrics = {name: values[index] for name, values in val.items()} if per_epoch_val else {}
        out.append((clock.epoch_step(trainer, index), epoch_scalars(train_metrics, val_metrics, {})))
    for index, step in enumerate(points or ()):
        metrics = {name: values[index] for name, values in val.items() if index < len(values)}
        out.append((int(step), stage_scalars("val", metrics)))
    return out


#: `sink(step, {tag: rate}, scheduler)` of `watch_update_rates`.
RateSink = Callable[[int, dict, object], None]


def watch_update_rates(trainer, sink: RateSink) -> list:
    """Hand `sink` the learning rates of every applied update of each optimizer with a step-wise scheduler
    (`sched_on='step'`), on the main process; returns the hook handles (`handle.remove()` stops it).

    An optimizer step pre-hook (no per-batch callback hook, so training keeps its fused path) reads the
    rates just before `step()` applies them, i.e. those the update uses; the scheduler steps after it.
    The step is that optimizer's updates so far (its scheduler's count, so a resumed run continues the
    curve): the update is committed once the scheduler's count reaches it (`step <= scheduler.last_epoch`).
    The GradScaler does not call `step()` for a skipped update, so none is handed for it; nor for a step
    outside this trainer's training stage."""
    if not trainer.is_main_process:
        return []
    opts, loop = trainer.opt, trainer.loop
    single = len(opts) == 1 and len(opts[0].opt.param_groups) == 1
    handles = []
    for index, item in enumerate(opts):
        scheduler = opts.step_scheduler(index)
        if scheduler is None:
            continue
        tags = ["lr/update" if single else f"lr/lr_{index}_{j}_update" for j in range(len(item.opt.param_groups))]

        def pre_step(optimizer, _args, _kwargs, tags=tags, scheduler=scheduler):
            if loop.stage != "train":  # a step outside this trainer's training is not its update
                return
            rates = {tag: float(group["lr"]) for tag, group in zip(tags, optimizer.param_groups)}
            sink(int(scheduler.last_epoch) + 1, rates, scheduler)

        handles.append(item.opt.register_step_pre_hook(pre_step))
    return handles
