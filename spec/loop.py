"""The training loop of deepepochs, as data. This file is the single source of truth for the loop order.

Run `make gen` after editing it: the generator renders `deepepochs/fsm/tables.py` and
`deepepochs/fsm/events.py`; `make check-gen` (CI) fails when they are stale.

Reading guide: a micro-batch of training goes
`window_open --begin_batch--> step_forward --backward--> step_backward --optimize-->` either back to
`step_backward` (the window is not complete: gradients accumulate) or through the optimize layer
(`optimize_unscaled --clip--> optimize_clipped --apply_update (step|skip per optimizer)--> ...
--finish_update--> step_optimized`), then `--end_batch-->` the next micro-batch or the closed window.
A custom step that backpropagates its loss itself (`loss.backward()`) or hands a closure optimizer its
closure (`self.optimize(closure=...)`) fires `optimize` from `step_forward`: `grads_present` and
`closure_given` say which, and error edges refuse what cannot work (nothing backpropagated, fp16 without
`self.backward(loss)`, a closure inside an accumulation window).

Fused edges: with the default step, one optimizer and no callback hook inside a micro-batch, nothing can
observe a micro-batch's inner states, so the batch loop runs code compiled from the fused paths for the
trainer's configuration (`deepepochs.engine.compiled`) and records one edge per micro-batch instead of four
to eight: `window_open --accumulate_step--> window_open` for an inner micro-batch,
`window_open --update_step|skip_step--> task_train` for the window's last one (the update applied, or
skipped because the gradients or the loss were not finite), and
`task_train --window_step|window_skip_step--> task_train` for a one-batch window (no accumulation:
begin_window and update_step or skip_step in one). Each fused edge names the edges it stands for and the
guard outcomes along them; `Spec.validate` walks that path. `fuse_steps=False` takes every edge.

Commit points: an action marked `commit=True` (`commit_update` after a window's update, `commit_epoch` at
the epoch's end) is where work becomes permanent: rollback after an interrupt discards only what was done
since the last commit, never anything before it. A commit action is the last action of its edge but for
actions marked `after_commit=True` (`release_interrupts`, which raises a Ctrl-C held during the update once
the update is committed); `Spec.validate` checks it. `Spec.commit_edges()` lists the edges that commit,
fused ones included.

Snapshots: with a `SnapshotCallback` attached, every commit point (after a committed window, in `task_train`;
after an epoch's commit, in `fit_running`) fires the hot trigger `snapshot`: `save_snapshot` runs when
`snapshot_due`, and `stop_signalled` (a listed signal arrived, on any rank) leads to `preempted`, whose
`stop_on_signal` raises `Preempted`; the interrupt edge then rolls back nothing. A signal that arrives
after the fit's last commit point (while its snapshot is written, in `on_after_fit`) fires `snapshot` once
more, from `fit_done`, where `stop_signalled` alone decides: the fit stops without another snapshot. Once a
signal arrived no batch is fetched: at a window's start the fit stops at that commit point (`task_train`);
inside an open window (`window_open`) `snapshot` drops the window and stops at the last commit point. In
validation (`task_val`) batches are fetched while they can be; a fetch the signal made fail (it killed the
DataLoader's workers) fires `snapshot`, which stops at the last commit point, the epoch's last update. Without
the callback the trigger is never fired.

The BatchNorm pass: a weight average that recomputes its BatchNorm statistics at the fit's end
(`SWACallback`) fires `recompute_statistics` from `fit_done`; `statistics_due` (the average moved) leads into
`fit_statistics`, where the pass reads its batches as a training task does, and `end_statistics` commits it
(`commit_statistics`). A listed signal during the pass fires `snapshot` there: the averages go back to the
last epoch's end, its snapshot is written, the fit stops, and the resumed run runs the pass again.

The update clock: with `Trainer(max_updates=N)` or `fit(val_every_n_updates=M)`, every committed window (after
its snapshot, if any) and every training task's start fire the trigger `validate` in `task_train` (hot:
once per update).
`val_point_due` (every M-th committed update, the one that reaches the budget unless `val_at_end=False`, and
with `val_at_start=True` update 0 at the first task's start, unless the records already hold that count's
validation) leads into `stage_val`, whose `end_stage` returns to the training task
(`val_point_open`), committing the validation point's row; `task_stops` (the budget is reached, or a callback
requested a stop) leads to `task_spent`: the task reads no further batch, and `next_epoch` ends the fit on
`update_budget_reached`. Without the clock the trigger is never fired.
"""

from deepepochs.fsm.schema import Action, Guard, Hook, Spec, State, Transition, Trigger

