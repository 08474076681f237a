"""GENERATED from spec/loop.py by `make gen` (python -m spec): do not edit by hand."""

# fmt: off
import enum

__all__ = ["ActionName", "CallbackHooks", "Event", "GuardName", "StateName", "TriggerName"]


class Event(str, enum.Enum):
    """Loop events; each value is the name of the `Callback` method that handles it."""

    BEFORE_FIT = 'on_before_fit'
    """fit() starts; `epochs` is the epoch target."""
    BEFORE_EPOCH = 'on_before_epoch'
    """An epoch starts (0-based `epoch_idx`, as in 0.6; `trainer.loop.epoch` is 1-based)."""
    BEFORE_TRAIN_EPOCHS = 'on_before_train_epochs'
    """The training stage starts."""
    BEFORE_TRAIN_EPOCH = 'on_before_train_epoch'
    """A training task starts."""
    BEFORE_TRAIN_BATCH = 'on_before_train_batch'
    """A training batch is on the device; `batch_idx` is 0-based within the task (loop.batch_idx: 1-based)."""
    BEFORE_TRAIN_FORWARD = 'on_before_train_forward'
    """The model's forward pass is about to run."""
    AFTER_TRAIN_FORWARD = 'on_after_train_forward'
    """The forward pass returned `model_out`."""
    BEFORE_BACKWARD = 'on_before_backward'
    """`loss` is about to be backpropagated."""
    AFTER_BACKWARD = 'on_after_backward'
    """`loss` was backpropagated."""
    BEFORE_OPTIMIZE = 'on_before_optimize'
    """Gradients are unscaled and normalised; optimizers `optimize_index` are about to step."""
    SKIP_OPTIMIZE = 'on_skip_optimize'
    """Optimizer `optimize_index` skipped its step (inf/NaN gradients)."""
    AFTER_OPTIMIZE = 'on_after_optimize'
    """The update was applied."""
    TRAIN_METRICS = 'on_train_metrics'
    """Training metrics of a batch are about to be computed."""
    AFTER_TRAIN_BATCH = 'on_after_train_batch'
    """A training batch finished with its batch `metrics`."""
    AFTER_TRAIN_EPOCH = 'on_after_train_epoch'
    """A training task finished."""
    AFTER_TRAIN_EPOCHS = 'on_after_train_epochs'
    """The training stage finished with its `metrics`."""
    BEFORE_VAL_EPOCHS = 'on_before_val_epochs'
    """The validation stage starts."""
    BEFORE_VAL_EPOCH = 'on_before_val_epoch'
    """A validation task starts."""
    BEFORE_VAL_BATCH = 'on_before_val_batch'
    """A validation batch is on the device."""
    BEFORE_VAL_FORWARD = 'on_before_val_forward'
    """The validation forward pass is about to run."""
    AFTER_VAL_FORWARD = 'on_after_val_forward'
    """The validation forward pass returned."""
    VAL_METRICS = 'on_val_metrics'
    """Validation metrics of a batch are about to be computed."""
    AFTER_VAL_BATCH = 'on_after_val_batch'
    """A validation batch finished."""
    AFTER_VAL_EPOCH = 'on_after_val_epoch'
    """A validation task finished."""
    AFTER_VAL_EPOCHS = 'on_after_val_epochs'
    """The validation stage finished with its `metrics`."""
    AFTER_EPOCH = 'on_after_epoch'
    """An epoch finished; callbacks may request checkpoints or a stop here."""
    AFTER_FIT = 'on_after_fit'
    """fit() finished (target reached or stopped early)."""
    BEFORE_TEST_EPOCHS = 'on_before_test_epochs'
    """The test stage starts."""
    BEFORE_TEST_EPOCH = 'on_before_test_epoch'
    """A test task starts."""
    BEFORE_TEST_BATCH = 'on_before_test_batch'
    """A test batch is on the device."""
    BEFORE_TEST_FORWARD = 'on_before_test_forward'
    """The test forward pass is about to run."""
    AFTER_TEST_FORWARD = 'on_after_test_forward'
    """The test forward pass returned."""
    TEST_METRICS = 'on_test_metrics'
    """Test metrics of a batch are about to be computed."""
    AFTER_TEST_BATCH = 'on_after_test_batch'
    """A test batch finished."""
    AFTER_TEST_EPOCH = 'on_after_test_epoch'
    """A test task finished."""
    AFTER_TEST_EPOCHS = 'on_after_test_epochs'
    """The test stage finished."""
    ROLLBACK = 'on_rollback'
    """An exception interrupted the loop in `state`; the open window was discarded."""
    INTERRUPTED = 'on_interrupted'
    """fit() or test() was interrupted and rolled back; `exception` is re-raised after this hook."""


