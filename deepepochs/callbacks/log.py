"""`LogCallback`: metrics, learning rates, the model graph, hyper-parameters and the loop's state
graph as TensorBoard event files.

Tags follow one scheme, `<metric>/<stage>`, so that a metric's train, val and test charts sit side by
side in TensorBoard's `<metric>` section:

- `<metric>/train`, `<metric>/val` (`loss/train`, `acc/val`): the epoch's stage metrics, i.e. what `fit`
  returns; step: the 1-based epoch. With `fit(val_every_n_updates=M)` the `val` values are each validation
  point's; step: its update count.
- `lr` (one optimizer, one param group) or `lr/lr_<opt>_<group>`: the learning rates the epoch used;
  step: the 1-based epoch.
- Under the update clock (`Trainer(max_updates=N)` or `fit(val_every_n_updates=M)`) every step is an update
  count: an epoch's `<metric>/train` and `lr` sit at the count its end reached, a test's at the run's count
  (`reporting.scalars.UpdateClock`), so no chart mixes epochs and updates.
- `lr/update` (one optimizer, one param group) or `lr/lr_<opt>_<group>_update`: for an optimizer with a
  step-wise scheduler (`sched_on='step'`), the learning rate each applied update used; step: that
  optimizer's updates so far (its scheduler's count, so a resumed run continues the curve). An update
  skipped by the fp16 GradScaler is not logged (it was not applied).
- `<metric>/train_batch` (`log_batch=True`): per-batch training metrics; step: training batches so far.
- `<metric>/test`: the metrics of `test()`; step: the number of completed epochs.
- `loop/state_graph`: the loop machine as Mermaid text (and a PNG image when Graphviz is installed),
  once per run; step 0.
- `loop/interrupted`: the error, the flight record and the state graph of an interrupted fit/test.

Beside the event files, `<log_dir>/<running_id>/metrics.csv` holds the same epoch, validation and test
metrics as a table, one row per epoch and stage (`deepepochs.reporting.summary_writer.CsvRecord`;
`csv=False` leaves it out).

With `hyper_params=` on the Trainer, each `test()` also writes an HParams session into the run folder
itself (not a sub-run), listing the hyper-parameters with the `<metric>/test` scalars as its metrics.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Mapping

import torch

from deepepochs.callbacks.base import Callback
from deepepochs.compat import run_tensorboard as _run_tensorboard
from deepepochs.data.batch_rules import to_device
from deepepochs.errors import ConfigError, DeepEpochsWarning
from deepepochs.fsm.events import Event
from deepepochs.fsm.render import render
from deepepochs.reporting import scalars
from deepepochs.reporting.scalars import epoch_scalars, stage_scalars, step_source, test_scalars, watch_update_rates
from deepepochs.reporting.summary_writer import CSV_FILE, DEFAULT_LOG_DIR, CsvRecord, add_hparams_record, add_png

__all__ = ["LogCallback"]


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False (got {value!r})")


class LogCallback(Callback):
    """Write a run's curves and records to TensorBoard (`tensorboard --logdir=./logs` shows them).

    Everything goes to the trainer's shared writer (`trainer.writer(log_dir)`), which writes the run folder
    `<log_dir>/<running_id>`; `fit` followed by `test` writes one run, and `trainer.close()` flushes and
    closes the writer. Only the main process writes. See the module docstring for the tags.

    Args:
        log_dir: the folder holding one sub-folder per run.
        log_graph: write the model graph (traced once with `torch.jit.trace` on `trainer.raw_model`).
        example_input: the graph's input (a tensor, or a tuple for several inputs); None uses the first
            training batch's inputs. Tracing runs one extra forward pass: buffers (BatchNorm statistics)
            and the random state are restored afterwards, so training is not changed by it.
        log_batch: also write each training batch's metrics (`<name>/train_batch`). Reading them costs a
            host-device sync per batch, so it is off by default.
        state_graph: write the loop machine once per run (`loop/state_graph`), and the crash record when
            fit/test is interrupted (`loop/interrupted`).
        csv: also write the run's metrics as a table, `<log_dir>/<running_id>/metrics.csv`: columns
            `epoch`, `stage` (train, val, test), then one per metric; one row per epoch and stage, the
            values the console prints (read it with `csv.DictReader` or `pandas.read_csv`).

    Example:
        >>> trainer = Trainer(model, F.cross_entropy, epochs=5, callbacks=[LogCallback('./logs')],
        ...                   hyper_params={'lr': 1e-3, 'batch_size': 32})
        >>> trainer.fit(train_dl, val_dl, metrics=[accuracy])
        >>> trainer.test(test_dl)   # loss/test, accuracy/test and the HParams record
        >>> trainer.close()         # flushes and closes the writer
    """

    profile_cost = "logging"  # what a profile counts its hooks as (`ProfileCallback`)

    def run_tensorboard(self, interactive: bool | None = None):
        """Start TensorBoard on this callback's log folder, as deepepochs 0.6 did: served in the foreground
        until Ctrl-C from an interactive terminal, else a warning with the command (see
        `deepepochs.compat.run_tensorboard`)."""
        return _run_tensorboard(self.log_dir or DEFAULT_LOG_DIR, interactive)

    def __init__(self, log_dir=DEFAULT_LOG_DIR, log_graph: bool = False, example_input=None,
                 log_batch: bool = False, state_graph: bool = True, csv: bool = True):
        if not isinstance(log_dir, (str, os.PathLike)):
            raise ConfigError(f"log_dir must be a folder path (got {type(log_dir).__name__}: {log_dir!r})")
        for name, value in (("log_graph", log_graph), ("log_batch", log_batch), ("state_graph", state_graph),
                            ("csv", csv)):
            _check_bool(name, value)
        if example_input is not None and not log_graph:
            raise ConfigError("example_input is only used to draw the model graph; pass log_graph=True too")
        if isinstance(example_input, Mapping):
            raise ConfigError("example_input must be a tensor or a tuple of positional inputs (got a dict):"
                              " torch.jit.trace, which draws the graph, takes positional inputs only")
        self.log_dir = os.fspath(log_dir)
        self.log_graph = log_graph
        self.example_input = example_input
        self.log_batch = log_batch
        self.state_graph = state_graph
        self.csv = csv
        self._reset()

    @property
    def idle_hooks(self) -> frozenset[str]:
        """The per-batch hooks the current settings leave unused (read when attached to a trainer): without
        them training batches take the fused edges."""
        return frozenset(name for name, used in ((Event.BEFORE_TRAIN_BATCH.value, self.log_graph),
                                                 (Event.AFTER_TRAIN_BATCH.value, self.log_batch)) if not used)

    def _reset(self):
        self._graph_pending = self.log_graph
        self._state_graph_done = not self.state_graph
        self._update_hooks = []
        self._batch_step = 0
        self._epoch_base = self._task_base = None
        self._stage_tasks = []
        self._table = None

    def writer(self, trainer):
        """The trainer's shared writer for this callback's `log_dir`."""
        return trainer.writer(self.log_dir)

    # ---- hooks ----
    def on_attach(self, trainer):
        """A callback instance starts afresh with each trainer it is attached to."""
        self._reset()

    def on_before_fit(self, trainer, epochs):
        """Write the state graph (first run only) and the graph of `example_input` when given."""
        self._begin_run(trainer)
        if self._graph_pending and self.example_input is not None:
            self._write_graph(trainer, to_device(self.example_input, trainer.device))
        self._watch_updates(trainer)

    def on_after_fit(self, trainer):
        """Stop logging per-update learning rates (the optimizers may be used elsewhere after the fit)."""
        self._unwatch_updates()

    def on_close(self, trainer):
        self._unwatch_updates()

    def on_before_test_epochs(self, trainer, tasks):
        """A test without a fit before it still records the state graph."""
        self._begin_run(trainer)

    def on_before_train_epochs(self, trainer, tasks, epoch_idx):
        """With `log_batch`: place the per-batch steps so that epoch `e` starts after `(e - 1)` epochs of
        batches; a resumed run then continues its curve instead of overwriting the start."""
        if not self.log_batch:
            return
        self._stage_tasks = list(tasks)
        try:
            self._epoch_base = epoch_idx * sum(len(task.data) for task in tasks)
        except TypeError:  # an iterable without len(): count on from the last step
            self._epoch_base = None

    def on_before_train_epoch(self, trainer, task):
        """With `log_batch`: the batches of the stage's earlier tasks come before this task's."""
        if self.log_batch and self._epoch_base is not None:
            earlier = self._stage_tasks[: self._stage_tasks.index(task)]
            self._task_base = self._epoch_base + sum(len(t.data) for t in earlier)

    def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
        """Trace the model graph on the first training batch when no `example_input` was given."""
        if self._graph_pending:
            self._write_graph(trainer, batch_x)

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        """With `log_batch`: the batch's metrics (reading them is the host-device sync)."""
        if not self.log_batch:
            return
        # batch_idx is 0-based within the task and, on a resumed task, continues after the skipped batches;
        # steps count from 1
        self._batch_step = self._batch_step + 1 if self._epoch_base is None else self._task_base + batch_idx + 1
        if not trainer.is_main_process:
            return
        writer = self.writer(trainer)
        for name, value in metrics.items():
            writer.add_scalar(f"{name}/train_batch", value, self._batch_step)

    def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx):
        """The epoch's train and val metrics and the learning rates it used (epoch-wise schedulers step
        after this hook)."""
        if not trainer.is_main_process:
            return
        writer = self.writer(trainer)
        step = step_source(trainer).epoch_step(trainer, epoch_idx)
        for tag, value in epoch_scalars(train_metrics, val_metrics, trainer.opt.lrs()).items():
            writer.add_scalar(tag, value, step)
        for stage, metrics in (("train", train_metrics), ("val", val_metrics)):
            self._add_row(trainer, epoch_idx + 1, stage, metrics)
        writer.flush()  # so that a TensorBoard watching the run sees each epoch as it ends

    def on_after_val_epochs(self, trainer, tasks, metrics, epoch_idx):
        """A validation point of the update clock (`fit(val_every_n_updates=M)`): its metrics at the step of
        its update count, `<metric>/val` (the epoch's end then logs none), and with a `ProfileCallback`
        where the time since the previous point went (`profile/<category>`)."""
        step = step_source(trainer).val_point_step(trainer)
        if not trainer.is_main_process or step is None:
            return
        writer = self.writer(trainer)
        for tag, value in {**stage_scalars("val", metrics), **scalars.profile_scalars(trainer, step)}.items():
            writer.add_scalar(tag, value, step)
        writer.flush()

    def on_after_test_epochs(self, trainer, tasks, metrics):
        """Test metrics at the completed-epoch step, and the HParams session when the trainer has
        `hyper_params`."""
        if not trainer.is_main_process:
            return
        writer = self.writer(trainer)
        step = step_source(trainer).test_step(trainer)
        tagged = test_scalars(metrics)
        if trainer.hyper_params:
            add_hparams_record(writer, trainer.hyper_params, tagged)
        for tag, value in tagged.items():
            writer.add_scalar(tag, value, step)
        self._add_row(trainer, trainer.loop.completed_epochs, "test", metrics)
        writer.flush()

    def on_interrupted(self, trainer, exception):
        """Record where the loop failed: the error, the flight record and the state graph at the crash."""
        self._unwatch_updates()
        if not (self.state_graph and trainer.is_main_process):
            return
        writer = self.writer(trainer)
        text = (f"**{type(exception).__name__}**: {exception}\n\n"
                f"Interrupted in state `{trainer.loop.last_error_state}`.\n\n"
                f"```\n{trainer.machine.flight_record()}\n```\n\n"
                f"```mermaid\n{trainer.state_graph('mermaid')}```\n")
        writer.add_text("loop/interrupted", text, trainer.loop.epoch)
        writer.flush()

    # ---- helpers ----
    def _add_row(self, trainer, epoch: int, stage: str, metrics) -> None:
        """One row of the run's CSV table (main process; a stage that reported nothing has none)."""
        if not (self.csv and metrics):
            return
        path = os.path.join(os.path.abspath(self.log_dir), str(trainer.running_id), CSV_FILE)
        if self._table is None or self._table.path != path:  # a resume may rename the run
            self._table = CsvRecord(path)
        self._table.add(epoch, stage, metrics)

    def _watch_updates(self, trainer):
        """Log the learning rate of every applied update of each optimizer with a step-wise scheduler
        (`reporting.scalars.watch_update_rates`)."""
        self._unwatch_updates()

        def log(step, rates, _scheduler):
            writer = self.writer(trainer)
            for tag, value in rates.items():
                writer.add_scalar(tag, value, step)

        self._update_hooks = watch_update_rates(trainer, log)

    def _unwatch_updates(self):
        for handle in self._update_hooks:
            handle.remove()
        self._update_hooks = []

    def _begin_run(self, trainer):
        if self._state_graph_done:
            return
        self._state_graph_done = True
        if not trainer.is_main_process:
            return
        writer = self.writer(trainer)
        # The static machine (no state highlighted): the loop this run executes.
        writer.add_text("loop/state_graph", f"```mermaid\n{render('mermaid')}```\n", 0)
        if shutil.which("dot") is not None:
            try:
                add_png(writer, "loop/state_graph", render("png"), 0)
            except Exception as e:  # a broken Graphviz install costs the picture, not the run
                warnings.warn(f"LogCallback could not render the state graph with Graphviz: {e!r}",
                              DeepEpochsWarning, stacklevel=2)

    def _write_graph(self, trainer, inputs):
        self._graph_pending = False
        if trainer.dist.shards_model:  # FSDP: a traced forward would all-gather on rank 0 alone and hang
            if trainer.is_main_process:
                warnings.warn("LogCallback(log_graph=True) does not draw the graph of a model sharded with"
                              " strategy='fsdp': tracing it would run the parameters' all-gathers on rank 0"
                              " alone; the graph is skipped (train with strategy='ddp' or in one process to"
                              " draw it)", DeepEpochsWarning, stacklevel=2)
            return
        if not trainer.is_main_process:
            return
        if isinstance(inputs, Mapping):
            warnings.warn("LogCallback(log_graph=True) cannot trace a model called with keyword inputs (a"
                          " dict batch); pass example_input=(x1, x2, ...) for its positional form",
                          DeepEpochsWarning, stacklevel=2)
            return
        model = trainer.raw_model
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        # Tracing runs a forward pass in the model's current (training) mode: keep BatchNorm statistics
        # and the random state as they were, so logging the graph does not change the training run.
        buffers = [(b, b.detach().clone()) for b in model.buffers()]
        dev = trainer.device
        devices = []
        if dev.type == "cuda":
            devices = [dev.index if dev.index is not None else torch.cuda.current_device()]
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore", torch.jit.TracerWarning)
                # add_graph is built on torch.jit.trace, which recent PyTorch marks deprecated; TensorBoard
                # has no other way to draw a graph, so that notice is not the user's concern here.
                warnings.filterwarnings("ignore", r"`torch\.jit\.trace", DeprecationWarning)
                self.writer(trainer).add_graph(model, args, use_strict_trace=False)
        except Exception as e:  # an untraceable model costs the graph, not the run
            warnings.warn(f"LogCallback could not trace the model graph ({type(e).__name__}: {e}); pass"
                          " log_graph=False, or an example_input the model can be traced with",
                          DeepEpochsWarning, stacklevel=2)
        finally:
            with torch.no_grad():
                for buf, saved in buffers:
                    buf.copy_(saved)