S = State
STATES = [
    S("idle", "fit", "No fit or test is running; fit() and test() may be called.", idle=True, running=False),
    S("fit_running", "fit", "Inside fit(), between epochs."),
    S("fit_done", "fit", "fit() reached its epoch target or an early stop; after-fit hooks run."),
    S("epoch_running", "epoch", "An epoch has begun; its training stage is next."),
    S("epoch_trained", "epoch", "The epoch's training stage is done; validation runs next if it is due."),
    S("epoch_end", "epoch", "The epoch's stages are done; after-epoch hooks request checkpoints or a stop."),
    S("stage_train", "stage", "The training stage, between its tasks."),
    S("stage_val", "stage", "The validation stage, between its tasks.", cost="validation"),
    S("stage_test", "stage", "The test stage (test()), between its tasks.", cost="validation"),
    S("task_train", "task", "A training task iterates its DataLoader, between accumulation windows.", cost="data"),
    S("task_val", "task", "A validation task iterates its DataLoader, between batches.", cost="validation"),
    S("task_test", "task", "A test task iterates its DataLoader, between batches.", cost="validation"),
    S("task_spent", "task", "The training task reads no further batch: the update budget is reached or a stop was"
      " requested (update clock)."),
    S("window_open", "window", "Inside an accumulation window, between its micro-batches.", cost="data"),
    S("step_forward", "step", "A training micro-batch's step method runs the forward pass and the loss.",
      cost="forward"),
    S("step_backward", "step", "The step has backpropagated a loss into the accumulated gradients.", cost="backward"),
    S("step_optimized", "step", "The step has applied the window's update; gradients are zeroed.", cost="optimizer"),
    S("val_batch", "step", "One validation batch is evaluated without gradients.", cost="validation"),
    S("test_batch", "step", "One test batch is evaluated without gradients.", cost="validation"),
    S("optimize_unscaled", "optimize", "Gradients are unscaled (fp16) and normalised by the window's samples.",
      cost="optimizer"),
    S("optimize_clipped", "optimize", "Gradients are clipped; optimizers step in turn (the last one stepped).",
      cost="optimizer"),
    S("optimize_skipped", "optimize", "The last optimizer skipped its step: its gradients were not finite.",
      cost="optimizer"),
    S("fit_statistics", "stage", "The weight averages' BatchNorm statistics are recomputed over their data"
      " (SWACallback's pass), after the fit's last epoch.", cost="validation"),
    S("preempted", "fit", "A listed signal stopped the fit at a commit point, after its snapshot; fit() raises"
      " Preempted."),
    S("rollback", "rollback", "An exception interrupted the loop; the open window is being discarded.",
      running=False),
]

T = Trigger
TRIGGERS = [
    T("fit", "fit() was called."),
    T("test", "test() was called."),
    T("next_epoch", "The fit decides whether another epoch runs."),
    T("finish", "fit() returns to idle after its after-fit hooks."),
    T("begin_train", "The epoch starts its training stage."),
    T("validate", "The epoch's training stage ended, or (update clock) a training window committed or a training"
      " task starts: validation runs if it is due.", hot=True),
    T("end_epoch", "After-epoch hooks ran; epoch-wise schedulers step and requested checkpoints are saved."),
    T("begin_task", "A stage starts one of its tasks (EpochTask)."),
    T("end_task", "A task's DataLoader is exhausted; its metrics are final."),
    T("end_stage", "All tasks of a stage are done."),
    T("begin_window", "A training task opens an accumulation window.", hot=True),
    T("begin_batch", "A batch (micro-batch in training) was read and moved to the device.", hot=True),
    T("backward", "The step backpropagates a loss (self.loss, self.backward).", hot=True),
    T("optimize", "The step asks for an update (self.optimize, or self.loss with do_optimize).", hot=True),
    T("clip", "The unscaled gradients are clipped by the registered clippers.", hot=True),
    T("apply_update", "One optimizer steps, or skips when its gradients are not finite.", hot=True),
    T("finish_update", "The update is done: the scaler updates and gradients are zeroed.", hot=True),
    T("end_batch", "The batch's step returned its metrics.", hot=True),
    T("accumulate_step", "An inner micro-batch as one fused edge: forward, loss, backward.", hot=True),
    T("update_step", "A window's last micro-batch as one fused edge: forward, loss, backward, the update.",
      hot=True),
    T("skip_step", "A window's last micro-batch as one fused edge whose update was skipped (not finite).",
      hot=True),
    T("window_step", "A one-batch window (no accumulation) that updated, as one fused edge.", hot=True),
    T("window_skip_step", "A one-batch window whose update was skipped (not finite), as one fused edge.",
      hot=True),
    T("snapshot", "A commit point passed (a window's update, an epoch's end) while a SnapshotCallback is"
      " attached: a snapshot is written if one is due, and a signal it listens for stops the fit.", hot=True),
    T("recompute_statistics", "The fit's epochs are done: a weight average whose BatchNorm statistics are due"
      " recomputes them over its data."),
    T("end_statistics", "The BatchNorm pass read its batches."),
    T("interrupt", "An exception or KeyboardInterrupt escaped the running loop."),
    T("recover", "Rollback is done; the trainer is ready for fit() or test() again."),
]

