"""`Trainer`: the facade. It validates arguments, builds the policies and hands them to the engine.

The loop itself (what a batch, a window, an epoch do, and rollback) lives in `deepepochs.engine`, driven by
the machine generated from `spec/loop.py`; the engine never calls back into this module.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import attrs
import torch

from deepepochs.callbacks.base import HookTable
from deepepochs.callbacks.lr_find import LRFindCallback, run_finder
from deepepochs.checkpoint import load_into
from deepepochs.checkpoint.run_lock import hold_run
from deepepochs.config import TrainerConfig
from deepepochs.engine import callback_states
from deepepochs.engine.context import Context, LoopState, Parts, RunState, StopRequest
from deepepochs.engine.driver import Driver
from deepepochs.engine.profiling import profiles
from deepepochs.engine.summary import explain
from deepepochs.engine.trial import trial_fit
from deepepochs.engine.update_clock import check_clock
from deepepochs.errors import ConfigError
from deepepochs.fsm.render import auto_level, render
from deepepochs.parallel.strategy import select_policy
from deepepochs.patches.selection import patch_kind
from deepepochs.reporting.console import Console
from deepepochs.reporting.profile_report import profile_rows, state_shares
from deepepochs.reporting.summary_writer import RunWriters
from deepepochs.tasks import ahead_of, as_metric_list
from deepepochs.torch_private import compiled_module
from deepepochs.trainer.arguments import check_arguments, check_call, check_int, check_keywords, to_device
from deepepochs.trainer.resume_policy import resume_run
from deepepochs.trainer.step_methods import StepMethods, epochs_are_a_total, expose_module_as_model
from deepepochs.training.lr_sweep import LRFindResult
from deepepochs.training.optim import Optimizers
from deepepochs.training.precision import Precision
from deepepochs.utils import every_step

__all__ = ["Trainer", "TrainerBase"]


class TrainerBase(StepMethods):
    """Trains a model with a loss function and optimizer(s) on DataLoaders.

    Subclass it to customise how a batch is computed: define `step`, `train_step`, `val_step`,
    `test_step` or `evaluate_step` taking `(batch_x, batch_y, **step_args)` and returning None or
    `{name: Patch}`. The lookup order is `step`, then the stage's own method, then `evaluate_step`
    (val/test); for each name an `EpochTask`'s method wins over the trainer's.

    Args:
        model: the `torch.nn.Module`.
        loss: `loss(model_out, batch_y)`, or None when the model returns its own loss (a scalar or a dict
            with 'loss').
        opt: None (Adam, lr=1e-3), a torch optimizer, a `deepepochs.Optimizer`, or a list of them.
        epochs: total epoch target; repeated or resumed fits continue up to it. Default 1000, or unbounded
            (None) with `max_updates`.
        max_updates: total target in committed optimizer updates (an update skipped for inf/NaN counts), or
            None; with `epochs` too, whichever is reached first ends the fit (see the guide's "Training by
            updates").
        device: None (CUDA if available, else CPU), a string or a `torch.device`.
        callbacks: a list of `Callback`.
        metrics: metric functions `(preds, targets) -> scalar | dict`, or torchmetrics metric objects
            (updated per batch, computed at each task's end, fresh for every task), for every stage.
        metric_patch: 'auto' (default: a confusion matrix for deepepochs' accuracy, precision, recall, f1
            and confusion_matrix, every prediction kept for other functions), 'tensor' (keep all
            predictions), 'mean' (sample-weighted batch means) or 'confusion' (a confusion matrix;
            classification metrics only). Metric objects are streamed under every setting.
        precision: 'fp32', 'fp16' or 'bf16'.
        gradient_accumulation_steps: DataLoader batches per update.
        nonfinite: fp32/bf16: 'raise' FloatingPointError (with the flight record) when an update window
            has an inf/NaN loss or inf/NaN gradients, or 'skip' that update. Checking costs one host read
            per update (not per batch), by design. fp16 ignores it: the GradScaler skips overflowing
            updates itself. A skipped update's batches stay out of the epoch's loss and metrics.
        split_batches: under DDP, divide each DataLoader's batch size by the world size.
        strategy: how several processes train together: 'ddp' (default: a whole replica of the model per
            process, gradients all-reduced) or 'fsdp' (FSDP2 `fully_shard`: parameters, gradients and
            optimizer states sharded over the processes, for models too large to replicate). One process
            accepts either and trains alone.
        ddp_kwargs: under DDP, further keyword arguments of `DistributedDataParallel`, e.g.
            `{'find_unused_parameters': True}` for a model with parameters some steps do not use; checked
            against DDP's signature in any run, used only under DDP.
        fsdp_kwargs: with strategy='fsdp': 'wrap' (None: each submodule holding at least 'min_params'
            parameters, default 1_000_000, gets its own `fully_shard`; or module classes, or a callable
            `(module) -> bool`), 'reshard_after_forward' (True, False or an int) and 'mixed_precision' (a
            `MixedPrecisionPolicy`; default from `precision`). Checked in any run; see `deepepochs.parallel.fsdp`.
        data_order: the order a plain training DataLoader (`DataLoader(dataset, batch_size=..., shuffle=...)`)
            is trained in: 'loader' (one process only) the batches the DataLoader itself yields, as a plain
            loop `for x, y in dl` after the same seed gets them (its sampler and generator as you built
            them; dropout draws the plain loop's stream); 'global' the `DistributedSampler` order of
            (seed, epoch), the same for any world size (one process then equals a DDP run with the global
            batch). None (default): 'loader' in one process, 'global' under several. Exact resume holds
            for both; see the exact-resume guide.
        dist_timeout: under DDP, seconds a collective waits for the other ranks before the run fails with
            `DistributedError` naming every rank's place (a hung, far slower or dead rank), and seconds joining
            the job waits for every rank to arrive; default 600. Applies when the Trainer creates the process
            group (launch/torchrun/srun); a group you created keeps its own timeout.
        resume: False; True resumes the run named by `running_id` when it has checkpoints and starts it
            fresh when it has none (without `running_id`: the newest checkpoint of any run under the
            monitors' `ckpt_dir`s); '<run id>' resumes that run, which must exist. Honoured at the first
            `fit`, `test` or `predict` (or at `resume_now()`); the console says which run was loaded, from
            which file and why.
        running_id: the run's name, the folder of its checkpoints and logs (default: the start time).
        hyper_params: a dict written to TensorBoard with each test's results.
        log_long: print 7 digits instead of 4.
        log_batch: update the console line with running values during an epoch.
        log_tqdm: show progress bars (in a terminal) instead.
        show_info: print the run's header line (device, run id, parameter count, precision).
        compile_model: wrap the model in `torch.compile`.
        targets: where the metrics' targets come from when batches carry no label (dict batches,
            loss=None models): '<key>' takes the field `key` of dict batches (with a loss function it is
            also the loss's label and no model input, like the last item of a tuple batch; with loss=None
            the model still gets it), or a callable `fn(batch_x, model_out) -> (preds, targets)` gives the
            metrics' inputs, e.g. `lambda x, out: (out['logits'], x['labels'])`. Without it, a metric that
            needs targets fails at the first batch with a message saying so.
        fuse_steps: with the default step, one optimizer, no gradient clipper, no callback hook that
            runs per batch and one process, each micro-batch takes one fused edge of the machine (any
            precision and accumulation; bit-identical results); False takes every edge, which gives a
            finer flight record (for debugging).
        run_lock: a fit locks its run's folders (`<ckpt_dir>/<running_id>` of each checkpoint or snapshot
            callback, `<log_dir>/<running_id>` of each logging callback) from before a pending resume reads
            them until it ends, so that two live processes never train one run (a requeued job starting
            while its predecessor still runs). When another live process holds the lock: 'error' (default)
            raises `RunLockedError` naming it (pid, host, since when, lock file), 'wait' waits for it to end
            (with `resume=True` the fit then continues from what it wrote); 'off' takes no lock. A lock left
            by a killed process is taken over, with a message. Under DDP rank 0 takes it; `test`, `predict`
            and `find_lr` take none (they write no checkpoint).

    Example:
        >>> trainer = Trainer(nn.Linear(16, 2), F.cross_entropy, epochs=5)
        >>> records = trainer.fit(train_dl, val_dl)
        >>> trainer.test(test_dl)
        >>> trainer.close()
    """

    def __init__(self, model, loss=None, opt=None, epochs=None, device=None, callbacks=None, metrics=None,
                 metric_patch="auto", resume=False, running_id=None, hyper_params=None, log_long=False,
                 log_batch=True, log_tqdm=False, show_info=True, compile_model=False, *, precision="fp32",
                 gradient_accumulation_steps=1, nonfinite="raise", split_batches=False, fuse_steps=True,
                 strategy="ddp", ddp_kwargs=None, fsdp_kwargs=None, dist_timeout=600, targets=None, data_order=None,
                 run_lock="error", max_updates=None, **unknown):
        check_keywords(device, opt, unknown, TrainerBase.__init__)
        if epochs is None and max_updates is None:
            epochs = 1000  # the default target without an update budget
        self.config = TrainerConfig(
            epochs=epochs, max_updates=max_updates, precision=precision,
            gradient_accumulation_steps=gradient_accumulation_steps,
            metric_patch=patch_kind(metric_patch), nonfinite=nonfinite, split_batches=split_batches, log_long=log_long,
            log_batch=log_batch, log_tqdm=log_tqdm, show_info=show_info, compile_model=compile_model,
            fuse_steps=fuse_steps, strategy=strategy, dist_timeout=dist_timeout, data_order=data_order,
            run_lock=run_lock)
        args = check_arguments(model, loss, resume, running_id, device, strategy, ddp_kwargs, fsdp_kwargs, targets)
        resume, running_id, device, ddp_kwargs = args.resume, args.running_id, args.device, args.ddp_kwargs
        target_key, pick_targets = args.target_key, args.pick_targets
        dist = select_policy(device, split_batches=self.config.split_batches, timeout=self.config.dist_timeout,
                             fsdp=args.fsdp, precision=self.config.precision, data_order=self.config.data_order)
        self.device = dist.device
        self.metrics = as_metric_list(metrics, "metrics")
        self.resume = resume
        # Under DDP rank 0's id: all ranks must name the same checkpoint and log folders. A name given
        # means that resume=True resumes this run only.
        run = RunState(running_id=dist.broadcast_object(running_id or datetime.datetime.now().strftime(
            "%Y%m%d-%H%M%S-%f")), running_id_given=running_id is not None)
        self.hyper_params = dict(hyper_params or {})
        self._precision = Precision(self.config.precision, self.device)
        given = model.to(self.device)
        inner = compiled_module(given)  # torch.compile(model) given: save, load and log the module it wraps
        model = given if inner is None else inner
        self.raw_model = model
        expose_module_as_model(model)  # 0.6's trainer.model.model
        self._opts = Optimizers(opt, model)
        self._opts.check_covers(model)
        dist.shard_model(model, [item.opt for item in self._opts.items])  # FSDP: in place, before compiling
        compiled = given if given is not model else torch.compile(model) if compile_model else model
        self._dist = dist
        self._console = Console(log_batch, log_tqdm, log_long, show_info, enabled=dist.is_main)
        self._hooks = HookTable()
        self._clippers = []
        self._averagers = []
        loop = LoopState(run=run, resume_pending=resume is not False)  # honoured once, at the first fit or test
        self._opts.bind_updates(loop)
        parts = Parts(
            config=self.config, device=self.device, raw_model=model,
            train_model=dist.wrap_model(compiled, ddp_kwargs),
            eval_model=compiled,  # not DDP-wrapped: evaluation issues no DDP collectives
            opts=self._opts, precision=self._precision, dist=dist, hooks=self._hooks, clippers=self._clippers,
            console=self._console, facade=self, resumer=resume_run, target_key=target_key,
            pick_targets=pick_targets, averagers=self._averagers)
        self._ctx = Context(parts, loop, loss_fn=loss)
        self._driver = Driver(self._ctx)
        self._closed = False
        self.last_checkpoint = None  # what load_checkpoint loaded last
        self._writers = RunWriters(self)  # TensorBoard writers, created on first use
        self.add_callbacks(callbacks or [])

    # ---- public API ----
    @property
    def loop(self) -> LoopState:
        """The loop's counters: `epoch` (1-based), `completed_epochs`, `target_epochs`, `stage`,
        `batch_idx` (1-based), `stop`, ..."""
        return self._ctx.loop

    @property
    def running_id(self) -> str:
        """The run's name: the folder of its checkpoints and logs (a resume names it after the run it
        loaded)."""
        return self._ctx.run.running_id

    @running_id.setter
    def running_id(self, value) -> None:
        self._ctx.run.running_id = str(value)

    def run_trial(self, train_dl, train_tasks, batch_size, callbacks, more_epochs: int):
        """Train on `train_dl`/`train_tasks` for up to `more_epochs` epochs with only `callbacks` attached and
        nothing printed, then put the model, optimizers, schedulers, scaler, generators and run state back
        (`deepepochs.engine.trial`): the learning-rate finder's sweep. Re-raises what ended it."""
        tasks = self._driver.make_tasks("train", train_dl, train_tasks, [], True, batch_size)
        if not tasks:
            raise ConfigError("find_lr needs training data: pass a DataLoader or another iterable of batches")
        return trial_fit(self._driver, tasks, callbacks, more_epochs)

    @property
    def machine(self):
        """The loop machine (`deepepochs.fsm.machine.LoopMachine`): state, flight record, test probe."""
        return self._ctx.machine

    @property
    def model(self) -> torch.nn.Module:
        """What step methods call: the DDP-wrapped (or compiled) model in training, the plain one in
        evaluation."""
        return self._ctx.model

    @property
    def loss_fn(self):
        """`loss(model_out, batch_y)`, or None when the model returns its own loss."""
        return self._ctx.loss_fn

    @loss_fn.setter
    def loss_fn(self, value):
        if value is not None and not callable(value):
            raise ConfigError(f"loss must be a callable loss(model_out, batch_y) or None (got {type(value).__name__})")
        self._ctx.loss_fn = value

    @property
    def history(self) -> dict:
        """Every committed epoch's metrics of this trainer: `{'train': {name: [...]}, 'val': {...}}`."""
        return self._ctx.history

    @property
    def opt(self):
        """The optimizers (a sequence of `deepepochs.Optimizer`, in `optimize_index` order)."""
        return self._opts

    @property
    def callbacks(self) -> list:
        """Attached callbacks, in registration order."""
        return list(self._hooks.callbacks)

    @property
    def scaler(self):
        """The fp16 `GradScaler`, or None."""
        return self._precision.scaler

    @property
    def dist(self):
        """The distributed policy (`SingleProcess`, `DDPPolicy` or `FSDPPolicy`): rank, world size, barriers,
        gathers and broadcasts for callbacks and extensions."""
        return self._dist

    @property
    def console(self):
        """The console (`deepepochs.reporting.console.Console`): progress bars and messages, printed on rank 0 only."""
        return self._console

    @property
    def precision(self):
        """The mixed-precision policy (`deepepochs.training.precision.Precision`): autocast and the fp16 GradScaler."""
        return self._precision

    @property
    def is_main_process(self) -> bool:
        """True on rank 0 (and in a single process)."""
        return self._dist.is_main

    @property
    def world_size(self) -> int:
        """Number of processes training together."""
        return self._dist.world_size

    def add_callbacks(self, callbacks) -> None:
        """Attach callbacks; their hook signatures are checked now. Callbacks with a `clip` method are
        also registered as gradient clippers (the spec's clip_gradients action), those with an
        `average_weights` method as weight averages (the spec's average_update and average_epoch actions),
        and those with `state_dict()` and `load_state_dict()` as callbacks whose state every checkpoint holds
        (by class name, and `state_key` if they have one: two of one name are refused)."""
        callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
        stateful = callback_states.stateful(self._hooks.callbacks + callbacks)  # refused before any is attached
        self._clippers.extend(self._hooks.attach(callbacks, self))
        self._averagers.extend(cb.average_weights for cb in callbacks if callable(getattr(cb, "average_weights", None)))
        self._ctx.parts.stateful.clear()
        self._ctx.parts.stateful.update(stateful)

    @profiles("fit")
    def fit(self, train_dl=None, val_dl=None, metrics=None, val_freq=1, do_val_loss=True, batch_size=None,
            train_metrics=None, val_metrics=None, train_tasks=None, val_tasks=None, epochs=None,
            val_every_n_updates=None, val_at_start=False, val_at_end=True):
        """Train toward the epoch target; returns the whole run's records, `{'train': {name: [per epoch]},
        'val': {...}}` (a copy of `trainer.history`: every epoch of the run, those of earlier fits and of
        a resumed checkpoint included). An exception rolls the open window back and is re-raised with
        the flight record; calling `fit` again continues where the run stopped.

        With an `LRFindCallback` attached whose sweep has not run yet, this fit runs the sweep instead of
        training (as in deepepochs 0.6; see `find_lr`) and returns empty records. A `resume=...` of a run
        that is finished (see `deepepochs.checkpoint.finished`) trains nothing. While it runs, the run's
        folders are locked against other processes (`run_lock`).

        `val_every_n_updates=M` validates after every M-th update of the run and at `max_updates`, inside
        epochs (then not at epochs' ends); `records['val']` then has one row per validation point, with its
        update count under `'updates'`. With it, `val_at_start=True` also validates before the first update
        (a point recorded at update 0, as nanoGPT's iteration 0 or the Hugging Face Trainer's
        `eval_on_start`), and `val_at_end=False` leaves out the point at `max_updates` when it is not a
        multiple of M."""
        self._check_open("fit")
        finder = next((cb for cb in self._hooks.callbacks if isinstance(cb, LRFindCallback) and not cb.done), None)
        if finder is not None:  # 0.6: a fit with an LRFindCallback is a learning-rate sweep, not training
            finder.sweep(self, train_dl, train_tasks, batch_size)
            return {"train": {}, "val": {}}
        if epochs is not None:
            self.config = attrs.evolve(self.config, epochs=epochs)  # validated like the constructor's
            epochs_are_a_total(self, epochs)
        check_int("val_freq", val_freq)
        if train_dl is not None and train_tasks:
            raise ConfigError("pass either train_dl or train_tasks to fit(), not both")
        driver = self._driver
        # 0.6.18's column order: a stage's own metrics, then fit's, then the trainer's (each metric once)
        common = ahead_of(as_metric_list(metrics, "metrics"), self.metrics, keep_first=True)
        train = driver.make_tasks("train", train_dl, train_tasks,
                                  ahead_of(as_metric_list(train_metrics, "train_metrics"), common), True, batch_size)
        if not train:
            raise ConfigError("fit() needs training data: pass train_dl or train_tasks")
        val = driver.make_tasks("val", val_dl, val_tasks,
                                ahead_of(as_metric_list(val_metrics, "val_metrics"), common), do_val_loss, batch_size)
        for task in val:
            task.val_freq = val_freq  # 0.6's task.val_freq
        config = self.config
        check_clock(train, val, config.max_updates, val_every_n_updates, val_at_start, val_at_end)
        with hold_run(self, config.run_lock):  # before a pending resume reads the run's folders
            return driver.guarded("fit", lambda: driver.run_fit(train, val, val_freq, config.epoch_target,
                                                                config.max_updates, val_every_n_updates,
                                                                val_at_start, val_at_end))

    @profiles("test")
    def test(self, test_dl=None, metrics=None, do_loss=True, batch_size=None, tasks=None):
        """Evaluate on `test_dl` and/or `tasks`; returns `{name: value}` (global under DDP). Values are plain
        floats (0.6 returned NumPy 0-d arrays; `float(v)` reads both)."""
        self._check_open("test")
        driver = self._driver
        tasks = driver.make_tasks("test", test_dl, tasks, ahead_of(as_metric_list(metrics, "metrics"), self.metrics),
                                  do_loss, batch_size)
        if not tasks:
            raise ConfigError("test() needs data: pass test_dl or tasks")
        return driver.guarded("test", lambda: driver.run_test(tasks))

    def estimated_updates(self, train_dl, epochs=None) -> int:
        """The number of updates `fit(train_dl)` makes over `epochs` epochs (default: the trainer's
        `epochs`), per process: `ceil(batches per process / gradient_accumulation_steps) * epochs`, the
        batches per process being those of the shard each process trains on (a plain DataLoader is split
        over the processes). This is the `total_steps` / `T_max` a step-wise scheduler (`sched_on='step'`)
        such as `OneCycleLR` or `CosineAnnealingLR` needs; create the scheduler with it after the Trainer.

        Every update steps the scheduler once, except those the fp16 GradScaler skips (a non-finite
        gradient): then the schedule ends a few updates short, never past its end.

        Example:
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> trainer = Trainer(model, F.cross_entropy, opt, epochs=5)
            >>> total = trainer.estimated_updates(train_dl)
            >>> trainer.opt[0].scheduler = OneCycleLR(opt, max_lr=0.1, total_steps=total)
        """
        self._check_open("estimated_updates")
        epochs = check_int("epochs", self.config.epochs if epochs is None else epochs)
        if train_dl is None:
            raise ConfigError("estimated_updates() needs the training data: pass the DataLoader given to fit()")
        data = self._dist.prepare_dataloader(train_dl, "train")
        try:
            batches = len(data)
        except TypeError:
            raise ConfigError(f"estimated_updates() needs data with a length (len()); {type(train_dl).__name__}"
                              " has none, so count the updates yourself") from None
        k = self.config.gradient_accumulation_steps
        return -(-batches // k) * epochs  # windows never cross an epoch: a short tail window is one update

    @profiles("predict")
    def predict(self, dataloader, device="cpu", batch_size=None):
        """The model's outputs for every batch of `dataloader`, concatenated in order along dim 0.

        The model runs in eval mode without gradients (under the trainer's precision); a tuple, list or
        dict output keeps its structure with each tensor concatenated. Batches are split as in training:
        with a loss function the last item of a tuple batch is the label and is not passed to the model; a
        lone tensor or a one-item tuple is the input. No hooks run and no metrics are computed; a pending
        `resume=...` loads first, as for `test`.

        Under DDP every rank must call `predict`; a plain DataLoader is sharded, each sample runs once, and
        rank 0 returns the outputs in dataset order (other ranks return None). In one process the order is
        the DataLoader's (so a `shuffle=True` loader gives shuffled order).

        Args:
            dataloader: a DataLoader or any iterable of batches.
            device: where the outputs are returned: 'cpu' (default), another device, or None to leave them
                on the device that computed them.
            batch_size: not needed for prediction; accepted for symmetry with `test`.

        Example:
            >>> probs = trainer.predict(test_dl).softmax(dim=1)
        """
        self._check_open("predict")
        device = to_device(device, "predict")
        if dataloader is None:
            raise ConfigError("predict() needs data: pass a DataLoader or another iterable of batches")
        driver = self._driver
        task, = driver.make_tasks("test", dataloader, None, [], False, batch_size, call="predict")
        return driver.guarded("predict", lambda: driver.run_predict(task, device))

    def find_lr(self, train_dl, min_lr: float = 1e-7, max_lr: float = 10.0, num_steps: int = 100,
                stop_factor: float | None = 4.0, smooth: float = 0.9, opt_index: int | None = None, plot=True,
                batch_size=None) -> LRFindResult:
        """Learning-rate range test: train `num_steps` updates with the learning rate growing exponentially
        from `min_lr` to `max_lr`, stopping early when the smoothed loss diverges (above `stop_factor`
        times its best, or inf/NaN); then restore the model, optimizers, schedulers, GradScaler, epoch
        counters and random generators, so the trainer is as it was.

        The sweep uses the training loop itself (steps, precision, accumulation: one rate per update;
        under DDP the global loss, every rank must call it) with the trainer's callbacks detached: nothing
        is logged or checkpointed. The data is cycled when it has fewer batches than the sweep needs.

        Args:
            train_dl: training data (a DataLoader or any re-iterable of batches).
            min_lr, max_lr: the range swept.
            num_steps: the most updates, one learning rate each (>= 2).
            stop_factor: divergence threshold on the smoothed loss; None sweeps up to `max_lr`.
            smooth: the loss's moving-average factor in [0, 1) (0: no smoothing).
            opt_index: the optimizer whose rate is swept; required with several optimizers.
            plot: True draws the curve (matplotlib, when installed; else a note says how to get it), a path
                saves it there (which needs matplotlib: without it, a `ConfigError` before the sweep),
                False draws nothing.
            batch_size: as for `fit`.

        Returns:
            `LRFindResult` with `lrs`, `losses`, `smoothed`, `suggestion` and `stop_reason`. The
            suggestion is the rate where the loss falls fastest, at most a tenth of the rate where it is
            lowest, read from the curve before it diverges, smoothed without lag (`deepepochs.training.lr_sweep`).

        Example:
            >>> result = trainer.find_lr(train_dl, min_lr=1e-5, max_lr=1.0, plot=False)
            >>> for group in opt.param_groups: group["lr"] = result.suggestion
        """
        self._check_open("find_lr")
        return run_finder(self, train_dl, None, min_lr, max_lr, num_steps, stop_factor, smooth, opt_index, plot,
                          batch_size)

    def main_process_first(self):
        """Context: rank 0 runs the block first (e.g. downloading data), then the other ranks."""
        return self._dist.main_process_first()

    def request_stop(self, reason: str, source: str = "") -> None:
        """Ask the fit to stop after the current epoch (the `stop_requested` guard)."""
        self.loop.stop = StopRequest(reason, source)

    def request_save(self, save) -> None:
        """Ask for `save()` to run at this epoch's end (the `save_checkpoints` action)."""
        self.loop.save_requests.append(save)

    def load_checkpoint(self, path, trusted: bool = False):
        """Load one checkpoint (a file, or a sharded checkpoint folder saved under FSDP): model, optimizers,
        schedulers, GradScaler, completed epoch and the monitors' state; the next `fit` continues with the
        following epoch. Every rank calls it (DDP, FSDP: there each rank reads its own shards).

        Overrides a pending `resume=...`; the running id stays as it is. Returns the trainer, so that calls
        chain as in deepepochs 0.6 (`trainer.load_checkpoint(path).test(test_dl)`); the file's contents, a
        `deepepochs.checkpoint.Checkpoint`, are `trainer.last_checkpoint`. Raises `CheckpointError` naming
        the path when the file is missing, unreadable, truncated or does not fit this trainer.

        The file is read with `torch.load(weights_only=True)`: nothing in it can run code. A file that
        holds other objects (e.g. a custom scheduler's state with objects of its own) is refused, naming
        the type; `trusted=True` unpickles it fully, which runs any code the file carries: use it only for
        files you made yourself.
        """
        self._check_open("load_checkpoint")
        self.last_checkpoint = load_into(self, path, trusted=trusted)
        self.loop.resume_pending = False
        return self

    def resume_now(self):
        """Honour a pending `resume=...` now instead of at the first `fit`, `test` or `predict`: afterwards
        the model, optimizers, schedulers and `trainer.loop.run` (`updates`, the records) hold what the
        resume loaded, as a plain loop knows its step right after reading its checkpoint. The run's folders
        are locked while they are read, as a fit locks them (`run_lock`); the fit that follows locks them
        again. Give the optimizers their schedulers before calling it: the checkpoint loads into them. Every
        rank calls it (under DDP the resume is collective). Without a pending resume it does nothing. Returns
        the trainer."""
        self._check_open("resume_now")
        with hold_run(self, self.config.run_lock):
            self._driver.guarded("resume_now", self._driver.honour_resume)
        return self

    def explain(self) -> str:
        """What a training batch of this trainer runs: a few lines in short (precision, accumulation,
        processes, whether the model is compiled, what each update checks, the steps left out and why, and
        whether batches run the code or fire its edges one by one), then the code generated from the loop
        spec, each line with the edge it belongs to (`python -m deepepochs loop` prints the code too). With
        a training step of your own, its source instead, and the spec's edges its calls take."""
        return explain(self._ctx)

    def state_graph(self, fmt: str = "mermaid", path=None, show_interrupts: bool = False, level: str | None = None,
                    last: int = 12, profile=None):
        """The loop's state graph as Mermaid/DOT text or PNG/SVG bytes (these need Graphviz `dot`), or, with
        `path`, the path of the file it was written to (so a notebook cell shows the path, not the drawing's
        text).

        Args:
            fmt: 'mermaid', 'dot', 'png' or 'svg'.
            path: write the graph to this file and return its path (a `pathlib.Path`).
            show_interrupts: draw every running state's interrupt edge (else one legend line).
            level: 'fit' (a fit as epochs), 'epoch' (stages and tasks), 'task' (windows of micro-batches),
                'batch' (one micro-batch: accumulation, precision, the update) or 'full' (every state).
                None: the coarsest level showing the state that failed (after a crash) or the current one
                (with `profile`: the hottest state).
            last: how many of the last transitions to number along the drawn path (1 = oldest).
            profile: a `ProfileCallback` that profiled a run (or its `table`): draw the graph as a heat map,
                each state shaded and labelled by its share of the run's time.

        After a crash the state that failed is red, the last transitions are numbered on the edges they
        took (as in the error's flight record) and a green edge leads from rollback to the last commit
        point (the work a refit keeps). On a live trainer the current state is highlighted.
        """
        check_int("last", last, minimum=0)
        records = self.machine.records()[-last:] if last else []
        failed = [r.source for r in records if r.trigger == self.machine.spec.interrupt]
        current = self.machine.state
        heat = None
        if profile is not None:
            heat = state_shares(profile_rows(profile))
            records, failed, current = [], [], None
        if level is None:
            hottest = max(heat, key=heat.get) if heat else None
            level = auto_level(self.machine.spec, failed[-1] if failed else hottest or current)
        out = render(fmt, current=current, path=records, show_interrupts=show_interrupts, level=level, heat=heat)
        if path is None:
            return out
        with open(path, "wb" if isinstance(out, bytes) else "w") as f:
            f.write(out)
        return Path(path)

    def writer(self, log_dir=None):
        """The run's shared TensorBoard `SummaryWriter` for `log_dir`, writing `<log_dir>/<running_id>`.

        Created on first use; every logging callback asking for the same folder gets the same writer, and
        `close()` flushes and closes it. `log_dir=None` means the folder already in use (else the first
        `log_dir` of an attached callback, else './logs'). Non-main ranks get a writer that does nothing.
        """
        return self._writers.get(log_dir)

    def close(self) -> None:
        """Flush logs, remove hooks and release what the trainer created (idempotent)."""
        if self._closed:
            return
        self._check_open("close")
        self._closed = True
        errors = []
        every_step([
            lambda: errors.extend(self._hooks.close(self)),  # every callback's on_close, even if one fails
            self._writers.close,  # after on_close, so callbacks can still write their last records
            self._console.close, self._dist.close, self._opts.unbind_updates], errors)
        if errors:
            raise errors[0]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _check_open(self, call: str):
        """Refuse `call` on a closed trainer, or while another call runs (another thread, a callback)."""
        check_call(call, self._closed, self._driver.running, self._driver.running_thread)



class Trainer(TrainerBase):
    """The ready-to-use trainer: `TrainerBase` as it is; subclass `TrainerBase` for your own steps."""


