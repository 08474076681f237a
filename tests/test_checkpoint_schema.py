"""The field rules: each damaged field a real checkpoint can carry is refused before anything is applied,
with CheckpointError naming the file, the field and the type found (resume=True skips it with a warning);
damaged run-end and progress records are ignored with a warning naming them."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from checkpoint_helpers import regression_batches
from torch import nn

from deepepochs import CheckCallback, Optimizer, SnapshotCallback, Trainer
from deepepochs.checkpoint.finished import FINISHED_FILE, PROGRESS_FILE
from deepepochs.errors import CheckpointError, DeepEpochsWarning


def _trainer(folder, resume=False, epochs=2, amsgrad=False, snapshots=False, save_best=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=amsgrad)
    callbacks = [CheckCallback("loss", on_stage="train", save_best=save_best, ckpt_dir=folder)]
    if snapshots:
        callbacks.append(SnapshotCallback(folder, every_n_updates=1, keep=100))
    return Trainer(model, F.mse_loss, Optimizer(opt, torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)), epochs=epochs,
                   device="cpu", callbacks=callbacks, resume=resume, running_id="run", log_batch=False,
                   show_info=False)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    folder = tmp_path_factory.mktemp("written")
    trainer = _trainer(folder, snapshots=True)
    trainer.fit(regression_batches(), epochs=1)
    files = sorted((folder / "run").glob("*.ckpt"))
    latest = torch.load(folder / "run" / "train-loss.latest.ckpt", weights_only=True)
    snapshot = next(d for d in (torch.load(f, weights_only=True) for f in files)
                    if d["position"] is not None and d["position"]["batches_done"] == 2)
    return latest, snapshot


def _damaged(data, change):
    data = copy.deepcopy(data)
    change(data)
    return data


def _first_group(d):
    return d["optimizers"][0]["param_groups"][0]


def _set_first_moment(d, value):
    d["optimizers"][0]["state"][0]["exp_avg"] = value


def _monitor(d):
    return d["monitors"]["train-loss.latest"]


CASES = {
    "lr of another type": (lambda d: _first_group(d).update(lr="x"),
                           r"optimizers\[0\]\['param_groups'\]\[0\]\['lr'\] must be a number \(got str 'x'\)"),
    "eps NaN": (lambda d: _first_group(d).update(eps=math.nan),
                r"\['eps'\] must be a finite number \(got float nan\)"),
    "a negative weight decay": (lambda d: _first_group(d).update(weight_decay=-1),
                                r"\['weight_decay'\] must lie in \[0, inf\] \(got int -1\)"),
    "a beta of 1": (lambda d: _first_group(d).update(betas=(0.9, 1.0)),
                    r"\['betas'\]\[1\] must lie in \[0, 1\) \(got float 1\.0\)"),
    "amsgrad of another type": (lambda d: _first_group(d).update(amsgrad=1),
                                r"\['amsgrad'\] must be a bool \(got int 1\)"),
    "amsgrad switched on without its state": (
        lambda d: _first_group(d).update(amsgrad=True),
        r"optimizers\[0\]\['state'\]\[0\] must hold the states \['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq',"
        r" 'step'\] that Adam keeps"),
    "capturable on a CPU": (lambda d: _first_group(d).update(capturable=True),
                            r"param_groups'\]\[0\] holds hyper-parameters with which Adam fails its step here"),
    "a huge learning rate": (lambda d: _first_group(d).update(lr=2.0**62),
                             r"\['lr'\] must be at most 1e\+06"),
    "a 0-d moment": (lambda d: _set_first_moment(d, torch.tensor(0.0)),
                     r"\['state'\]\[0\]\['exp_avg'\] must be of its parameter's shape \(3, 4\) \(got a torch.float32"
                     r" tensor of shape \(\)\)"),
    "a moment of NaNs": (lambda d: _set_first_moment(d, torch.full((3, 4), math.nan)),
                         r"\['exp_avg'\] must be finite \(got a torch.float32 tensor of shape \(3, 4\) holding inf"),
    "a step that is no tensor": (lambda d: d["optimizers"][0]["state"][0].update(step=3),
                                 r"\['state'\]\[0\]\['step'\] must be a tensor \(got int 3\)"),
    "params that are a list of lists": (lambda d: _first_group(d).update(params=[[0], [1], [2], [3]]),
                                        r"\['params'\] must be the parameter indices \[0\.\.3\] \(got list"),
    "a scheduler's step size of another type": (
        lambda d: d["schedulers"][0].update(step_size="x"), r"schedulers\[0\]\['step_size'\] must be an int"),
    "a scheduler's gamma of 0": (lambda d: d["schedulers"][0].update(gamma=0.0),
                                 r"schedulers\[0\]\['gamma'\] must lie in \(0, inf\]"),
    "base_lrs of another type": (lambda d: d["schedulers"][0].update(base_lrs="x"),
                                 r"schedulers\[0\]\['base_lrs'\] must be a list of 1 \(got str 'x'\)"),
    "a last_epoch beyond any run": (lambda d: d["schedulers"][0].update(last_epoch=2**62),
                                    r"\['last_epoch'\] must lie in \[-1, 1099511627776\]"),
    "a best value of NaN": (lambda d: _monitor(d).update(best=math.nan), r"monitors\['train-loss\.latest'\]"
                            r"\['best'\] must be None or a number, not NaN \(got float nan\)"),
    "a best value of another type": (lambda d: _monitor(d).update(best="x"),
                                     r"\['best'\] must be None or a number, not NaN \(got str 'x'\)"),
    "an epoch beyond any run": (lambda d: d.update(epoch=2**62), r"epoch must be an int in \[0, 1099511627776\]"),
    "a world size beyond any run": (lambda d: d.update(world_size=2**62), r"world_size must be an int in \[1, "),
    "an order seed of NaN": (lambda d: d.update(order_seed=math.nan),
                             r"order_seed must be an int .* \(got float nan\)"),
    "a running id that is no str": (lambda d: d.update(running_id=5), r"'running_id' must be a str \(got int\)"),
    "a history of strings": (lambda d: d["history"]["train"].update(loss=["x"]),
                             r"history\['train'\]\['loss'\] must be a list of numbers"),
    "a generator state that is no tensor": (lambda d: d["rng"].update(torch=5),
                                            r"rng\['torch'\] must be a tensor like the trainer's \(got int 5\)"),
    "per-rank generator states of another world size": (lambda d: d.update(rng={"ranks": [d["rng"]] * 2}),
                                                        r"rng\['ranks'\] must be a list of one generator state per"
                                                        r" rank \(1, the file's world_size; got 2 states\)"),
    "a rank's damaged generator state": (lambda d: d.update(rng={"ranks": [{**d["rng"], "torch": 5}]}),
                                         r"rng\['ranks'\]\[0\]\['torch'\] must be a tensor like the trainer's"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_field_is_refused_naming_it_and_resume_skips_the_file(tmp_path, written, case):
    """load_checkpoint raises CheckpointError naming the file and the field (and changes nothing);
    resume=True skips the file with that message and trains the run afresh."""
    change, message = CASES[case]
    latest, _ = written
    (tmp_path / "run").mkdir()
    path = tmp_path / "run" / "train-loss.latest.ckpt"
    torch.save(_damaged(latest, change), path)
    trainer = _trainer(tmp_path / "other")
    weights = copy.deepcopy(trainer.raw_model.state_dict())
    with pytest.raises(CheckpointError, match=r"train-loss\.latest\.ckpt.*" + message):
        trainer.load_checkpoint(path)
    assert all(torch.equal(v, weights[k]) for k, v in trainer.raw_model.state_dict().items())
    assert trainer.loop.completed_epochs == 0 and not trainer.opt[0].opt.state
    resumed = _trainer(tmp_path, resume=True)
    with pytest.warns(DeepEpochsWarning, match=r"skipped .*train-loss\.latest\.ckpt: .*" + message):
        records = resumed.fit(regression_batches())
    assert len(records["train"]["loss"]) == 2


def test_an_undamaged_file_loads_and_trains_on(tmp_path, written):
    """The rules admit what a real fit wrote: it loads, and the next fit trains to its target."""
    latest, snapshot = written
    for data in (latest, snapshot):
        torch.save(data, tmp_path / "ok.ckpt")
        trainer = _trainer(tmp_path / "other")
        trainer.load_checkpoint(tmp_path / "ok.ckpt")
        trainer.fit(regression_batches())
        assert trainer.loop.completed_epochs == 2


SNAPSHOT_CASES = {
    "an epoch that is not the next": (lambda p: p.update(epoch=5),
                                      r"position\['epoch'\] must be the epoch after the 0 completed, 1 \(got int 5\)"),
    "a count of batches of another type": (lambda p: p.update(batches_done="x"),
                                           r"epoch and world_size must be ints|position\['batches_done'\] must be"),
    "a generator state that is no tensor": (
        lambda p: p["ranks"][0]["random"].update(commit=[5, None]),
        r"position\['ranks'\]\[0\]\['random'\]\['commit'\] must be \[CPU generator"),
    "a meter count of another type": (lambda p: p["ranks"][0]["meters"][0].update(count="x"),
                                      r"position\['ranks'\]\[0\]\['meters'\]\[0\]\['count'\] must be an int"),
    "a loss sum that is no tensor": (lambda p: p["ranks"][0]["meters"][0].update(loss_sum=5),
                                     r"\['loss_sum'\] must be None or a 0-d float tensor \(got int 5\)"),
    "a batch size without a sample count": (lambda p: p.update(batch_size=4),
                                            r"position\['batch_size'\] and position\['samples_done'\] must both be"),
}


@pytest.mark.parametrize("case", list(SNAPSHOT_CASES))
def test_a_damaged_snapshot_position_is_refused_naming_the_field(tmp_path, written, case):
    """A mid-epoch snapshot whose position is damaged: CheckpointError naming the field."""
    change, message = SNAPSHOT_CASES[case]
    _, snapshot = written
    torch.save(_damaged(snapshot, lambda d: change(d["position"])), tmp_path / "snap.ckpt")
    with pytest.raises(CheckpointError, match=r"snap\.ckpt.*" + message):
        _trainer(tmp_path / "other").load_checkpoint(tmp_path / "snap.ckpt")


@pytest.fixture
def finished_run(tmp_path):
    """A run of 2 epochs that finished (its finished.pt beside its checkpoint)."""
    trainer = _trainer(tmp_path)
    trainer.fit(regression_batches())
    return tmp_path / "run" / FINISHED_FILE


FINISHED_CASES = {
    "records that are a list": (lambda d: d.update(records=[]), r"records must be a dict of stages \(got list"),
    "records that are a string": (lambda d: d.update(records="x"), r"records must be a dict of stages \(got str"),
    "a stage that is a number": (lambda d: d.update(records={"train": 5}),
                                 r"records\['train'\] must be a dict of metric names to lists \(got int 5\)"),
    "values that are strings": (lambda d: d.update(records={"train": {"loss": "x"}}),
                                r"records\['train'\]\['loss'\] must be a list of numbers \(got str"),
    "a million epochs": (lambda d: d.update(completed_epochs=10**6),
                         r"records\['train'\]\['loss'\] must hold 1000000 values"),
    "a stop reason of another type": (lambda d: d.update(stop_reason=5),
                                      r"stop_reason must be None or a string \(got int 5\)"),
    "a missing key": (lambda d: d.pop("target_epochs"), r"it must be a dict of \['completed_epochs'"),
}


@pytest.mark.parametrize("case", list(FINISHED_CASES))
def test_a_damaged_run_end_record_is_ignored_with_a_warning_and_the_run_trains_on(tmp_path, finished_run, case):
    """A damaged finished.pt is not used: a warning names it and the broken field, and the resumed fit trains
    (to a raised target) from the checkpoint, as for a run without the record."""
    change, message = FINISHED_CASES[case]
    data = torch.load(finished_run, weights_only=True)
    torch.save(_damaged(data, change), finished_run)
    resumed = _trainer(finished_run.parent.parent, resume=True, epochs=3)
    with pytest.warns(DeepEpochsWarning, match=r"resume ignored .*finished\.pt: its fields break the run-end"
                                               r" record's rules: .*" + message):
        records = resumed.fit(regression_batches())
    assert len(records["train"]["loss"]) == 3 and resumed.loop.completed_epochs == 3


def test_a_damaged_progress_record_is_ignored_with_a_warning(tmp_path):
    """progress.pt whose count is not an int: a warning names it; the resume goes on from the checkpoint."""
    trainer = _trainer(tmp_path, save_best=True)
    trainer.fit(regression_batches())
    (tmp_path / "run" / FINISHED_FILE).unlink()
    torch.save({"completed_epochs": "x"}, tmp_path / "run" / PROGRESS_FILE)
    resumed = _trainer(tmp_path, resume=True, epochs=3, save_best=True)
    with pytest.warns(DeepEpochsWarning, match=r"resume ignored .*progress\.pt: its fields break the progress"
                                               r" record's rule: completed_epochs must be an int"):
        resumed.fit(regression_batches())
    assert resumed.loop.completed_epochs == 3