class StateName(str, enum.Enum):
    """Names of the loop's states; each value is the name `spec/loop.py` gives it."""

    __str__ = str.__str__
    __format__ = str.__format__

    IDLE = 'idle'
    """No fit or test is running; fit() and test() may be called."""
    FIT_RUNNING = 'fit_running'
    """Inside fit(), between epochs."""
    FIT_DONE = 'fit_done'
    """fit() reached its epoch target or an early stop; after-fit hooks run."""
    EPOCH_RUNNING = 'epoch_running'
    """An epoch has begun; its training stage is next."""
    EPOCH_TRAINED = 'epoch_trained'
    """The epoch's training stage is done; validation runs next if it is due."""
    EPOCH_END = 'epoch_end'
    """The epoch's stages are done; after-epoch hooks request checkpoints or a stop."""
    STAGE_TRAIN = 'stage_train'
    """The training stage, between its tasks."""
    STAGE_VAL = 'stage_val'
    """The validation stage, between its tasks."""
    STAGE_TEST = 'stage_test'
    """The test stage (test()), between its tasks."""
    TASK_TRAIN = 'task_train'
    """A training task iterates its DataLoader, between accumulation windows."""
    TASK_VAL = 'task_val'
    """A validation task iterates its DataLoader, between batches."""
    TASK_TEST = 'task_test'
    """A test task iterates its DataLoader, between batches."""
    TASK_SPENT = 'task_spent'
    """The training task reads no further batch: the update budget is reached or a stop was requested (update clock)."""
    WINDOW_OPEN = 'window_open'
    """Inside an accumulation window, between its micro-batches."""
    STEP_FORWARD = 'step_forward'
    """A training micro-batch's step method runs the forward pass and the loss."""
    STEP_BACKWARD = 'step_backward'
    """The step has backpropagated a loss into the accumulated gradients."""
    STEP_OPTIMIZED = 'step_optimized'
    """The step has applied the window's update; gradients are zeroed."""
    VAL_BATCH = 'val_batch'
    """One validation batch is evaluated without gradients."""
    TEST_BATCH = 'test_batch'
    """One test batch is evaluated without gradients."""
    OPTIMIZE_UNSCALED = 'optimize_unscaled'
    """Gradients are unscaled (fp16) and normalised by the window's samples."""
    OPTIMIZE_CLIPPED = 'optimize_clipped'
    """Gradients are clipped; optimizers step in turn (the last one stepped)."""
    OPTIMIZE_SKIPPED = 'optimize_skipped'
    """The last optimizer skipped its step: its gradients were not finite."""
    FIT_STATISTICS = 'fit_statistics'
    """The weight averages' BatchNorm statistics are recomputed over their data (SWACallback's pass), after the fit's
    last epoch."""
    PREEMPTED = 'preempted'
    """A listed signal stopped the fit at a commit point, after its snapshot; fit() raises Preempted."""
    ROLLBACK = 'rollback'
    """An exception interrupted the loop; the open window is being discarded."""


