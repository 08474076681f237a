"""The learning-rate finder behind `Trainer.find_lr` and `LRFindCallback`.

A range test: training updates with a learning rate that grows exponentially from `min_lr` to `max_lr`,
one rate per update, recording each update's loss; the sweep stops early when the smoothed loss diverges
(exceeds `stop_factor` times its best value, or becomes inf/NaN). The sweep runs through the ordinary
training loop (the same steps, precision, accumulation and DDP handling as `fit`) with the trainer's own
callbacks detached, so nothing is logged, checkpointed or early-stopped; afterwards the model, optimizers,
schedulers, GradScaler, loop counters, history and random generators are put back as they were.

The suggestion (`suggest_lr`) is the learning rate where the loss falls fastest against log(lr), capped
at a tenth of the rate where it is lowest (fastai's and Lightning's two rules of thumb, the safer of them).
The curve it reads is the losses up to the first one above 4x the lowest so far (the divergence), smoothed
forward and then backward by the sweep's moving average: a one-way average lags, which moves its steepest
point and its minimum to higher rates, up to the cliff (the suggestion then diverged when trained with).
"""

from __future__ import annotations

import math
import os

import attrs
import numpy as np
import torch

from deepepochs.errors import ConfigError
from deepepochs.fsm.events import CallbackHooks

__all__ = ["LRFindResult", "check_plot", "check_sweep_args", "run_sweep", "suggest_lr", "sweep_lrs"]


@attrs.define(frozen=True)
class LRFindResult:
    """What a learning-rate sweep measured.

    Attributes:
        lrs: the learning rate of each update, increasing exponentially.
        losses: each update's training loss (the mean over the update's batches, global under DDP).
        smoothed: `losses` smoothed by a bias-corrected exponential moving average.
        suggestion: the suggested learning rate (`suggest_lr`; None when fewer than 3 updates ran before
            the loss diverged or bottomed out).
        stop_reason: why the sweep ended: 'max_lr reached' or 'diverged: ...'.
    """

    lrs: list
    losses: list
    smoothed: list
    suggestion: float | None
    stop_reason: str

    def y_range(self) -> tuple[float, float] | None:
        """The loss range `plot` shows: from the smoothed curve's lowest value up to its highest before
        that lowest point (where the sweep started), with a margin, so the diverged tail does not flatten
        the useful part. None when the curve has no finite values."""
        curve = [v for v in self.smoothed if math.isfinite(v)]
        if not curve:
            return None
        low_at = curve.index(min(curve))
        low, high = curve[low_at], max(curve[:low_at + 1])
        raw = [v for v in self.losses[:low_at + 1] if math.isfinite(v)]
        low, high = min([low, *raw]), max([high, *raw])
        margin = 0.1 * (high - low) or 0.1 * abs(high) or 0.1
        return low - margin, high + margin

    def plot(self, path=None, show: bool = True) -> bool:
        """Draw loss against learning rate (log scale) with the suggestion marked, if matplotlib is installed;
        the loss axis spans `y_range()` (a diverged tail runs off the top).

        With `path` the figure is saved there, else shown (`show`). Returns False, drawing nothing, when
        matplotlib is not installed (it is optional: `pip install matplotlib`).
        """
        try:
            from matplotlib import pyplot as plt  # optional dependency, imported only to draw
        except ImportError:
            return False
        fig, ax = plt.subplots()
        ax.plot(self.lrs, self.losses, alpha=0.4, label="loss")
        ax.plot(self.lrs, self.smoothed, label="smoothed loss")
        limits = self.y_range()
        if limits is not None:
            ax.set_ylim(*limits)
        if self.suggestion is not None:
            ax.axvline(self.suggestion, color="red", linestyle="--", label=f"suggestion {self.suggestion:.3g}")
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("loss")
        ax.legend()
        if path is not None:
            fig.savefig(os.fspath(path))
            plt.close(fig)
        elif show:
            plt.show()
        return True


