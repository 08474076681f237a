"""`CheckCallback`: monitor a metric, save best or latest checkpoints, stop early.

The callback only decides; the machine does the rest. At each epoch's end (`on_after_epoch`) it reads
the monitored global metric, updates its best value and patience counter, and calls
`trainer.request_save(...)` and/or `trainer.request_stop(...)`. The spec's `end_epoch` edge then writes
the requested files (`save_checkpoints`, after epoch-wise schedulers stepped, so the file resumes the
schedule exactly) and `next_epoch` takes the `stop_requested` edge. A stop requested in the same epoch
therefore still gets that epoch's checkpoint. The file format is in `deepepochs.checkpoint`.
"""

from __future__ import annotations

import copy
import math
import os
import re
from pathlib import Path

import torch

from deepepochs import checkpoint
from deepepochs.callbacks.base import Callback
from deepepochs.checkpoint import background, finished
from deepepochs.compat import tell_once, told
from deepepochs.config import check_choice
from deepepochs.engine.update_clock import counts_updates
from deepepochs.errors import ConfigError

__all__ = ["CheckCallback"]

_UNSAFE = re.compile(r"[^A-Za-z0-9_.=+-]")


class CheckCallback(Callback):
    """Save the best (or latest) checkpoint by a monitored metric and stop after `patience` bad epochs.

    Args:
        monitor: metric name as it appears in the stage's metrics, e.g. 'loss' or 'accuracy'.
        on_stage: 'val' (the validation metrics) or 'train'.
        mode: 'min' (lower is better) or 'max'.
        patience: stop the fit after this many checks in a row without improvement; 0 never stops. A check
            is an epoch's end, or with `fit(val_every_n_updates=M)` and `on_stage='val'` a validation point
            (the fit then stops at that point).
        save_best: True keeps the snapshot of the best epoch (for evaluation; `test` uses it); False
            keeps the latest epoch's snapshot (for resuming). Either resumes exactly: with
            `fit(val_every_n_updates=M)` the file is of a validation point and records its position inside
            the epoch, so the resume continues at the next update (`checkpoint.save` takes it there).
        ckpt_dir: root folder; files go to `<ckpt_dir>/<running_id>/<on_stage>-<monitor>.<best|latest>.ckpt`.
        async_write: write the files beside training, as `SnapshotCallback(async_write=True)` does: the loop
            waits for a host copy of the state, a background thread writes the file (complete or absent); the
            fit's end, an interruption, `test()` and `close()` wait for it, and a failed write is one warning at
            the next save. Not under `strategy='fsdp'`.

    Each file holds the full training state and the state of every `CheckCallback` of the trainer.
    Under DDP the metric is global, every rank takes the same decisions, and only rank 0 writes; under
    FSDP the file is a sharded checkpoint folder of that name, every rank writing its shards (see
    `deepepochs.checkpoint`).
    Epochs where the stage did not run (e.g. `val_freq` > 1) are not checks. During `test`, the first
    `CheckCallback` (in declaration order) with a saved file supplies the weights; the model gets its
    pre-test weights back afterwards, also when the test fails.

    Example:
        >>> checker = CheckCallback('loss', on_stage='val', mode='min', patience=5)
        >>> trainer = Trainer(model, F.cross_entropy, opt, epochs=50, callbacks=[checker], resume=True)
        >>> trainer.fit(train_dl, val_dl)
        >>> trainer.test(test_dl)  # evaluates the best validation-loss epoch's weights
    """

    def __init__(self, monitor: str, on_stage: str = "val", mode: str = "min", patience: int = 0,
                 save_best: bool = True, ckpt_dir="./checkpoints", async_write: bool = False):
        if not isinstance(monitor, str) or not monitor:
            raise ConfigError(f"CheckCallback monitor must be a non-empty metric name string, e.g. 'loss'"
                              f" (got {monitor!r})")
        check_choice("CheckCallback on_stage", on_stage, ("val", "train"))
        check_choice("CheckCallback mode", mode, ("min", "max"),
                     "'min' when lower is better (losses), 'max' when higher is better (accuracy)")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 0:
            raise ConfigError(f"CheckCallback patience must be an int >= 0, 0 turning early stopping off"
                              f" (got {patience!r})")
        if not isinstance(save_best, bool):
            raise ConfigError(f"CheckCallback save_best must be True or False (got {save_best!r})")
        if not isinstance(async_write, bool):
            raise ConfigError(f"CheckCallback async_write must be True or False (got {async_write!r})")
        if not isinstance(ckpt_dir, (str, os.PathLike)):
            raise ConfigError(f"CheckCallback ckpt_dir must be a path (str or os.PathLike)"
                              f" (got {type(ckpt_dir).__name__})")
        self.monitor = monitor
        self.on_stage = on_stage
        self.mode = mode
        self.patience = patience
        self.save_best = save_best
        self.ckpt_dir = Path(ckpt_dir)
        self._writer = background.BackgroundWriter(checkpoint.write_atomic) if async_write else None
        kind = "best" if save_best else "latest"
        #: Stable key of this monitor inside checkpoints; also names its file.
        self.monitor_id = f"{on_stage}-{monitor}.{kind}"
        self.file_name = _UNSAFE.sub("_", self.monitor_id) + checkpoint.SUFFIX
        self._reset()
        self._test_backup = None
        self._averages_backup = None  # the weight averages before test() loaded a file's

    def _reset(self) -> None:
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.bad_epochs = 0
        self.last: float | None = None
        self.saved_epoch: int | None = None

    def __repr__(self) -> str:
        return (f"CheckCallback({self.monitor!r}, on_stage={self.on_stage!r}, mode={self.mode!r},"
                f" patience={self.patience}, save_best={self.save_best}, ckpt_dir={str(self.ckpt_dir)!r}"
                + (", async_write=True)" if self._writer is not None else ")"))

    def _finish_writes(self) -> None:
        """Wait for the background write in flight, if any (bounded), and report a failed one."""
        if self._writer is not None:
            self._writer.finish("CheckCallback")

    # ---- files and state ----
    def path(self, trainer) -> Path:
        """This monitor's file for the trainer's current run."""
        return self.ckpt_dir / str(trainer.running_id) / self.file_name

    def state_dict(self) -> dict:
        """The monitor's state as stored in every checkpoint (numbers, strings and None only)."""
        return {"monitor": self.monitor, "on_stage": self.on_stage, "mode": self.mode,
                "save_best": self.save_best, "best": self.best, "best_epoch": self.best_epoch,
                "bad_epochs": self.bad_epochs, "last": self.last, "saved_epoch": self.saved_epoch}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output; a state recorded with another `mode` is ignored (its best
        value would compare the wrong way)."""
        if state.get("mode", self.mode) != self.mode:
            return
        self.best = state.get("best")
        self.best_epoch = state.get("best_epoch")
        self.bad_epochs = int(state.get("bad_epochs", 0))
        self.last = state.get("last")
        self.saved_epoch = state.get("saved_epoch")

    # ---- hooks ----
    def on_attach(self, trainer) -> None:
        """Refuse two monitors with the same id: they would overwrite each other's file and state."""
        background.check_attached("CheckCallback", self._writer, trainer)
        same = [m for m in checkpoint.monitors_of(trainer) if m.monitor_id == self.monitor_id]
        if len(same) > 1:
            raise ConfigError(f"two CheckCallbacks monitor {self.monitor_id!r} ({same[0]!r} and {same[1]!r});"
                              " they would write the same file: keep one of them")

    def on_before_epoch(self, trainer, train_tasks, val_tasks, epoch_idx):
        """Refuse on_stage='val' without validation data before the epoch trains, not after it."""
        self._check_val_data(val_tasks)

    def check_names(self, stages) -> None:
        """Called by the loop at the fit's first training batch, before the first update, with the metric
        names each stage will report as far as that batch tells (`{stage: names}`; a stage it cannot tell,
        e.g. with a custom step, is left out and checked at the epoch's end)."""
        names = stages.get(self.on_stage)
        if names is not None and self.monitor not in names:
            raise self._unknown_monitor(names)

    def _unknown_monitor(self, names) -> ConfigError:
        listed = ", ".join(repr(n) for n in names) or "none"
        return ConfigError(f"CheckCallback monitor must name a {self.on_stage} metric: one of {listed}"
                           f" (got {self.monitor!r})")

    def _check_val_data(self, val_tasks) -> None:
        if self.on_stage == "val" and not val_tasks:
            raise ConfigError(f"CheckCallback({self.monitor!r}, on_stage='val') needs validation metrics,"
                              " but fit() got no validation data; pass val_dl (or val_tasks) to fit, or"
                              " use on_stage='train'")

    def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx):
        """Check the metric, then request this epoch's save and/or a stop."""
        metrics = val_metrics if self.on_stage == "val" else train_metrics
        if not metrics:
            self._check_val_data(val_tasks)
            return  # the stage did not run this epoch (val_freq, or validation on the update clock): not a check
        self._check(trainer, metrics, epoch_idx, "epoch(s)")

    def on_after_val_epochs(self, trainer, tasks, metrics, epoch_idx):
        """A validation point of the update clock (`fit(val_every_n_updates=M)`) is a check of a 'val'
        monitor: its save is written and its stop taken at that point (patience counts validation points)."""
        if self.on_stage == "val" and trainer.loop.val_point_open:
            self._check(trainer, metrics, epoch_idx, "validation point(s)")

    def _check(self, trainer, metrics, epoch_idx, unit):
        """Check the metric, then request a save and/or a stop (`unit`: what the patience counts)."""
        if self.monitor not in metrics:
            raise self._unknown_monitor(metrics)
        value = float(metrics[self.monitor])
        self.last = value
        epoch = epoch_idx + 1  # monitors (and checkpoint files) record 1-based epoch numbers
        improved = not math.isnan(value) and (
            self.best is None or (value < self.best if self.mode == "min" else value > self.best))
        if improved:
            self.best, self.best_epoch, self.bad_epochs = value, epoch, 0
        else:
            self.bad_epochs += 1
        if improved or not self.save_best:
            self.saved_epoch = epoch  # before the save runs, so the file records itself
            trainer.request_save(lambda: self._save(trainer))
        if self.save_best:  # the best file may be older than this epoch: a resume says what it trains again
            trainer.request_save(lambda: self._save_progress(trainer))
        if self.patience and self.bad_epochs >= self.patience:
            best = "none" if self.best is None else f"{self.best:.6g} at epoch {self.best_epoch}"
            trainer.request_stop(f"{self.on_stage} {self.monitor} did not improve for {self.bad_epochs}"
                                 f" {unit} (best {best})", f"CheckCallback({self.monitor_id})")

    def on_after_fit(self, trainer):
        """The fit ended (target reached or stopped early): record it next to this monitor's checkpoints,
        so that resuming the run says it is finished instead of training again (`deepepochs.checkpoint.finished`)."""
        self._finish_writes()  # the file is complete before the run is marked finished
        if trainer.dist.is_main:
            finished.write_finished(trainer, self.path(trainer).parent)

    def _save(self, trainer) -> None:
        # Runs in the save_checkpoints action: every monitor has checked this epoch by now, so the
        # file carries all of their states. Every rank took the same decision and calls it (rank 0 writes
        # the file; under FSDP every rank writes its shards).
        if self._writer is None:
            checkpoint.save(trainer, self.path(trainer))
            return
        self._writer.report("CheckCallback")
        checkpoint.save(trainer, self.path(trainer), writer=self._writer)

    def _save_progress(self, trainer) -> None:
        if trainer.dist.is_main:
            finished.write_progress(trainer, self.path(trainer).parent)

    def on_before_test_epochs(self, trainer, tasks):
        """The first CheckCallback swaps in the weights of the first monitor that has a file."""
        monitors = [m for m in checkpoint.monitors_of(trainer) if isinstance(m, CheckCallback)]  # not snapshots
        if not monitors or monitors[0] is not self:
            return  # one coordinator, so the weights are swapped (and restored) exactly once
        for monitor in monitors:
            monitor._finish_writes()  # the files read here are complete
        if trainer.world_size > 1:
            # Rank 0 may still be writing the last epoch's file: wait for it, so that all ranks see the
            # same files and pick the same monitor (a collective used as a barrier).
            trainer.dist.reduce_sum(torch.zeros(1, device=trainer.device))
        source = next((m.path(trainer) for m in monitors if checkpoint.exists(m.path(trainer))), None)
        if source is None:
            return
        ckpt = checkpoint.read_weights(trainer, source)  # under FSDP every rank reads its shards
        # Back up before touching the weights: a failing load_state_dict may have copied some of them.
        self._test_backup = checkpoint.copied_to_cpu(trainer.raw_model.state_dict())
        self._tested = source
        checkpoint.load_model_state(trainer, ckpt.model, source)
        averages = trainer.loop.run.averages
        if ckpt.averages and averages:  # the file's weight averages too: evaluate=True tests the file's average
            self._averages_backup = copy.deepcopy(averages)
            checkpoint.load_averages(trainer, ckpt.averages)
        # named in the run's clock: under the update clock a best file is often of epoch 0, after n updates
        when = f"update {ckpt.updates}" if counts_updates(trainer.config, trainer.loop) else f"epoch {ckpt.epoch}"
        trainer.console.info(f"Testing the weights of {source} ({when})")

    def on_after_test_epochs(self, trainer, tasks, metrics):
        """Give the model its pre-test weights back. deepepochs 0.6.18 kept the tested ones: where they differ
        from the pre-test weights (the best file is not the last epoch's), said once per process."""
        key = "test-restores-weights"
        if self._test_backup is not None and not told(key) and not _equal_states(
                trainer.raw_model.state_dict(), self._test_backup):
            tell_once(key, "test() evaluated the checkpoint's weights and gives the model its pre-test weights"
                      " back; deepepochs 0.6.18 left the checkpoint's weights in the model. To keep them, load"
                      f" them: trainer.load_checkpoint({str(self._tested)!r})")
        self._restore(trainer)

    def on_interrupted(self, trainer, exception):
        """A failed test (or fit) must not leave the checkpoint's weights in the model."""
        self._finish_writes()
        self._restore(trainer)

    def on_close(self, trainer):
        self._finish_writes()

    def _restore(self, trainer) -> None:
        averages, self._averages_backup = self._averages_backup, None
        if averages is not None:
            checkpoint.load_averages(trainer, averages)
        backup, self._test_backup = self._test_backup, None
        if backup is not None:
            checkpoint.load_model_state(trainer, backup, "<the weights before testing>")


def _equal_states(live, backup) -> bool:
    """Whether the live state dict holds exactly the backed-up values (the backup's tensors are CPU copies,
    DTensor shards where they were: each is compared where it lives)."""
    if live.keys() != backup.keys():
        return False
    for key, value in live.items():
        kept = backup[key]
        if isinstance(value, torch.Tensor):
            if not isinstance(kept, torch.Tensor) or not torch.equal(value.detach().to(kept.device), kept):
                return False
        elif value != kept:
            return False
    return True
