"""Resuming from a file a `CheckCallback` wrote (its best or latest file), wherever it was written: at a
validation point of the update clock, in the middle of an epoch, or at an epoch's end. A new trainer that
resumes from such a file (`resume=True` choosing it, or `load_checkpoint` on it) and trains on to the same
target ends bit-identical to the run never stopped: every model, optimizer and scheduler tensor, and the
records. The run (tests/check_resume_setup.py) draws from every random stream a resume must continue."""

from __future__ import annotations

import shutil

import pytest
from check_resume_setup import BATCH, EVERY, UPDATES, KeepFile, N, build, fit, run_state
from state_compare import states_equal

from deepepochs.checkpoint import read_checkpoint


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """The run never stopped, with the monitors' files as they stood after updates 11 (a best file of the
    validation point at update 10, inside epoch 1) and 17 (a latest file of the point at 15, inside epoch 2)."""
    folder = tmp_path_factory.mktemp("check-resume")
    kept = {}
    for save_best, at in ((True, 11), (False, 17)):
        copy = folder / f"kept-{save_best}" / "run" / "val-loss.ckpt"
        trainer = build(folder / f"run-{save_best}", save_best, lambda c, at=at, copy=copy: KeepFile(c, at, copy))
        records = fit(trainer)
        kept[save_best] = (copy, records, run_state(trainer))
    return kept


