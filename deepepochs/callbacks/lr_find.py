"""`LRFindCallback`: deepepochs 0.6's learning-rate finder, kept for 0.6 code.

Attached to a trainer, it makes the next `fit()` run a learning-rate sweep instead of training (as in 0.6,
where the finder's fit ended after the sweep): the learning rate grows exponentially from `min_lr` to
`max_lr` over at most `max_batch` updates, the sweep stops when the loss diverges, the curve is drawn when
matplotlib is installed, and then, unlike 0.6, the model, optimizers and schedulers are restored, so a
following `fit()` trains from where the trainer was. The sweep runs once per callback; its results stay
on the callback (`lrs`, `losses`, `suggestion`, `result`). `Trainer.find_lr` does the same in one call.

`run_finder` is what both run: the sweep (`deepepochs.training.lr_sweep.run_sweep`), then its summary on the console
and the curve drawn, through the trainer's public surface.
"""

from __future__ import annotations

import functools

from deepepochs.callbacks.base import Callback
from deepepochs.errors import ConfigError
from deepepochs.training.lr_sweep import LRFindResult, check_plot, check_sweep_args, run_sweep

__all__ = ["LRFindCallback", "run_finder"]


class LRFindCallback(Callback):
    """Run a learning-rate range test at the next `fit()` instead of training; see the module docstring.

    Args:
        max_batch: the most updates (learning rates) to try.
        min_lr, max_lr: the range swept, exponentially.
        opt_id: which optimizer's learning rate to sweep; required with several optimizers.
        stop_factor: stop when the smoothed loss exceeds this multiple of its best value (None: never).
        smooth: the loss's moving-average factor, in [0, 1).
        plot: True shows the curve when matplotlib is installed, a path saves it (matplotlib required:
            `pip install -e '.[plot]'` in a clone), False skips it.

    Example:
        >>> finder = LRFindCallback(max_batch=100, min_lr=1e-5, max_lr=1.0)
        >>> Trainer(model, F.cross_entropy, opt, callbacks=[finder]).fit(train_dl)
        >>> finder.suggestion
    """

    def __init__(self, max_batch: int = 100, min_lr: float = 1e-6, max_lr: float = 5.0, opt_id: int | None = None,
                 stop_factor: float | None = 4.0, smooth: float = 0.9, plot=True):
        check_sweep_args(min_lr, max_lr, max_batch, stop_factor, smooth)
        check_plot(plot)
        self.max_batch, self.min_lr, self.max_lr, self.opt_id = max_batch, min_lr, max_lr, opt_id
        self.stop_factor, self.smooth, self.plot = stop_factor, smooth, plot
        self.result = None  # the LRFindResult once the sweep ran

    @property
    def done(self) -> bool:
        """Whether this callback's sweep has run (a later fit trains normally)."""
        return self.result is not None

    def sweep(self, trainer, train_dl, train_tasks, batch_size) -> None:
        """Run this callback's sweep on `trainer` (the fit it is attached to, instead of training)."""
        self.result = run_finder(trainer, train_dl, train_tasks, self.min_lr, self.max_lr, self.max_batch,
                                 self.stop_factor, self.smooth, self.opt_id, self.plot, batch_size)

    @property
    def lrs(self) -> list:
        """The learning rates tried (empty before the sweep)."""
        return [] if self.result is None else self.result.lrs

    @property
    def losses(self) -> list:
        """The loss of each update of the sweep (empty before it)."""
        return [] if self.result is None else self.result.losses

    @property
    def suggestion(self) -> float | None:
        """The suggested learning rate (None before the sweep, or when it ran fewer than 3 updates)."""
        return None if self.result is None else self.result.suggestion

    def __repr__(self) -> str:
        return (f"LRFindCallback(max_batch={self.max_batch}, min_lr={self.min_lr}, max_lr={self.max_lr},"
                f" opt_id={self.opt_id})")


def run_finder(trainer, train_dl, train_tasks, min_lr, max_lr, num_steps, stop_factor, smooth, opt_index, plot,
               batch_size) -> LRFindResult:
    """Check the sweep's arguments, run it on `trainer` (which it leaves as it was), say what it found on the
    console and draw the curve as `plot` asks (on the main process); see `Trainer.find_lr`."""
    check_sweep_args(min_lr, max_lr, num_steps, stop_factor, smooth)
    check_plot(plot)
    if train_dl is None and not train_tasks:
        raise ConfigError("find_lr needs training data: pass train_dl (a DataLoader or iterable of batches)")
    result = run_sweep(trainer.opt, functools.partial(trainer.run_trial, train_dl, train_tasks, batch_size),
                       min_lr=min_lr, max_lr=max_lr, num_steps=num_steps, stop_factor=stop_factor, beta=smooth,
                       opt_index=opt_index)
    suggestion = "none (fewer than 3 updates)" if result.suggestion is None else f"{result.suggestion:.3g}"
    trainer.console.info(f"lr finder: {len(result.lrs)} updates, lr {result.lrs[0]:.3g} to {result.lrs[-1]:.3g}"
                         f" ({result.stop_reason}); suggested lr: {suggestion}; model, optimizers and"
                         " schedulers restored")
    if plot is not False and plot is not None and trainer.is_main_process:
        drawn = result.plot(path=None if plot is True else plot)
        if not drawn:
            trainer.console.info("lr finder: matplotlib is not installed, so the curve is not drawn; install"
                                 " it with `pip install matplotlib`, or read result.lrs and result.losses")
    return result