class TriggerName(str, enum.Enum):
    """Names of the loop's triggers; each value is the name `spec/loop.py` gives it."""

    __str__ = str.__str__
    __format__ = str.__format__

    FIT = 'fit'
    """fit() was called."""
    TEST = 'test'
    """test() was called."""
    NEXT_EPOCH = 'next_epoch'
    """The fit decides whether another epoch runs."""
    FINISH = 'finish'
    """fit() returns to idle after its after-fit hooks."""
    BEGIN_TRAIN = 'begin_train'
    """The epoch starts its training stage."""
    VALIDATE = 'validate'
    """The epoch's training stage ended, or (update clock) a training window committed or a training task starts:
    validation runs if it is due."""
    END_EPOCH = 'end_epoch'
    """After-epoch hooks ran; epoch-wise schedulers step and requested checkpoints are saved."""
    BEGIN_TASK = 'begin_task'
    """A stage starts one of its tasks (EpochTask)."""
    END_TASK = 'end_task'
    """A task's DataLoader is exhausted; its metrics are final."""
    END_STAGE = 'end_stage'
    """All tasks of a stage are done."""
    BEGIN_WINDOW = 'begin_window'
    """A training task opens an accumulation window."""
    BEGIN_BATCH = 'begin_batch'
    """A batch (micro-batch in training) was read and moved to the device."""
    BACKWARD = 'backward'
    """The step backpropagates a loss (self.loss, self.backward)."""
    OPTIMIZE = 'optimize'
    """The step asks for an update (self.optimize, or self.loss with do_optimize)."""
    CLIP = 'clip'
    """The unscaled gradients are clipped by the registered clippers."""
    APPLY_UPDATE = 'apply_update'
    """One optimizer steps, or skips when its gradients are not finite."""
    FINISH_UPDATE = 'finish_update'
    """The update is done: the scaler updates and gradients are zeroed."""
    END_BATCH = 'end_batch'
    """The batch's step returned its metrics."""
    ACCUMULATE_STEP = 'accumulate_step'
    """An inner micro-batch as one fused edge: forward, loss, backward."""
    UPDATE_STEP = 'update_step'
    """A window's last micro-batch as one fused edge: forward, loss, backward, the update."""
    SKIP_STEP = 'skip_step'
    """A window's last micro-batch as one fused edge whose update was skipped (not finite)."""
    WINDOW_STEP = 'window_step'
    """A one-batch window (no accumulation) that updated, as one fused edge."""
    WINDOW_SKIP_STEP = 'window_skip_step'
    """A one-batch window whose update was skipped (not finite), as one fused edge."""
    SNAPSHOT = 'snapshot'
    """A commit point passed (a window's update, an epoch's end) while a SnapshotCallback is attached: a snapshot is
    written if one is due, and a signal it listens for stops the fit."""
    RECOMPUTE_STATISTICS = 'recompute_statistics'
    """The fit's epochs are done: a weight average whose BatchNorm statistics are due recomputes them over its data."""
    END_STATISTICS = 'end_statistics'
    """The BatchNorm pass read its batches."""
    INTERRUPT = 'interrupt'
    """An exception or KeyboardInterrupt escaped the running loop."""
    RECOVER = 'recover'
    """Rollback is done; the trainer is ready for fit() or test() again."""


class GuardName(str, enum.Enum):
    """Names of the loop's guards; each value is the name `spec/loop.py` gives it."""

    __str__ = str.__str__
    __format__ = str.__format__

    EPOCHS_REMAINING = 'epochs_remaining'
    """Completed epochs are fewer than the epoch target."""
    STOP_REQUESTED = 'stop_requested'
    """A callback requested a stop (early stopping) during this fit."""
    VAL_DUE = 'val_due'
    """Validation tasks exist and this epoch is a multiple of val_freq."""
    WINDOW_BOUNDARY = 'window_boundary'
    """This micro-batch closes its window (the k-th batch, or the task's last batch)."""
    GRADS_FINITE = 'grads_finite'
    """The current optimizer's gradients are finite (the scaler found no inf/NaN)."""
    HAS_SAVE_REQUESTS = 'has_save_requests'
    """Callbacks requested checkpoint saves during this epoch's end."""
    SNAPSHOT_DUE = 'snapshot_due'
    """A SnapshotCallback wants a snapshot at this commit point (its update count or minutes came round, an epoch ended,
    or a signal it listens for arrived), agreed by every rank."""
    STOP_SIGNALLED = 'stop_signalled'
    """A signal a SnapshotCallback listens for arrived (on any rank): the fit stops here."""
    UPDATE_BUDGET_REACHED = 'update_budget_reached'
    """Trainer(max_updates=N) is given, the run committed N updates (skipped ones included) and no epoch interrupted
    after them waits for its end."""
    TASK_STOPS = 'task_stops'
    """The update clock stops the training task here: the update budget is reached or a callback requested a stop."""
    VAL_POINT_DUE = 'val_point_due'
    """fit(val_every_n_updates=M) with validation data: the committed update count is a multiple of M, reaches the
    budget (unless val_at_end=False) or is 0 with val_at_start=True, and the records hold no validation at this count
    yet."""
    VAL_POINT_OPEN = 'val_point_open'
    """The validation stage runs at an update point inside a training task, not at an epoch's end."""
    RESUME_PENDING = 'resume_pending'
    """Trainer(resume=...) asked for a resume that has not happened yet."""
    CLOSURE_GIVEN = 'closure_given'
    """The step handed the update a closure (self.optimize(closure=...)): the optimizer evaluates the loss and its
    gradients itself, as LBFGS does."""
    GRADS_PRESENT = 'grads_present'
    """The optimizers named for the update hold gradients: the step backpropagated its loss itself (loss.backward())."""
    SCALES_LOSSES = 'scales_losses'
    """A GradScaler scales the losses (precision='fp16')."""
    STATISTICS_DUE = 'statistics_due'
    """A weight average with BatchNorm layers moved in this run and recomputes their statistics at the fit's end
    (SWACallback with bn_update=True, buffers='copy')."""


