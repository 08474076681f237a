"""What a run reports to a tracker and where on the tracker's step axis: one definition that every
tracker callback reads (`LogCallback` for TensorBoard, `MLflowCallback` for MLflow), so that each gets the
same numbers at the same steps.

- `epoch_scalars`: an epoch's `<metric>/train` and `<metric>/val` values and the learning rates the epoch
  used (`lr`, or `lr/lr_<opt>_<group>` with several optimizers or parameter groups).
- `test_scalars`: a test's `<metric>/test` values.
- `step_source(trainer)`: the step axis (`EpochClock`: an epoch's records at its 1-based number, a test's at
  the count of completed epochs), and when a record at a step is committed (a rollback can no longer
  discard it). A trainer that validates at other points than epochs' ends gets another clock here, with
  the same three methods; the callbacks need no change.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["EpochClock", "epoch_scalars", "lr_tag", "step_source", "test_scalars"]


def lr_tag(name: str) -> str:
    """The tag of a learning rate named by `Optimizers.lrs()`: `lr` alone, else under the `lr/` section."""
    return name if name == "lr" else f"lr/{name}"


def epoch_scalars(train_metrics: Mapping, val_metrics: Mapping, lrs: Mapping) -> dict[str, float]:
    """`{tag: value}` of an epoch's end: its training and validation metrics, then its learning rates."""
    out = {}
    for stage, metrics in (("train", train_metrics), ("val", val_metrics)):
        for name, value in metrics.items():
            out[f"{name}/{stage}"] = float(value)
    for name, lr in lrs.items():
        out[lr_tag(name)] = float(lr)
    return out


def test_scalars(metrics: Mapping) -> dict[str, float]:
    """`{tag: value}` of a test's metrics (`<metric>/test`)."""
    return {f"{name}/test": float(value) for name, value in metrics.items()}


class EpochClock:
    """The step axis of a run validated at epochs' ends: an epoch's records sit at its 1-based number (the
    console's `E 1/5`), a test's at the number of completed epochs (0 before any)."""

    def epoch_step(self, trainer, epoch_idx: int) -> int:
        """The step of the records of the epoch `epoch_idx` (0-based, as hooks receive it)."""
        return epoch_idx + 1

    def test_step(self, trainer) -> int:
        """The step of a test's records."""
        return trainer.loop.completed_epochs

    def committed(self, trainer, step: int) -> bool:
        """Whether the records at `step` belong to committed work: an epoch whose end committed (its
        `commit_epoch` ran; an epoch end that a rollback undid counts as not completed again)."""
        return step <= trainer.loop.completed_epochs


_EPOCHS = EpochClock()


def step_source(trainer) -> EpochClock:
    """The step axis of `trainer`'s records (see the module docstring)."""
    return _EPOCHS
