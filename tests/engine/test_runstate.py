"""The run state has one owner (`deepepochs.engine.runstate.RunState`) with one capture and one restore: a
field added to the record, and nothing else changed, is carried by rollback, the learning-rate finder,
checkpoint loading and mid-epoch snapshot resume."""

import shutil

import attrs
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, CheckpointError, SnapshotCallback, Trainer
from deepepochs.checkpoint import read_checkpoint
from deepepochs.engine import actions, generators, runstate
from deepepochs.engine.runstate import RunState


@attrs.define(slots=True, eq=False)
class CountingRun(RunState):
    """The run state with fields a test adds: a count of updates (`counted`, beside the run state's own
    `updates`) and the (epoch, batch) of each update."""

    counted: int = 0
    seen: list = attrs.Factory(list)
    tag: str = ""


def _count_updates(monkeypatch):
    """Wrap the registry's `zero_grad` (the end of every applied or skipped update) to write the new
    fields; the registry is read when a trainer is built, so this reaches every path."""
    inner = actions.ACTIONS["zero_grad"]

    def zero_grad(ctx):
        inner(ctx)
        run = ctx.loop.run
        if isinstance(run, CountingRun):
            run.counted += 1
            run.seen.append((ctx.loop.epoch, ctx.loop.batch_idx))

    monkeypatch.setitem(actions.ACTIONS, "zero_grad", zero_grad)


def _with_counting_run(trainer):
    """Give `trainer` a `CountingRun` holding its current run state (no library code changes)."""
    old = trainer.loop.run
    trainer.loop.run = CountingRun(**{f.name: getattr(old, f.name) for f in attrs.fields(RunState)})
    return trainer


def _data():
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(60, 4, generator=g), torch.randint(0, 3, (60,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)


def _trainer(callbacks=(), resume=False, epochs=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 3))
    trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), 0.05), epochs=epochs,
                      callbacks=list(callbacks), resume=resume, running_id="run", gradient_accumulation_steps=2,
                      log_batch=False, show_info=False)
    return _with_counting_run(trainer)


class TagEpochEnds(Callback):
    """Writes the new `tag` field at every epoch's end, then (once, at epoch `fail_at`) fails after it."""

    def __init__(self, fail_at=None):
        self.fail_at = fail_at

    def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx):
        trainer.loop.run.tag = f"epoch {epoch_idx + 1} ended"
        if self.fail_at == epoch_idx + 1:
            self.fail_at = None
            raise RuntimeError("fault at the epoch's end")


def test_capture_and_restore_cover_a_field_a_subclass_adds():
    """capture copies the added fields (a list deeply), restore writes them back and can do so twice."""
    run = CountingRun(counted=3, seen=[(1, 2)])
    saved = runstate.capture(run)
    run.counted, run.tag = 9, "changed"
    run.seen.append((1, 4))
    runstate.restore(run, saved)
    assert (run.counted, run.seen, run.tag) == (3, [(1, 2)], "")
    run.seen.append((2, 2))
    runstate.restore(run, saved)
    assert run.seen == [(1, 2)]
    assert {"counted", "seen", "tag"} <= set(runstate.generic_fields(run))


def test_rollback_restores_an_added_field_an_epoch_end_changed_and_the_refit_matches_the_plain_run(monkeypatch):
    """A fault at an epoch's end before it commits brings the added field back to its value before that
    end; the refit then ends with the same fields as a run without the fault."""
    _count_updates(monkeypatch)
    plain = _trainer([TagEpochEnds()])
    plain.fit(_data())
    faulty = _trainer([TagEpochEnds(fail_at=2)])
    with pytest.raises(RuntimeError, match="fault at the epoch's end"):
        faulty.fit(_data())
    run = faulty.loop.run
    assert run.tag == "epoch 1 ended"  # the end of epoch 2 did not commit
    assert run.completed_epochs == 1
    assert run.counted == 2 * 8  # 15 batches, k=2: 8 updates per epoch, both epochs' updates committed
    faulty.fit(_data())
    assert (run.tag, run.counted, run.seen) == (plain.loop.run.tag, plain.loop.run.counted, plain.loop.run.seen)
    assert run.tag == "epoch 3 ended" and run.counted == 3 * 8
    assert run.updates == run.counted  # the run state's own count: every committed update, once


def test_find_lr_puts_back_an_added_field_its_sweep_changed(monkeypatch):
    """The sweep's updates change the added fields (through the registry); find_lr restores them."""
    _count_updates(monkeypatch)
    trainer = _trainer(epochs=1)
    trainer.fit(_data())
    run = trainer.loop.run
    before = (run.counted, list(run.seen))
    assert before[0] == 8
    result = trainer.find_lr(_data(), min_lr=1e-4, max_lr=0.1, num_steps=12, stop_factor=None, plot=False)
    assert len(result.losses) == 12  # the sweep ran its updates, each counted while it ran
    assert trainer.loop.run is run
    assert (run.counted, run.seen) == before


def test_a_mid_epoch_snapshot_carries_an_added_field_and_the_resumed_run_ends_like_the_plain_one(monkeypatch,
                                                                                                 tmp_path):
    """The snapshot stores the added fields; load_checkpoint and resume=True put them back, and the resumed
    run ends with the same values as the uninterrupted run."""
    _count_updates(monkeypatch)
    plain = _trainer([SnapshotCallback(tmp_path / "all", every_n_updates=1, keep=1000)])
    plain.fit(_data())
    name = "snapshot-u000000011.ckpt"  # 8 updates per epoch: the third update of epoch 2
    source = tmp_path / "all" / "run" / name
    stored = read_checkpoint(source).position["ranks"][0]["run"]
    assert stored["counted"] == 11 and len(stored["seen"]) == 11

    loaded = _trainer()
    loaded.load_checkpoint(source)
    assert loaded.loop.run.counted == 11
    assert loaded.loop.run.seen == plain.loop.run.seen[:11]

    (tmp_path / "resume" / "run").mkdir(parents=True)
    shutil.copy(source, tmp_path / "resume" / "run" / name)
    resumed = _trainer([SnapshotCallback(tmp_path / "resume", every_n_updates=1)], resume=True)
    resumed.fit(_data())
    assert resumed.loop.run.counted == plain.loop.run.counted == 3 * 8
    assert resumed.loop.run.seen == plain.loop.run.seen
    for a, b in zip(resumed.raw_model.parameters(), plain.raw_model.parameters()):
        assert torch.equal(a, b)


def test_a_failed_load_leaves_the_added_field_as_it_was(monkeypatch, tmp_path):
    """Loading is all or nothing for the run state too: a snapshot that fails while it is applied leaves
    every run-state field, an added one included, as it was."""
    _count_updates(monkeypatch)
    writer = _trainer([SnapshotCallback(tmp_path, every_n_updates=3, keep=10)], epochs=1)
    writer.fit(_data())
    trainer = _trainer(epochs=1)
    trainer.loop.run.counted, trainer.loop.run.tag = 5, "mine"
    history = trainer.history
    # The last step of putting a position back fails: everything before it had been written.
    monkeypatch.setattr(generators, "set_generators", _fail)
    with pytest.raises(CheckpointError, match="could not be loaded"):
        trainer.load_checkpoint(tmp_path / "run" / "snapshot-u000000003.ckpt")
    run = trainer.loop.run
    assert (run.counted, run.seen, run.tag, run.resume, run.train_meters) == (5, [], "mine", None, None)
    assert trainer.history is history and history == {"train": {}, "val": {}}


def _fail(device, state):
    raise RuntimeError("the generators cannot be set")