class ActionName(str, enum.Enum):
    """Names of the loop's actions; each value is the name `spec/loop.py` gives it."""

    __str__ = str.__str__
    __format__ = str.__format__

    RESUME_CHECKPOINT = 'resume_checkpoint'
    """Load the checkpoint resume= asks for (or start fresh), with the run's records and, for a finished run, its
    end."""
    START_EPOCH = 'start_epoch'
    """Advance the 1-based epoch counter and set distributed samplers' epoch."""
    REPORT_EARLY_STOP = 'report_early_stop'
    """Record and print why the fit stopped before its epoch target."""
    OPEN_WINDOW = 'open_window'
    """Reset the window's counters, sample count and update flags (the window's meters open with its first batch)."""
    COUNT_MICRO_BATCH = 'count_micro_batch'
    """Count the micro-batch in its window: its position, the window's samples and the size of the window's first batch
    (the loss share's base)."""
    SYNC_GRADIENTS = 'sync_gradients'
    """DDP: synchronise gradients in this backward (the window's updating micro-batch)."""
    SKIP_GRADIENT_SYNC = 'skip_gradient_sync'
    """DDP: no_sync for this backward; gradients accumulate locally."""
    KEEP_OWN_GRADIENTS = 'keep_own_gradients'
    """The step backpropagated its loss itself: the update takes the window's gradients as the step made them, without
    the window's sample normalisation."""
    UNSCALE_GRADIENTS = 'unscale_gradients'
    """Unscale fp16 gradients, normalise by the window's samples, check finiteness."""
    CLIP_GRADIENTS = 'clip_gradients'
    """Run the gradient clippers (GradClipCallback) on the unscaled gradients."""
    STEP_OPTIMIZER = 'step_optimizer'
    """Step the optimizer, then its step-wise scheduler."""
    SKIP_OPTIMIZER = 'skip_optimizer'
    """Leave the optimizer and its step-wise scheduler untouched; run skip hooks."""
    UPDATE_SCALER = 'update_scaler'
    """Hand this update's inf checks to the GradScaler; its scale changes once per iteration."""
    ZERO_GRAD = 'zero_grad'
    """Zero the updated optimizers' gradients (set_to_none)."""
    REMEMBER_POSITION = 'remember_position'
    """Keep what a refit continues from besides the batch count: torch's generator states and a stateful DataLoader's
    position, as they are after the window's update."""
    AVERAGE_UPDATE = 'average_update'
    """Move the weight averages (EMACallback; SWACallback from start_update) by the update just applied, as part of its
    commit; nothing when every optimizer of the update skipped (inf/NaN)."""
    COMMIT_UPDATE = 'commit_update'
    """Commit the window's update: the data position moves past the window and its loss sums and patches join the
    task's; rollback never undoes it."""
    RELEASE_INTERRUPTS = 'release_interrupts'
    """End the update's critical section: a Ctrl-C held since unscale_gradients is raised now, after the commit."""
    CLOSE_WINDOW = 'close_window'
    """Fold the window's loss sums and metric patches into the task's."""
    STEP_EPOCH_SCHEDULERS = 'step_epoch_schedulers'
    """Step epoch-wise LR schedulers (with the monitored loss if so configured); with validation points
    (val_every_n_updates) at each point, with its validation loss, not at epochs' ends nor at the point before the first
    update (val_at_start)."""
    AVERAGE_EPOCH = 'average_epoch'
    """Move the epoch-wise weight averages (SWACallback) by the epoch's weights and step their learning-rate schedule,
    before the epoch's checkpoints are written (undone if the epoch does not commit)."""
    SAVE_CHECKPOINTS = 'save_checkpoints'
    """Write the checkpoints requested by callbacks at this epoch's end."""
    COMMIT_EPOCH = 'commit_epoch'
    """Commit the epoch: the completed-epoch count, its records and the epoch-wise schedulers' steps; rollback returns
    here at the latest."""
    OPEN_VAL_POINT = 'open_val_point'
    """Mark the validation stage as an update point's: it returns to the training task."""
    COMMIT_VAL_POINT = 'commit_val_point'
    """Commit the validation point: its row (the update count and the validation metrics) joins the run's records;
    rollback never undoes it."""
    SAVE_SNAPSHOT = 'save_snapshot'
    """Write a snapshot of this commit point: the training state, the data position inside the epoch, the task meters
    and the random states (every rank's, written by rank 0)."""
    STOP_ON_SIGNAL = 'stop_on_signal'
    """End the fit: raise Preempted (a SystemExit whose code a scheduler can requeue on); the rollback it passes through
    has nothing to discard."""
    COMMIT_STATISTICS = 'commit_statistics'
    """Commit the BatchNorm pass: the averages keep the statistics it computed; rollback never undoes them, and a
    snapshot written from here on holds them."""
    DISCARD_WINDOW = 'discard_window'
    """Drop the open window's gradients, loss sums, patches and scaler step state."""
    RESET_LOOP = 'reset_loop'
    """Clear per-run loop state so that the next fit starts a fresh window."""