def sweep_lrs(min_lr: float, max_lr: float, num_steps: int) -> list[float]:
    """`num_steps` learning rates from `min_lr` to `max_lr`, evenly spaced on a log scale."""
    ratio = max_lr / min_lr
    return [min_lr * ratio ** (i / (num_steps - 1)) for i in range(num_steps)]


def smooth(losses, beta: float) -> list[float]:
    """Bias-corrected exponential moving average (`beta=0` returns the losses unchanged)."""
    out, avg = [], 0.0
    for i, loss in enumerate(losses, 1):
        avg = beta * avg + (1 - beta) * loss
        out.append(avg / (1 - beta ** i))
    return out


def suggest_lr(lrs, losses, beta: float = 0.9) -> float | None:
    """The suggested learning rate from a sweep's raw `losses` (see the module docstring): the rate of the
    steepest descent of the curve against log10(lr) before its minimum, at most a tenth of the rate at its
    minimum; None when fewer than 3 updates precede the divergence or the minimum."""
    values = np.asarray(losses, dtype=np.float64)
    finite = np.isfinite(values)
    end = len(values) if finite.all() else int(np.argmin(finite))
    values = values[:end]
    diverged = np.nonzero(values > 4 * np.minimum.accumulate(values))[0] if end else []
    values = values[:diverged[0] if len(diverged) else end]
    if len(values) < 3:
        return None
    # zero-phase smoothing: the moving average forward, then backward over its result
    curve = np.asarray(smooth(smooth(values.tolist(), beta)[::-1], beta)[::-1])
    low = int(np.argmin(curve))
    if low < 2:
        return None
    rates = np.asarray(lrs[:low + 1], dtype=np.float64)
    steepest = float(rates[int(np.argmin(np.gradient(curve[:low + 1], np.log10(rates))))])
    return min(steepest, float(rates[low]) / 10)


