"""GENERATED from spec/loop.py by `make gen` (python -m spec): do not edit by hand."""

# fmt: off
import enum

__all__ = ["CallbackHooks", "Event"]


class Event(str, enum.Enum):
    """Loop events; each value is the name of the `Callback` method that handles it."""

    BEFORE_FIT = 'on_before_fit'
    """fit() starts; `epochs` is the epoch target."""
    BEFORE_EPOCH = 'on_before_epoch'
    """An epoch starts (1-based `epoch_idx`)."""
    BEFORE_TRAIN_EPOCHS = 'on_before_train_epochs'
    """The training stage starts."""
    BEFORE_TRAIN_EPOCH = 'on_before_train_epoch'
    """A training task starts."""
    BEFORE_TRAIN_BATCH = 'on_before_train_batch'
    """A training batch is on the device; `batch_idx` is 1-based within the task."""
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


class CallbackHooks:
    """One no-op method per loop event; `Callback` subclasses override the ones they need.

    `before` hooks run in callback registration order, `after` hooks in reverse order.
    """

    def on_before_fit(self, trainer, epochs):
        """fit() starts; `epochs` is the epoch target."""

    def on_before_epoch(self, trainer, train_tasks, val_tasks, epoch_idx):
        """An epoch starts (1-based `epoch_idx`)."""

    def on_before_train_epochs(self, trainer, tasks, epoch_idx):
        """The training stage starts."""

    def on_before_train_epoch(self, trainer, task):
        """A training task starts."""

    def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
        """A training batch is on the device; `batch_idx` is 1-based within the task."""

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