class CallbackHooks:
    """One no-op method per loop event; `Callback` subclasses override the ones they need.

    `before` hooks run in callback registration order, `after` hooks in reverse order.
    """

    def on_before_fit(self, trainer, epochs):
        """fit() starts; `epochs` is the epoch target."""

    def on_before_epoch(self, trainer, train_tasks, val_tasks, epoch_idx):
        """An epoch starts (0-based `epoch_idx`, as in 0.6; `trainer.loop.epoch` is 1-based)."""

    def on_before_train_epochs(self, trainer, tasks, epoch_idx):
        """The training stage starts."""

    def on_before_train_epoch(self, trainer, task):
        """A training task starts."""

    def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
        """A training batch is on the device; `batch_idx` is 0-based within the task (loop.batch_idx: 1-based)."""

    def on_before_train_forward(self, trainer):
        """The model's forward pass is about to run."""

    def on_after_train_forward(self, trainer, model_out):
        """The forward pass returned `model_out`."""

    def on_before_backward(self, trainer, loss):
        """`loss` is about to be backpropagated."""

    def on_after_backward(self, trainer, loss):
        """`loss` was backpropagated."""

    def on_before_optimize(self, trainer, optimize_index):
        """Gradients are unscaled and normalised; optimizers `optimize_index` are about to step."""

    def on_skip_optimize(self, trainer, optimize_index):
        """Optimizer `optimize_index` skipped its step (inf/NaN gradients)."""

    def on_after_optimize(self, trainer, optimize_index):
        """The update was applied."""

    def on_train_metrics(self, trainer, loss, model_out, batch_y, task):
        """Training metrics of a batch are about to be computed."""

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        """A training batch finished with its batch `metrics`."""

    def on_after_train_epoch(self, trainer, task, metrics):
        """A training task finished."""

    def on_after_train_epochs(self, trainer, tasks, metrics, epoch_idx):
        """The training stage finished with its `metrics`."""

    def on_before_val_epochs(self, trainer, tasks, epoch_idx):
        """The validation stage starts."""

    def on_before_val_epoch(self, trainer, task):
        """A validation task starts."""

    def on_before_val_batch(self, trainer, batch_x, batch_y, batch_idx):
        """A validation batch is on the device."""

    def on_before_val_forward(self, trainer):
        """The validation forward pass is about to run."""

    def on_after_val_forward(self, trainer, model_out):
        """The validation forward pass returned."""

    def on_val_metrics(self, trainer, loss, model_out, batch_y, task):
        """Validation metrics of a batch are about to be computed."""

    def on_after_val_batch(self, trainer, metrics, batch_idx):
        """A validation batch finished."""

    def on_after_val_epoch(self, trainer, task, metrics):
        """A validation task finished."""

    def on_after_val_epochs(self, trainer, tasks, metrics, epoch_idx):
        """The validation stage finished with its `metrics`."""

    def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx):
        """An epoch finished; callbacks may request checkpoints or a stop here."""

    def on_after_fit(self, trainer):
        """fit() finished (target reached or stopped early)."""

    def on_before_test_epochs(self, trainer, tasks):
        """The test stage starts."""

    def on_before_test_epoch(self, trainer, task):
        """A test task starts."""

    def on_before_test_batch(self, trainer, batch_x, batch_y, batch_idx):
        """A test batch is on the device."""

    def on_before_test_forward(self, trainer):
        """The test forward pass is about to run."""

    def on_after_test_forward(self, trainer, model_out):
        """The test forward pass returned."""

    def on_test_metrics(self, trainer, loss, model_out, batch_y, task):
        """Test metrics of a batch are about to be computed."""

    def on_after_test_batch(self, trainer, metrics, batch_idx):
        """A test batch finished."""

    def on_after_test_epoch(self, trainer, task, metrics):
        """A test task finished."""

    def on_after_test_epochs(self, trainer, tasks, metrics):
        """The test stage finished."""

    def on_rollback(self, trainer, exception, state):
        """An exception interrupted the loop in `state`; the open window was discarded."""

    def on_interrupted(self, trainer, exception):
        """fit() or test() was interrupted and rolled back; `exception` is re-raised after this hook."""