def check_sweep_args(min_lr, max_lr, num_steps, stop_factor, beta) -> None:
    """Validate a sweep's settings (ConfigError naming the argument and what was received)."""
    for name, value in (("min_lr", min_lr), ("max_lr", max_lr)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise ConfigError(f"{name} must be a positive finite number (got {value!r})")
    if min_lr >= max_lr:
        raise ConfigError(f"min_lr must be smaller than max_lr (got min_lr={min_lr!r}, max_lr={max_lr!r})")
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 2:
        raise ConfigError(f"num_steps (max_batch) must be an int >= 2: the number of updates to sweep"
                          f" (got {num_steps!r})")
    if stop_factor is not None and (isinstance(stop_factor, bool) or not isinstance(stop_factor, (int, float))
                                    or stop_factor <= 1):
        raise ConfigError(f"stop_factor must be a number > 1, or None to sweep up to max_lr (got {stop_factor!r})")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
        raise ConfigError(f"smooth must be a number in [0, 1): the moving-average factor (got {beta!r})")


def check_plot(plot) -> None:
    """`plot` is True (draw when matplotlib is installed, else a note), False/None, or a file path, which
    needs matplotlib: asking for a file that cannot be written is an error, before the sweep runs."""
    if plot is None or isinstance(plot, bool):
        return
    if not isinstance(plot, (str, os.PathLike)):
        raise ConfigError(f"plot must be True, False or a file path for the figure (got {type(plot).__name__})")
    try:
        import matplotlib  # noqa: F401  (optional dependency: only checked here)
    except ImportError:
        raise ConfigError(f"plot={os.fspath(plot)!r} saves the curve with matplotlib, which is not installed:"
                          " pip install matplotlib (the clone's extra: pip install -e '.[plot]'), or pass plot=False"
                          " and read result.lrs and result.losses") from None


class _SweepDone(Exception):
    """Raised from the sweep's hook to end the sweep's fit mid-epoch (caught by `run_sweep`)."""


class _Sweep(CallbackHooks):
    """The sweep's only callback while it runs: sets each update's learning rate before the optimizer
    steps, records the update's loss after its last micro-batch, and ends the sweep.

    It derives from the generated `CallbackHooks` (what the hook table accepts), not from
    `deepepochs.callbacks.Callback`: the finder is a policy below the callbacks layer."""

    def __init__(self, lrs, indices, stop_factor, beta):
        self.lrs = lrs
        self.indices = indices
        self.stop_factor = stop_factor
        self.beta = beta
        self.losses: list[float] = []
        self.smoothed: list[float] = []
        self.window: list[float] = []
        self.updated = False
        self.stop_reason = "max_lr reached"

    def on_before_optimize(self, trainer, optimize_index):
        lr = self.lrs[len(self.losses)]
        for i in self.indices:
            for group in trainer.opt[i].opt.param_groups:
                group["lr"] = lr  # after any step-wise scheduler of the last update: the sweep's rate wins

    def on_after_optimize(self, trainer, optimize_index):
        self.updated = True

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if "loss" not in metrics:
            raise ConfigError("find_lr needs each training batch's loss, but the step reported none; let the"
                              " step compute it with self.loss(...) or return a 'loss' entry")
        self.window.append(float(metrics["loss"]))
        if not self.updated:
            return  # accumulation: the update comes with the window's last micro-batch
        self.updated = False
        total = torch.tensor([sum(self.window), len(self.window)], dtype=torch.float64, device=trainer.device)
        total = trainer.dist.reduce_sum(total)  # every rank sees the same loss and stops at the same update
        self.window = []
        loss = float(total[0] / total[1])
        self.losses.append(loss)
        self.smoothed = smooth(self.losses, self.beta)
        current, best = self.smoothed[-1], min(self.smoothed)
        if not math.isfinite(loss):
            self.stop_reason = f"diverged: loss {loss} at lr {self.lrs[len(self.losses) - 1]:.3g}"
            raise _SweepDone
        if self.stop_factor is not None and current > self.stop_factor * best:
            self.stop_reason = (f"diverged at lr {self.lrs[len(self.losses) - 1]:.3g}: the smoothed loss {current:.4g}"
                                f" is above {self.stop_factor:g} times its lowest value {best:.4g}"
                                f" (the limit {self.stop_factor * best:.4g})")
            raise _SweepDone
        if len(self.losses) == len(self.lrs):
            raise _SweepDone


def run_sweep(opts, trial, *, min_lr, max_lr, num_steps, stop_factor, beta, opt_index) -> LRFindResult:
    """Run the range test (see the module docstring) with the optimizers `opts`; the trainer is left as
    it was.

    `trial(callbacks, epochs)` trains the sweep's data for up to `epochs` more epochs with only `callbacks`
    attached and nothing printed, then puts the model, optimizers, schedulers, scaler, generators and run
    state back (`Trainer.run_trial`, `deepepochs.engine.trial`). The sweep's callback ends it by raising
    `_SweepDone`."""
    if opt_index is None:
        if len(opts) > 1:
            raise ConfigError(f"the trainer has {len(opts)} optimizers: pass opt_index (opt_id) = 0..{len(opts) - 1}"
                              " to choose the one whose learning rate is swept")
        indices = (0,)
    elif isinstance(opt_index, bool) or not isinstance(opt_index, int) or not 0 <= opt_index < len(opts):
        raise ConfigError(f"opt_index (opt_id) must be an int in 0..{len(opts) - 1} (got {opt_index!r})")
    else:
        indices = (opt_index,)
    sweep = _Sweep(sweep_lrs(min_lr, max_lr, num_steps), indices, stop_factor, beta)
    try:
        # Enough epochs for num_steps updates however short the data; the sweep ends itself before that.
        trial([sweep], num_steps)
    except _SweepDone:
        pass
    except FloatingPointError as e:  # nonfinite='raise': an inf/NaN update is divergence to a sweep
        if not sweep.losses:
            raise
        sweep.stop_reason = f"diverged: {str(e).splitlines()[0]}"
    lrs = sweep.lrs[:len(sweep.losses)]
    smoothed = smooth(sweep.losses, beta)
    return LRFindResult(lrs=lrs, losses=list(sweep.losses), smoothed=smoothed,
                        suggestion=suggest_lr(lrs, sweep.losses, beta), stop_reason=sweep.stop_reason)