@pytest.mark.parametrize("save_best", [True, False], ids=["best", "latest"])
@pytest.mark.parametrize("how", ["resume", "load_checkpoint"])
def test_a_resume_from_a_monitors_file_of_a_mid_epoch_validation_point_ends_as_the_run_never_stopped(
        stopped_run, tmp_path, save_best, how):
    """The file of a validation point inside an epoch records that point's position; the resumed trainer
    continues there (not at the epoch's start) and ends with the uninterrupted run's tensors and records."""
    copy, records, want = stopped_run[save_best]
    ckpt = read_checkpoint(copy)
    assert ckpt.updates == (10 if save_best else 15) and ckpt.updates % (N // BATCH)  # a point inside an epoch
    assert ckpt.position is not None and ckpt.position["batches_done"] == ckpt.updates % (N // BATCH)
    assert ckpt.history["val"]["updates"] == list(range(EVERY, ckpt.updates + 1, EVERY))
    if how == "resume":
        folder = tmp_path / "ckpt"
        shutil.copytree(copy.parent.parent, folder)
        trainer = build(folder, save_best, resume=True)
    else:
        trainer = build(tmp_path / "ckpt", save_best)
        trainer.load_checkpoint(copy)
    got = fit(trainer)
    assert trainer.loop.run.updates == UPDATES
    assert got == records
    assert states_equal(run_state(trainer), want)


def test_a_resume_from_a_best_file_of_an_epochs_end_with_validation_every_second_epoch_is_exact(tmp_path):
    """On the epoch clock (validation every second epoch) the best file is of an epoch's end: resumed, the
    run trains the epochs after it and ends with the uninterrupted run's tensors and records."""
    copy = tmp_path / "kept" / "run" / "val-loss.ckpt"
    trainer = build(tmp_path / "a", True, lambda c: KeepFile(c, 3 * N // BATCH, copy), clock=False)
    records, want = fit(trainer, clock=False), run_state(trainer)
    assert read_checkpoint(copy).epoch == 2 and read_checkpoint(copy).position is None
    resumed = build(tmp_path / "kept", True, resume=True, clock=False)
    assert fit(resumed, clock=False) == records
    assert states_equal(run_state(resumed), want)


@pytest.mark.parametrize("on_stage, every", [("val", 6), ("train", EVERY)], ids=["val-point-at-an-epochs-end",
                                                                                "train-monitor"])
def test_a_resume_from_a_best_file_of_the_update_clock_at_an_epochs_end_is_exact(tmp_path, on_stage, every):
    """Files of the update clock at an epoch's last update: a validation point there (its position: every
    batch of the epoch done), or a training monitor's check at the epoch's end (no position). Resumed, the run
    ends with the uninterrupted run's tensors and records."""
    copy = tmp_path / "kept" / "run" / "loss.ckpt"
    trainer = build(tmp_path / "a", True, lambda c: KeepFile(c, N // BATCH + 1, copy), on_stage=on_stage)
    records, want = fit(trainer, every=every), run_state(trainer)
    ckpt = read_checkpoint(copy)
    assert ckpt.updates == N // BATCH
    if on_stage == "val":  # inside epoch 1, after all its batches: the epoch's end follows the point
        assert ckpt.epoch == 0 and ckpt.position["batches_done"] == N // BATCH
    else:
        assert ckpt.epoch == 1 and ckpt.position is None
    resumed = build(tmp_path / "kept", True, resume=True, on_stage=on_stage)
    assert fit(resumed, every=every) == records
    assert states_equal(run_state(resumed), want)


def test_a_finished_run_resumed_from_its_mid_epoch_best_file_says_which_update_it_continues_from(
        stopped_run, tmp_path, capsys):
    """The run reached max_updates after its best point (update 10, inside epoch 1): resume=True beside the
    run's end record names that update and what is trained again, and no epoch target (before: "epoch 0" and
    "of 1099511627776 epoch(s)"); the run then ends as the run never stopped."""
    copy, records, want = stopped_run[True]
    folder = tmp_path / "ckpt"
    shutil.copytree(copy.parent.parent, folder)
    shutil.copy(copy.parents[2] / "run-True" / "run" / "finished.pt", folder / "run")
    trainer = build(folder, True, resume=True)
    capsys.readouterr()
    got = fit(trainer)
    out = capsys.readouterr().out
    assert ("Run run had completed 3 epoch(s), but its latest state was not saved: its newest checkpoint is of"
            " update 10 (inside epoch 1), so the run continues from there and the updates after it to the end of"
            " epoch 3 will be trained again") in out
    assert got == records and states_equal(run_state(trainer), want)


def test_a_finished_run_whose_best_file_is_of_its_last_update_resumes_to_its_end_training_nothing(tmp_path, capsys):
    """The best point is the update reaching max_updates (inside epoch 3): resume=True from it says that
    nothing is trained again, and the run ends with the same tensors and records."""
    records = fit(build(tmp_path, True))
    assert read_checkpoint(tmp_path / "run" / "val-loss.best.ckpt").updates == UPDATES  # the premise
    capsys.readouterr()
    trainer = build(tmp_path, True, resume=True)
    got = fit(trainer)
    out = capsys.readouterr().out
    assert ("its newest checkpoint is of update 30 (inside epoch 3), so the run continues from there and epoch 3"
            " ends at once (that update reached max_updates: nothing is trained again)") in out
    assert got == records and trainer.loop.run.updates == UPDATES


def test_a_run_stopped_early_at_a_validation_point_stays_stopped_when_resumed_from_its_best_file(tmp_path, capsys):
    """patience=1 stops the fit at the first point that does not improve (30, after the best at 25, inside
    epoch 3): resume=True says the run is finished, names the loaded weights by their update, trains nothing
    and returns the run's records."""
    records = fit(build(tmp_path, True, patience=1, lr=0.2))
    assert records["val"]["updates"][-1] == UPDATES  # the premise: stopped at the last point, its best at 25
    assert read_checkpoint(tmp_path / "run" / "val-loss.best.ckpt").updates == UPDATES - EVERY
    capsys.readouterr()
    got = fit(build(tmp_path, True, resume=True, patience=1, lr=0.2))
    out = capsys.readouterr().out
    assert "Run run is finished (stopped early after epoch 3" in out
    assert "the weights loaded are those of update 25 (inside epoch 3), its checkpoint" in out
    assert got == records