G = Guard
GUARDS = [
    G("epochs_remaining", "Completed epochs are fewer than the epoch target."),
    G("stop_requested", "A callback requested a stop (early stopping) during this fit."),
    G("val_due", "Validation tasks exist and this epoch is a multiple of val_freq."),
    G("window_boundary", "This micro-batch closes its window (the k-th batch, or the task's last batch)."),
    G("grads_finite", "The current optimizer's gradients are finite (the scaler found no inf/NaN)."),
    G("has_save_requests", "Callbacks requested checkpoint saves during this epoch's end."),
    G("snapshot_due", "A SnapshotCallback wants a snapshot at this commit point (its update count or minutes"
      " came round, an epoch ended, or a signal it listens for arrived), agreed by every rank."),
    G("stop_signalled", "A signal a SnapshotCallback listens for arrived (on any rank): the fit stops here."),
    G("update_budget_reached", "Trainer(max_updates=N) is given, the run committed N updates (skipped ones"
      " included) and no epoch interrupted after them waits for its end."),
    G("task_stops", "The update clock stops the training task here: the update budget is reached or a callback"
      " requested a stop."),
    G("val_point_due", "fit(val_every_n_updates=M) with validation data: the committed update count is a multiple"
      " of M, reaches the budget (unless val_at_end=False) or is 0 with val_at_start=True, and the records hold"
      " no validation at this count yet."),
    G("val_point_open", "The validation stage runs at an update point inside a training task, not at an epoch's"
      " end."),
    G("resume_pending", "Trainer(resume=...) asked for a resume that has not happened yet."),
    # A custom step's own backward: self.optimize() straight after the forward state (no `backward` trigger)
    G("closure_given", "The step handed the update a closure (self.optimize(closure=...)): the optimizer"
      " evaluates the loss and its gradients itself, as LBFGS does."),
    G("grads_present", "The optimizers named for the update hold gradients: the step backpropagated its loss"
      " itself (loss.backward())."),
    G("scales_losses", "A GradScaler scales the losses (precision='fp16')."),
    G("statistics_due", "A weight average with BatchNorm layers moved in this run and recomputes their statistics"
      " at the fit's end (SWACallback with bn_update=True, buffers='copy')."),
]

