"""A listed signal that makes a validation fetch fail (it killed the validation DataLoader's workers) stops the
fit at the epoch's last update: `Preempted` and a snapshot whose position is the training stage's end; a
resume from it trains none of that epoch's batches again, validates it, and ends bit-identical to the
uninterrupted run. The process-group runs with real workers are in tests/preemption."""

import os
import signal

import pytest
from state_compare import states_equal
from test_snapshots import _data, _trainer

from deepepochs import Callback, Preempted
from deepepochs.checkpoint import read_checkpoint

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name == "nt", reason="POSIX signals")


class WorkersKilledAt:
    """Validation data whose second batch of epoch `epoch` fails as a DataLoader does when the job's SIGTERM
    killed its workers: the signal reaches this process, then the fetch raises."""

    def __init__(self, loader, trainer_box, epoch):
        self.loader, self.box, self.epoch = loader, trainer_box, epoch

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for index, batch in enumerate(self.loader):
            if index == 1 and self.box[0].loop.epoch == self.epoch:
                os.kill(os.getpid(), signal.SIGTERM)
                raise RuntimeError("DataLoader worker (pid(s) 12345) exited unexpectedly")
            yield batch


class CountTrainBatches(Callback):
    def __init__(self):
        self.batches = 0

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        self.batches += 1


def _state(trainer, model):
    return {"model": model.state_dict(), "opt": trainer.opt.state_dict(), "history": trainer.history}


def test_a_signal_that_kills_validation_workers_stops_at_the_epochs_last_update_and_resumes_exactly(tmp_path):
    """Epoch 2's validation fails after the job's SIGTERM: Preempted (143), a snapshot of epoch 2's end of
    training (the flight record shows the `task_val --snapshot--> preempted` edge); the resume loads it,
    trains only epoch 3's batches and ends with the uninterrupted weights, optimizer state and history."""
    reference, ref_model = _trainer(None)
    train, val = _data()
    reference.fit(train, val)
    trainer, _ = _trainer(tmp_path, on_signals=("SIGTERM",))
    train, val = _data()
    with pytest.raises(Preempted) as info:
        trainer.fit(train, WorkersKilledAt(val, [trainer], epoch=2))
    stop = info.value
    assert stop.code == 143 and stop.path.is_file()
    assert ("task_val", "snapshot", "preempted") in [(r.source, r.trigger, r.dest)
                                                      for r in stop.deepepochs_flight_record]
    position = read_checkpoint(stop.path).position
    assert (position["epoch"], position["task_index"], position["batches_done"]) == (2, 0, 18)  # 70 / 4
    counter = CountTrainBatches()
    resumed, model = _trainer(tmp_path, resume=True, callbacks=[counter], on_signals=("SIGTERM",))
    train, val = _data()
    resumed.fit(train, val)
    assert counter.batches == 18  # epoch 3 only: epoch 2 resumed after its training
    assert states_equal(_state(resumed, model), _state(reference, ref_model))


def test_a_signal_that_kills_validation_workers_at_a_validation_point_resumes_validating_that_point(tmp_path):
    """Under the update clock the same signal during epoch 2's first validation point (update 8): the snapshot
    holds the run as update 8 left it, without the point's row (a point stopped while it validates has no
    metrics to record), and the resume validates that point before training on; the history, weights and
    optimizer state end as the uninterrupted run's. Before, the file recorded the point's update with no
    metrics and the resume never validated it."""
    clock = {"trainer_kw": {"max_updates": 15}}
    reference, ref_model = _trainer(None, **clock)
    train, val = _data()
    reference.fit(train, val, val_every_n_updates=4)
    trainer, _ = _trainer(tmp_path, on_signals=("SIGTERM",), **clock)
    train, val = _data()
    with pytest.raises(Preempted) as info:
        trainer.fit(train, WorkersKilledAt(val, [trainer], epoch=2), val_every_n_updates=4)
    stop = info.value
    assert ("task_val", "snapshot", "preempted") in [(r.source, r.trigger, r.dest)
                                                      for r in stop.deepepochs_flight_record]
    saved = read_checkpoint(stop.path)
    assert saved.updates == 8 and saved.history["val"]["updates"] == [4]
    resumed, model = _trainer(tmp_path, resume=True, on_signals=("SIGTERM",), **clock)
    train, val = _data()
    resumed.fit(train, val, val_every_n_updates=4)
    assert resumed.history["val"]["updates"] == [4, 8, 12, 15]
    assert states_equal(_state(resumed, model), _state(reference, ref_model))