A = Action
ACTIONS = [
    A("resume_checkpoint", "Load the checkpoint resume= asks for (or start fresh), with the run's records and,"
      " for a finished run, its end.", cost="checkpoint"),
    A("start_epoch", "Advance the 1-based epoch counter and set distributed samplers' epoch."),
    A("report_early_stop", "Record and print why the fit stopped before its epoch target."),
    A("open_window", "Reset the window's counters, sample count and update flags (the window's meters open with"
      " its first batch)."),
    A("count_micro_batch", "Count the micro-batch in its window: its position, the window's samples and the size"
      " of the window's first batch (the loss share's base)."),
    A("sync_gradients", "DDP: synchronise gradients in this backward (the window's updating micro-batch)."),
    A("skip_gradient_sync", "DDP: no_sync for this backward; gradients accumulate locally."),
    A("keep_own_gradients", "The step backpropagated its loss itself: the update takes the window's gradients as"
      " the step made them, without the window's sample normalisation."),
    A("unscale_gradients", "Unscale fp16 gradients, normalise by the window's samples, check finiteness."),
    A("clip_gradients", "Run the gradient clippers (GradClipCallback) on the unscaled gradients."),
    A("step_optimizer", "Step the optimizer, then its step-wise scheduler."),
    A("skip_optimizer", "Leave the optimizer and its step-wise scheduler untouched; run skip hooks."),
    A("update_scaler", "Hand this update's inf checks to the GradScaler; its scale changes once per iteration."),
    A("zero_grad", "Zero the updated optimizers' gradients (set_to_none)."),
    A("remember_position", "Keep what a refit continues from besides the batch count: torch's generator states"
      " and a stateful DataLoader's position, as they are after the window's update."),
    # Weight averages (EMACallback, SWACallback) move only here and at an epoch's end, so a rollback finds
    # them as the last commit point left them; the run state carries them (rollback, snapshots, find_lr).
    A("average_update", "Move the weight averages (EMACallback; SWACallback from start_update) by the update"
      " just applied, as part of its commit; nothing when every optimizer of the update skipped (inf/NaN)."),
    A("commit_update", "Commit the window's update: the data position moves past the window and its loss sums"
      " and patches join the task's; rollback never undoes it.", commit=True),
    A("release_interrupts", "End the update's critical section: a Ctrl-C held since unscale_gradients is raised"
      " now, after the commit.", after_commit=True),
    A("close_window", "Fold the window's loss sums and metric patches into the task's."),
    A("step_epoch_schedulers", "Step epoch-wise LR schedulers (with the monitored loss if so configured); with"
      " validation points (val_every_n_updates) at each point, with its validation loss, not at epochs' ends nor"
      " at the point before the first update (val_at_start)."),
    A("average_epoch", "Move the epoch-wise weight averages (SWACallback) by the epoch's weights and step their"
      " learning-rate schedule, before the epoch's checkpoints are written (undone if the epoch does not"
      " commit)."),
    A("save_checkpoints", "Write the checkpoints requested by callbacks at this epoch's end.", cost="checkpoint"),
    A("commit_epoch", "Commit the epoch: the completed-epoch count, its records and the epoch-wise schedulers'"
      " steps; rollback returns here at the latest.", commit=True),
    A("open_val_point", "Mark the validation stage as an update point's: it returns to the training task."),
    A("commit_val_point", "Commit the validation point: its row (the update count and the validation metrics)"
      " joins the run's records; rollback never undoes it.", commit=True),
    A("save_snapshot", "Write a snapshot of this commit point: the training state, the data position inside"
      " the epoch, the task meters and the random states (every rank's, written by rank 0).", cost="checkpoint"),
    A("stop_on_signal", "End the fit: raise Preempted (a SystemExit whose code a scheduler can requeue on);"
      " the rollback it passes through has nothing to discard."),
    A("commit_statistics", "Commit the BatchNorm pass: the averages keep the statistics it computed; rollback"
      " never undoes them, and a snapshot written from here on holds them.", commit=True),
    A("discard_window", "Drop the open window's gradients, loss sums, patches and scaler step state."),
    A("reset_loop", "Clear per-run loop state so that the next fit starts a fresh window."),
]

RUNNING = [s.name for s in STATES if s.running]
LAST_MICRO_BATCH = ["begin_batch", "backward", "optimize", "clip", "apply_update", "finish_update", "end_batch"]
ONE_BATCH_WINDOW = ["begin_window", *LAST_MICRO_BATCH]
OPTIMIZING = ("optimize_clipped", "optimize_skipped")  # after clip: the last optimizer stepped / skipped
E = Transition
TRANSITIONS = [
    E("fit", "idle", "fit_running", "The first fit of a resume=... trainer loads the newest checkpoint.",
      conditions=["resume_pending"], actions=["resume_checkpoint"]),
    E("fit", "idle", "fit_running", "A fit starts or continues toward the epoch target.",
      unless=["resume_pending"]),
    E("test", "idle", "stage_test", "A first test of a resume=... trainer loads the newest checkpoint.",
      conditions=["resume_pending"], actions=["resume_checkpoint"]),
    E("test", "idle", "stage_test", "A test run starts.", unless=["resume_pending"]),
    E("next_epoch", "fit_running", "epoch_running", "Another epoch runs.",
      conditions=["epochs_remaining"], unless=["stop_requested", "update_budget_reached"], actions=["start_epoch"]),
    E("next_epoch", "fit_running", "fit_done", "A callback stopped the fit early.",
      conditions=["stop_requested"], actions=["report_early_stop"]),
    E("next_epoch", "fit_running", "fit_done", "The update budget is reached.",
      conditions=["update_budget_reached"], unless=["stop_requested"]),
    E("next_epoch", "fit_running", "fit_done", "The epoch target is reached.",
      unless=["epochs_remaining", "stop_requested", "update_budget_reached"]),
    E("finish", "fit_done", "idle", "fit() returns its records."),
    E("begin_train", "epoch_running", "stage_train", "The training stage starts."),
    E("begin_task", "stage_train", "task_train", "A training task starts."),
    E("begin_window", "task_train", "window_open", "A window opens.", actions=["open_window"]),
    E("begin_batch", "window_open", "step_forward", "The window's last micro-batch: gradients sync.",
      conditions=["window_boundary"], actions=["count_micro_batch", "sync_gradients"]),
    E("begin_batch", "window_open", "step_forward", "An inner micro-batch: no gradient sync.",
      unless=["window_boundary"], actions=["count_micro_batch", "skip_gradient_sync"]),
    E("backward", "step_forward", "step_backward", "The first loss of the step is backpropagated."),
    E("backward", "step_backward", "step_backward", "Another loss of the same step is backpropagated."),
    E("backward", "step_optimized", "step_backward", "A loss after this step's update (e.g. a GAN)."),
    # A custom step that backpropagated itself (loss.backward()) or hands a closure optimizer its closure
    # calls self.optimize() in step_forward: no `backward` trigger was fired for its gradients.
    E("optimize", "step_forward", None, "Under fp16 a gradient the step made itself is not scaled.",
      conditions=["scales_losses"],
      error="with precision='fp16' a GradScaler scales the losses: backpropagate with self.backward(loss), not"
            " loss.backward(), before self.optimize(); a closure optimizer (self.optimize(closure=...)) needs"
            " precision='fp32' or 'bf16'"),
    E("optimize", "step_forward", "optimize_unscaled", "A closure optimizer's update: the optimizer evaluates the"
      " step's closure (forward, loss, backward) itself, as often as it needs.",
      conditions=["closure_given", "window_boundary"], unless=["scales_losses"], actions=["unscale_gradients"]),
    E("optimize", "step_forward", None, "A closure inside an accumulation window.",
      conditions=["closure_given"], unless=["window_boundary", "scales_losses"],
      error="a closure optimizer evaluates its loss itself and cannot accumulate gradients over micro-batches;"
            " use gradient_accumulation_steps=1"),
    E("optimize", "step_forward", "optimize_unscaled", "The step backpropagated its loss itself and the window is"
      " complete: update with its gradients as they are.", conditions=["grads_present", "window_boundary"],
      unless=["closure_given", "scales_losses"], actions=["keep_own_gradients", "unscale_gradients"]),
    E("optimize", "step_forward", "step_backward", "The step backpropagated its loss itself; the window is not"
      " complete: keep accumulating.", conditions=["grads_present"],
      unless=["window_boundary", "closure_given", "scales_losses"], actions=["keep_own_gradients"]),
    E("optimize", "step_forward", None, "Nothing was backpropagated before the update.",
      unless=["grads_present", "closure_given", "scales_losses"],
      error="self.optimize() found no gradients to apply: backpropagate a loss first (self.loss(out, y),"
            " self.backward(loss) or loss.backward()), or hand a closure optimizer its closure:"
            " self.optimize(closure=closure)"),
    E("optimize", "step_backward", "optimize_unscaled", "The window is complete: update.",
      conditions=["window_boundary"], actions=["unscale_gradients"]),
    E("optimize", "step_backward", "step_backward", "The window is not complete: keep accumulating.",
      unless=["window_boundary"]),
    # The data ended inside a window that was not known to be its last (data without a length, one process):
    # the window updates after its last micro-batch, through the same update edges.
    E("optimize", "window_open", "optimize_unscaled", "The data ended inside the window: its micro-batches'"
      " gradients update, as the window's last micro-batch would have.", conditions=["grads_present"],
      actions=["unscale_gradients"]),
    E("optimize", "window_open", "task_train", "The data ended inside a window that backpropagated nothing: it"
      " closes without an update.", unless=["grads_present"], actions=["close_window"]),
    E("clip", "optimize_unscaled", "optimize_clipped", "Gradients are clipped.", actions=["clip_gradients"]),
    *(E("apply_update", source, "optimize_clipped", "Finite gradients: the optimizer steps.",
        conditions=["grads_finite"], actions=["step_optimizer", "commit_update"]) for source in OPTIMIZING),
    *(E("apply_update", source, "optimize_skipped", "inf/NaN gradients: the step is skipped.",
        unless=["grads_finite"], actions=["skip_optimizer"]) for source in OPTIMIZING),
    *(E("finish_update", source, "step_optimized", "The update is complete.",
        actions=["update_scaler", "zero_grad", "remember_position", "average_update", "commit_update",
                 "release_interrupts"])
      for source in OPTIMIZING),
    E("optimize", "step_optimized", "optimize_unscaled",
      "Another optimizer of the same step updates (e.g. optimize(0) then optimize(1) after one backward).",
      actions=["unscale_gradients"]),
    E("end_batch", "step_optimized", "task_train", "The updating micro-batch closes the window.",
      actions=["close_window"]),
    E("end_batch", "step_backward", "window_open", "An inner micro-batch ends; the window stays open.",
      unless=["window_boundary"]),
    E("end_batch", "step_backward", None, "The window's last micro-batch ended without an update.",
      conditions=["window_boundary"],
      error="the window's last micro-batch ended with gradients that were never applied; a custom step"
            " that calls self.loss(..., do_optimize=False) must call self.optimize()"),
    E("end_batch", "step_forward", "window_open", "A micro-batch without backward ends inside the window.",
      unless=["window_boundary"]),
    E("end_batch", "step_forward", "task_train", "A micro-batch without backward closes the window.",
      conditions=["window_boundary"], actions=["close_window"]),
    E("accumulate_step", "window_open", "window_open", "An inner micro-batch of a k-batch window ran: forward, loss,"
      " backward; gradients accumulate (fused).",
      fuses=["begin_batch", "backward", "optimize", "end_batch"]),
    E("update_step", "window_open", "task_train", "The window's last micro-batch ran and updated (fused).",
      fuses=LAST_MICRO_BATCH, assuming=["window_boundary", "grads_finite"]),
    E("skip_step", "window_open", "task_train", "The window's last micro-batch ran; its update was skipped"
      " (fused).", fuses=LAST_MICRO_BATCH, assuming=["window_boundary"]),
    E("window_step", "task_train", "task_train", "A one-batch window ran and updated (fused).",
      fuses=ONE_BATCH_WINDOW, assuming=["window_boundary", "grads_finite"]),
    E("window_skip_step", "task_train", "task_train", "A one-batch window ran; its update was skipped"
      " (fused).", fuses=ONE_BATCH_WINDOW, assuming=["window_boundary"]),
    E("end_task", "task_train", "stage_train", "The training task is done."),
    E("validate", "task_train", "stage_val", "A validation point is due at this update.",
      conditions=["val_point_due"], actions=["open_val_point"]),
    E("validate", "task_train", "task_spent", "The update budget is reached or a stop was requested.",
      conditions=["task_stops"], unless=["val_point_due"]),
    E("validate", "task_train", "task_train", "Neither a validation point nor the task's end is due.",
      unless=["val_point_due", "task_stops"]),
    E("end_task", "task_spent", "stage_train", "The training task ended on the update clock."),
    E("end_stage", "stage_train", "epoch_trained", "The training stage is done."),
    E("validate", "epoch_trained", "stage_val", "Validation is due.", conditions=["val_due"]),
    E("validate", "epoch_trained", "epoch_end", "No validation this epoch.", unless=["val_due"]),
    E("begin_task", "stage_val", "task_val", "A validation task starts."),
    E("begin_batch", "task_val", "val_batch", "A validation batch is evaluated."),
    E("end_batch", "val_batch", "task_val", "The validation batch is done."),
    E("end_task", "task_val", "stage_val", "The validation task is done."),
    E("end_stage", "stage_val", "epoch_end", "The validation stage is done.", unless=["val_point_open"]),
    E("end_stage", "stage_val", "task_train", "The validation point is done; training goes on.",
      conditions=["val_point_open"], unless=["task_stops"],
      actions=["step_epoch_schedulers", "save_checkpoints", "commit_val_point"]),
    E("end_stage", "stage_val", "task_spent", "The validation point is done, and training stops here.",
      conditions=["val_point_open", "task_stops"],
      actions=["step_epoch_schedulers", "save_checkpoints", "commit_val_point"]),
    E("end_epoch", "epoch_end", "fit_running", "The epoch is complete; checkpoints are written.",
      conditions=["has_save_requests"],
      actions=["step_epoch_schedulers", "average_epoch", "save_checkpoints", "commit_epoch"]),
    E("end_epoch", "epoch_end", "fit_running", "The epoch is complete.",
      unless=["has_save_requests"], actions=["step_epoch_schedulers", "average_epoch", "commit_epoch"]),
    *(edge for state in ("task_train", "fit_running") for edge in (
        E("snapshot", state, state, "No snapshot is due at this commit point.", unless=["snapshot_due"]),
        E("snapshot", state, state, "A snapshot is due: it is written at this commit point.",
          conditions=["snapshot_due"], unless=["stop_signalled"], actions=["save_snapshot"]),
        E("snapshot", state, "preempted", "A listed signal arrived: a last snapshot is written, then the fit"
          " stops.", conditions=["snapshot_due", "stop_signalled"], actions=["save_snapshot", "stop_on_signal"]),
    )),
    E("snapshot", "window_open", "preempted", "A listed signal arrived inside an accumulation window: its next"
      " micro-batch is not fetched (the scheduler's signal killed the DataLoader workers too), the window is"
      " dropped, a snapshot of the last commit point is written, then the fit stops.",
      conditions=["stop_signalled"], actions=["discard_window", "save_snapshot", "stop_on_signal"]),
    E("snapshot", "window_open", None, "Inside a window, a snapshot is taken only to stop the fit.",
      unless=["stop_signalled"], error="snapshot fired inside an open accumulation window without a stop signal;"
                                       " mid-window snapshots are written at the window's commit point"),
    # A fetch of validation data that a listed signal made fail (the scheduler's signal killed the validation
    # DataLoader's workers) stops the fit here, at the epoch's last update: validation cannot go on.
    E("snapshot", "task_val", "preempted", "A listed signal killed the validation DataLoader's workers: no"
      " further batch can be fetched, a snapshot of the last commit point (the epoch's last update) is written,"
      " then the fit stops; the resumed run validates the epoch again.",
      conditions=["stop_signalled"], actions=["save_snapshot", "stop_on_signal"]),
    E("snapshot", "task_val", None, "In validation, a snapshot is taken only to stop the fit.",
      unless=["stop_signalled"], error="snapshot fired in a validation task without a stop signal; snapshots are"
                                       " written at commit points"),
    E("snapshot", "fit_done", "preempted", "A listed signal arrived after the fit's last commit point (while its"
      " snapshot was written, in the fit's end hooks): the fit stops; the snapshot written there holds everything.",
      conditions=["stop_signalled"], actions=["stop_on_signal"]),
    E("snapshot", "fit_done", "fit_done", "No listed signal arrived after the fit's last commit point.",
      unless=["stop_signalled"]),
    E("recompute_statistics", "fit_done", "fit_statistics", "A weight average's BatchNorm statistics are due: the"
      " pass reads its data.", conditions=["statistics_due"]),
    E("recompute_statistics", "fit_done", "fit_done", "No weight average's statistics are due (none moved, or"
      " none recomputes them).", unless=["statistics_due"]),
    E("end_statistics", "fit_statistics", "fit_done", "The pass is done: its statistics are committed.",
      actions=["commit_statistics"]),
    # The pass reads batches as a training task does: once a listed signal arrived it reads no further batch.
    E("snapshot", "fit_statistics", "preempted", "A listed signal arrived during the BatchNorm pass: no further"
      " batch is read, the averages' statistics go back to the last commit point's, a snapshot of it is written,"
      " then the fit stops; the resumed run runs the pass again.", conditions=["stop_signalled"],
      actions=["discard_window", "save_snapshot", "stop_on_signal"]),
    E("snapshot", "fit_statistics", None, "In the BatchNorm pass, a snapshot is taken only to stop the fit.",
      unless=["stop_signalled"], error="snapshot fired in the BatchNorm pass without a stop signal; its snapshot is"
                                       " written once it committed, from fit_done"),
    E("begin_task", "stage_test", "task_test", "A test task starts."),
    E("begin_batch", "task_test", "test_batch", "A test batch is evaluated."),
    E("end_batch", "test_batch", "task_test", "The test batch is done."),
    E("end_task", "task_test", "stage_test", "The test task is done."),
    E("end_stage", "stage_test", "idle", "test() returns its metrics."),
    *(E("interrupt", name, "rollback", "An exception escaped; roll back.", actions=["discard_window"])
      for name in RUNNING),
    E("recover", "rollback", "idle", "The trainer is ready again.", actions=["reset_loop"]),
]

STEP = ("step_forward", "step_backward", "step_optimized")
H = Hook
HOOKS = [
    H("on_before_fit", ["epochs"], ["fit_running"], "fit() starts; `epochs` is the epoch target.", after="fit"),
    H("on_before_epoch", ["train_tasks", "val_tasks", "epoch_idx"], ["epoch_running"],
      "An epoch starts (0-based `epoch_idx`, as in 0.6; `trainer.loop.epoch` is 1-based).", after="next_epoch"),
    H("on_before_train_epochs", ["tasks", "epoch_idx"], ["stage_train"], "The training stage starts.",
      after="begin_train"),
    H("on_before_train_epoch", ["task"], ["task_train"], "A training task starts.", after="begin_task"),
    H("on_before_train_batch", ["batch_x", "batch_y", "batch_idx"], ["step_forward"],
      "A training batch is on the device; `batch_idx` is 0-based within the task (loop.batch_idx: 1-based).",
      after="begin_batch"),
    H("on_before_train_forward", [], ["step_forward"], "The model's forward pass is about to run.",
      after="begin_batch"),
    H("on_after_train_forward", ["model_out"], ["step_forward"], "The forward pass returned `model_out`.",
      before="backward"),
    H("on_before_backward", ["loss"], ["step_backward"], "`loss` is about to be backpropagated.", after="backward"),
    H("on_after_backward", ["loss"], ["step_backward"], "`loss` was backpropagated.", after="backward"),
    H("on_before_optimize", ["optimize_index"], ["optimize_unscaled"],
      "Gradients are unscaled and normalised; optimizers `optimize_index` are about to step.", after="optimize"),
    H("on_skip_optimize", ["optimize_index"], ["optimize_skipped"],
      "Optimizer `optimize_index` skipped its step (inf/NaN gradients).", after="apply_update"),
    H("on_after_optimize", ["optimize_index"], ["step_optimized"], "The update was applied.", after="finish_update"),
    H("on_train_metrics", ["loss", "model_out", "batch_y", "task"], list(STEP),
      "Training metrics of a batch are about to be computed.", before="optimize"),
    H("on_after_train_batch", ["metrics", "batch_idx"], ["window_open", "task_train"],
      "A training batch finished with its batch `metrics`.", after="end_batch"),
    H("on_after_train_epoch", ["task", "metrics"], ["task_train"], "A training task finished.", before="end_task"),
    H("on_after_train_epochs", ["tasks", "metrics", "epoch_idx"], ["stage_train"],
      "The training stage finished with its `metrics`.", before="end_stage"),
    H("on_before_val_epochs", ["tasks", "epoch_idx"], ["stage_val"], "The validation stage starts.", after="validate"),
    H("on_before_val_epoch", ["task"], ["task_val"], "A validation task starts.", after="begin_task"),
    H("on_before_val_batch", ["batch_x", "batch_y", "batch_idx"], ["val_batch"],
      "A validation batch is on the device.", after="begin_batch"),
    H("on_before_val_forward", [], ["val_batch"], "The validation forward pass is about to run.", after="begin_batch"),
    H("on_after_val_forward", ["model_out"], ["val_batch"], "The validation forward pass returned.",
      before="end_batch"),
    H("on_val_metrics", ["loss", "model_out", "batch_y", "task"], ["val_batch"],
      "Validation metrics of a batch are about to be computed.", before="end_batch"),
    H("on_after_val_batch", ["metrics", "batch_idx"], ["task_val"], "A validation batch finished.", after="end_batch"),
    H("on_after_val_epoch", ["task", "metrics"], ["task_val"], "A validation task finished.", before="end_task"),
    H("on_after_val_epochs", ["tasks", "metrics", "epoch_idx"], ["stage_val"],
      "The validation stage finished with its `metrics`.", before="end_stage"),
    H("on_after_epoch", ["train_tasks", "val_tasks", "train_metrics", "val_metrics", "epoch_idx"],
      ["epoch_end"], "An epoch finished; callbacks may request checkpoints or a stop here.", before="end_epoch"),
    H("on_after_fit", [], ["fit_done"], "fit() finished (target reached or stopped early).", before="finish"),
    H("on_before_test_epochs", ["tasks"], ["stage_test"], "The test stage starts.", after="test"),
    H("on_before_test_epoch", ["task"], ["task_test"], "A test task starts.", after="begin_task"),
    H("on_before_test_batch", ["batch_x", "batch_y", "batch_idx"], ["test_batch"],
      "A test batch is on the device.", after="begin_batch"),
    H("on_before_test_forward", [], ["test_batch"], "The test forward pass is about to run.", after="begin_batch"),
    H("on_after_test_forward", ["model_out"], ["test_batch"], "The test forward pass returned.", before="end_batch"),
    H("on_test_metrics", ["loss", "model_out", "batch_y", "task"], ["test_batch"],
      "Test metrics of a batch are about to be computed.", before="end_batch"),
    H("on_after_test_batch", ["metrics", "batch_idx"], ["task_test"], "A test batch finished.", after="end_batch"),
    H("on_after_test_epoch", ["task", "metrics"], ["task_test"], "A test task finished.", before="end_task"),
    H("on_after_test_epochs", ["tasks", "metrics"], ["stage_test"], "The test stage finished.", before="end_stage"),
    H("on_rollback", ["exception", "state"], ["rollback"],
      "An exception interrupted the loop in `state`; the open window was discarded.", after="interrupt"),
    H("on_interrupted", ["exception"], ["idle"],
      "fit() or test() was interrupted and rolled back; `exception` is re-raised after this hook.", after="recover"),
]

SPEC = Spec(STATES, TRIGGERS, GUARDS, ACTIONS, TRANSITIONS, HOOKS).validate()
