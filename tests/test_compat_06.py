"""Deepepochs 0.6 code keeps working: hook indices, `rename`, `batch_size`,
metric defaults, custom steps calling only `self.loss`, `do_loss`, 0.6 names and 0.6 checkpoints."""

from __future__ import annotations

import os
import re
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import (
    Callback,
    CheckCallback,
    CheckpointError,
    ConfigError,
    EpochTask,
    Optimizer,
    Trainer,
    rename,
)
from deepepochs.errors import DeepEpochsWarning
from deepepochs.metrics import accuracy

QUIET = {"log_batch": False, "show_info": False}


def data(n=64, batch_size=16, features=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = (x[:, 0] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class IndexRecorder(Callback):
    """Records the indices every epoch- and batch-level hook receives."""

    def __init__(self):
        self.seen = {}

    def _add(self, hook, value):
        self.seen.setdefault(hook, []).append(value)

    def on_before_epoch(self, trainer, train_tasks, val_tasks, epoch_idx):
        self._add("before_epoch", epoch_idx)

    def on_before_train_epochs(self, trainer, tasks, epoch_idx):
        self._add("before_train_epochs", epoch_idx)

    def on_after_train_epochs(self, trainer, tasks, metrics, epoch_idx):
        self._add("after_train_epochs", epoch_idx)

    def on_before_val_epochs(self, trainer, tasks, epoch_idx):
        self._add("before_val_epochs", epoch_idx)

    def on_after_val_epochs(self, trainer, tasks, metrics, epoch_idx):
        self._add("after_val_epochs", epoch_idx)

    def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx):
        self._add("after_epoch", epoch_idx)

    def on_before_train_batch(self, trainer, batch_x, batch_y, batch_idx):
        self._add("before_train_batch", batch_idx)

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        self._add("after_train_batch", batch_idx)

    def on_before_val_batch(self, trainer, batch_x, batch_y, batch_idx):
        self._add("before_val_batch", batch_idx)

    def on_after_val_batch(self, trainer, metrics, batch_idx):
        self._add("after_val_batch", batch_idx)

    def on_before_test_batch(self, trainer, batch_x, batch_y, batch_idx):
        self._add("before_test_batch", batch_idx)


def test_hooks_receive_zero_based_epoch_and_batch_indices_while_the_console_counts_from_one(capsys):
    """epoch_idx and batch_idx are 0-based as in 0.6 (`if epoch_idx == 0` fires once); the console keeps
    `E 1/3`."""
    train_dl, val_dl = data(64, 16), data(40, 16, seed=1)  # 4 training batches, 3 validation batches
    rec = IndexRecorder()
    epochs = 3
    trainer = Trainer(nn.Linear(4, 2), F.cross_entropy, epochs=epochs, callbacks=[rec], log_batch=False)
    trainer.fit(train_dl, val_dl)
    trainer.test(val_dl)
    trainer.close()
    per_epoch = list(range(epochs))
    for hook in ("before_epoch", "before_train_epochs", "after_train_epochs", "before_val_epochs",
                 "after_val_epochs", "after_epoch"):
        assert rec.seen[hook] == per_epoch, hook
    train_batches = [i for _ in range(epochs) for i in range(len(train_dl))]
    val_batches = [i for _ in range(epochs) for i in range(len(val_dl))]
    assert rec.seen["before_train_batch"] == rec.seen["after_train_batch"] == train_batches
    assert rec.seen["before_val_batch"] == rec.seen["after_val_batch"] == val_batches
    assert rec.seen["before_test_batch"] == list(range(len(val_dl)))
    out = capsys.readouterr().out
    assert "E 1/3  TRAIN>" in out and "E 3/3  TRAIN>" in out and "E 0/3" not in out


def _batch_losses(model, dl):
    """Plain PyTorch: each batch's mean cross-entropy and its (x, y)."""
    with torch.no_grad():
        return [(F.cross_entropy(model(x), y).item(), x, y) for x, y in dl]


def test_batch_size_int_weighs_every_batch_with_that_count_like_0_6():
    """fit/test(batch_size=16): each batch counts 16 samples (the short last batch too); it used to fail
    with "'int' object is not callable" at the first batch."""
    dl = data(40, 16)  # batches of 16, 16 and 8
    model = nn.Linear(4, 2)
    per_batch = _batch_losses(model, dl)
    with Trainer(model, F.cross_entropy, epochs=1, **QUIET) as trainer:
        got = trainer.test(dl, batch_size=16)["loss"]
        inferred = trainer.test(dl)["loss"]
    assert abs(got - sum(v for v, _, _ in per_batch) / len(per_batch)) < 1e-6
    weighted = sum(v * len(y) for v, _, y in per_batch) / sum(len(y) for _, _, y in per_batch)
    assert abs(inferred - weighted) < 1e-6 and abs(got - inferred) > 1e-4


def test_batch_size_function_gives_each_batch_its_weight_in_fit_test_and_epoch_task():
    """batch_size=fn(batch_x, batch_y) -> int weighs each batch, in test(), fit() and EpochTask."""
    dl = data(40, 16)
    model = nn.Linear(4, 2)

    def positives_plus_one(batch_x, batch_y):
        return int(batch_y.sum()) + 1

    per_batch = _batch_losses(model, dl)
    weights = [positives_plus_one(x, y) for _, x, y in per_batch]
    expected = sum(v * w for (v, _, _), w in zip(per_batch, weights)) / sum(weights)
    with Trainer(model, F.cross_entropy, opt=torch.optim.SGD(model.parameters(), lr=0.0), epochs=1,
                 **QUIET) as trainer:
        assert abs(trainer.test(dl, batch_size=positives_plus_one)["loss"] - expected) < 1e-6
        assert abs(trainer.test(tasks=[EpochTask(dl, batch_size=positives_plus_one)])["loss"] - expected) < 1e-6
        # lr=0: training leaves the weights as they are, so the training loss is the same weighted mean
        records = trainer.fit(dl, batch_size=positives_plus_one)
    assert abs(records["train"]["loss"][0] - expected) < 1e-6


def test_a_bad_batch_size_is_refused_naming_the_argument_and_what_it_accepts():
    """batch_size must be None, a positive int or a function; anything else is a ConfigError up front."""
    dl = data()
    with Trainer(nn.Linear(4, 2), F.cross_entropy, epochs=1, **QUIET) as trainer:
        for bad in (0, -3, True, "32", 2.5):
            with pytest.raises(ConfigError, match=r"batch_size must be None .* a positive int .* \(got "):
                trainer.fit(dl, batch_size=bad)
            with pytest.raises(ConfigError, match=r"batch_size must be None"):
                trainer.test(dl, batch_size=bad)
            with pytest.raises(ConfigError, match=r"batch_size must be None"):
                EpochTask(dl, batch_size=bad)


class LossOnlySteps(Trainer):
    """A 0.6-style custom trainer: its steps only call `self.loss(out, y)` and return nothing."""

    def train_step(self, batch_x, batch_y, **step_args):
        self.loss(self.model(batch_x), batch_y)

    def evaluate_step(self, batch_x, batch_y, **step_args):
        self.returned.append(self.loss(self.model(batch_x), batch_y))


def _plain_accuracy(model, dl):
    with torch.no_grad():
        x = torch.cat([x for x, _ in dl])
        y = torch.cat([y for _, y in dl])
        return (model(x).argmax(dim=1) == y).double().mean().item()


def test_custom_steps_that_only_call_self_loss_keep_the_trainers_metrics():
    """0.6 computed the trainer's metrics inside `self.loss`: a step that returns nothing still reports
    them (here the accuracy), in training, validation and test, equal to a plain PyTorch computation."""
    train_dl, val_dl = data(64, 16), data(48, 16, seed=1)
    model = nn.Linear(4, 2)
    trainer = LossOnlySteps(model, F.cross_entropy, opt=torch.optim.SGD(model.parameters(), lr=0.0), epochs=1,
                            metrics=[accuracy], **QUIET)
    trainer.returned = []
    records = trainer.fit(train_dl, val_dl)
    tested = trainer.test(val_dl)
    trainer.close()
    assert abs(records["train"]["accuracy"][0] - _plain_accuracy(model, train_dl)) < 1e-6
    assert abs(records["val"]["accuracy"][0] - _plain_accuracy(model, val_dl)) < 1e-6
    assert abs(tested["accuracy"] - _plain_accuracy(model, val_dl)) < 1e-6
    assert "loss" in records["val"] and "loss" in tested


def test_do_val_loss_false_and_do_loss_false_compute_no_evaluation_loss_in_custom_steps():
    """fit(do_val_loss=False) / test(do_loss=False): a custom evaluate step's `self.loss` computes no loss
    (the loss function is not called, None comes back) and none is reported; metrics still are."""
    calls = {"train": 0, "val": 0, "test": 0}

    def counting_loss(out, y):
        calls[trainer.loop.stage] += 1
        return F.cross_entropy(out, y)

    train_dl, val_dl = data(64, 16), data(48, 16, seed=1)
    model = nn.Linear(4, 2)
    trainer = LossOnlySteps(model, counting_loss, epochs=2, metrics=[accuracy], **QUIET)
    trainer.returned = []
    records = trainer.fit(train_dl, val_dl, do_val_loss=False)
    tested = trainer.test(val_dl, do_loss=False)
    trainer.close()
    assert calls == {"train": 2 * len(train_dl), "val": 0, "test": 0}
    assert set(records["val"]) == {"accuracy"} and set(tested) == {"accuracy"}
    assert trainer.returned == [None] * (3 * len(val_dl))
    assert abs(tested["accuracy"] - _plain_accuracy(model, val_dl)) < 1e-6



def _all_xy(dl):
    return torch.cat([x for x, _ in dl]), torch.cat([y for _, y in dl])


def test_rename_works_as_a_decorator_and_as_a_call_like_0_6():
    """`@rename('acc')` and `rename(fn, 'acc2')` name the metric; the values are the functions' values."""
    from sklearn.metrics import accuracy_score

    @rename("acc")
    def my_acc(preds, targets):
        return (preds.argmax(1) == targets).float().mean()

    other = rename(lambda preds, targets: (preds.argmax(1) == targets).float().mean(), "acc2")
    dl = data(48, 16)
    model = nn.Linear(4, 2)
    with Trainer(model, F.cross_entropy, epochs=1, **QUIET) as trainer:
        got = trainer.test(dl, metrics=[my_acc, other])
    x, y = _all_xy(dl)
    with torch.no_grad():
        expected = accuracy_score(y.numpy(), model(x).argmax(1).numpy())
    assert set(got) == {"loss", "acc", "acc2"}
    assert abs(got["acc"] - expected) < 1e-6 and abs(got["acc2"] - expected) < 1e-6


def _pr(preds, targets):
    from deepepochs.metrics import precision, recall

    return {"p": precision(preds, targets, average="binary"), "r": recall(preds, targets, average="binary")}


def test_rename_prefixes_the_keys_of_a_dict_metric_and_an_empty_name_keeps_them():
    """A dict metric under `@rename('m.')` reports `m.p`, `m.r`; under `@rename('')` plain `p`, `r`; the
    values equal scikit-learn's precision and recall."""
    from sklearn.metrics import precision_score, recall_score

    dl = data(64, 16)
    model = nn.Linear(4, 2)
    with Trainer(model, F.cross_entropy, epochs=1, **QUIET) as trainer:
        prefixed = trainer.test(dl, metrics=[rename("m.")(_pr)])
        kept = trainer.test(dl, metrics=[rename(_pr, "")])
    x, y = _all_xy(dl)
    with torch.no_grad():
        pred = model(x).argmax(1).numpy()
    p, r = precision_score(y.numpy(), pred, zero_division=0), recall_score(y.numpy(), pred, zero_division=0)
    assert set(prefixed) == {"loss", "m.p", "m.r"} and set(kept) == {"loss", "p", "r"}
    assert abs(prefixed["m.p"] - p) < 1e-6 and abs(prefixed["m.r"] - r) < 1e-6
    assert abs(kept["p"] - p) < 1e-6 and abs(kept["r"] - r) < 1e-6


def test_two_dict_metrics_with_the_same_keys_are_an_error_not_a_silent_overwrite():
    """Two dict metrics reporting the same key fail with a message naming both and the fix; prefixed with
    rename they both report."""

    def _pr_again(preds, targets):
        return _pr(preds, targets)

    dl = data(32, 16)
    with Trainer(nn.Linear(4, 2), F.cross_entropy, epochs=1, **QUIET) as trainer:
        with pytest.raises(ConfigError, match=r"metrics '_pr' and '_pr_again' both report 'p'.*@rename"):
            trainer.test(dl, metrics=[_pr, _pr_again])
        both = trainer.test(dl, metrics=[rename(_pr, "a."), rename(_pr_again, "b.")])
    assert set(both) == {"loss", "a.p", "a.r", "b.p", "b.r"} and both["a.p"] == both["b.p"]


def test_two_different_metrics_with_one_name_are_refused_before_training():
    """Two different functions both named 'acc' would replace each other: a ConfigError at fit()."""
    first = rename(lambda p, t: (p.argmax(1) == t).float().mean(), "acc")
    second = rename(lambda p, t: (p.argmax(1) != t).float().mean(), "acc")
    model = nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with Trainer(model, F.cross_entropy, epochs=1, **QUIET) as trainer:
        with pytest.raises(ConfigError, match=r"two different metrics .* both named 'acc'"):
            trainer.fit(data(), metrics=[first, second])
        trainer.test(data(), metrics=[first, first])  # the same function twice is one metric
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_an_empty_rename_on_a_single_value_metric_asks_for_a_name():
    """`rename(fn, '')` on a metric returning one number is an error that says to give it a name."""
    acc = rename(lambda p, t: (p.argmax(1) == t).float().mean(), "")
    with Trainer(nn.Linear(4, 2), F.cross_entropy, epochs=1, **QUIET) as trainer:
        with pytest.raises(ConfigError, match=r"rename\(fn, ''\) is for metrics that return a dict"):
            trainer.test(data(), metrics=[acc])
    with pytest.raises(ConfigError, match="rename's name must be a string"):
        rename(acc, 3)


def _save_06_checkpoint(path, model, epoch_idx):
    """A checkpoint in deepepochs 0.6's layout, made with plain PyTorch: a few Adam steps with a StepLR."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for x, y in data():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    sched.step()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model_state": model.state_dict(),
                "opt_state": [{"opt_state": opt.state_dict(), "sched_state": sched.state_dict()}],
                "best_value": 0.25, "epoch": epoch_idx}, path)
    return opt, sched


def _06_trainer(tmp_path, **kwargs):
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    check = CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=tmp_path / "ckpt")
    return Trainer(model, F.cross_entropy, Optimizer(opt, sched), epochs=4, callbacks=[check], **QUIET, **kwargs)


def test_a_0_6_checkpoint_loads_weights_optimizer_scheduler_and_epoch(tmp_path):
    """load_checkpoint reads 0.6's {'model_state', 'opt_state', 'best_value', 'epoch'}: the weights, Adam's
    moments, the scheduler and the completed epochs (0.6's 0-based epoch 2 = 3 epochs done) come back."""
    source = nn.Linear(4, 2)
    opt, sched = _save_06_checkpoint(tmp_path / "old.ckpt", source, epoch_idx=2)
    trainer = _06_trainer(tmp_path)
    with pytest.warns(DeepEpochsWarning, match=r"old\.ckpt records no parameter names .*mapped to the parameters by"
                                               r" position"):
        trainer.load_checkpoint(tmp_path / "old.ckpt")
    for mine, theirs in zip(trainer.raw_model.parameters(), source.parameters()):
        assert torch.equal(mine, theirs)
    loaded = trainer.opt[0].opt.state_dict()
    for pid, state in opt.state_dict()["state"].items():
        assert torch.equal(loaded["state"][pid]["exp_avg"], state["exp_avg"])
    assert trainer.opt[0].scheduler.state_dict() == sched.state_dict()
    assert trainer.loop.completed_epochs == 3
    records = trainer.fit(data())
    trainer.close()
    assert len(records["train"]["loss"]) == 1  # epochs=4: one epoch was left


def _save_0618_checkpoint_after_a_resume(path, model, epoch_idx):
    """What deepepochs 0.6.18 wrote after it had resumed a run: its `Optimizer.load_state_dict` loaded the
    optimizer's state into the scheduler (`scheduler.load_state_dict(opt_state)`), so the scheduler's state,
    saved again, holds the optimizer's `state` and `param_groups` beside its own counters, which restarted at
    the resume. Made here with torch's own calls, as 0.6.18 made it. Returns (opt, the scheduler's own state)."""
    opt, sched = _save_06_checkpoint(path, model, epoch_idx)
    resumed = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    resumed.load_state_dict(opt.state_dict())  # 0.6.18's slip, at its resume
    own = {k: v for k, v in resumed.state_dict().items() if k not in ("state", "param_groups")}
    assert {"state", "param_groups"} <= set(resumed.state_dict())
    torch.save({"model_state": model.state_dict(),
                "opt_state": [{"opt_state": opt.state_dict(), "sched_state": resumed.state_dict()}],
                "best_value": torch.tensor(0.25), "epoch": epoch_idx}, path)
    return opt, own


def test_resume_true_loads_a_0618_checkpoint_written_after_a_0618_resume(tmp_path):
    """A 0.6.18 file written after a 0.6.18 resume (its scheduler state holding the optimizer's too) is
    loaded by resume=True, not skipped for another run's older file: the weights, Adam's moments, the
    scheduler's own state as 0.6.18 kept it and the completed epochs come back, and the run continues."""
    older = tmp_path / "ckpt" / "first-run" / "checkpoint.ckpt"
    _save_06_checkpoint(older, nn.Linear(4, 2), epoch_idx=0)
    newer = tmp_path / "ckpt" / "resumed-run" / "checkpoint.ckpt"
    source = nn.Linear(4, 2)
    opt, sched_state = _save_0618_checkpoint_after_a_resume(newer, source, epoch_idx=2)
    os.utime(newer, (older.stat().st_mtime + 10,) * 2)
    trainer = _06_trainer(tmp_path, resume=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(data(), epochs=3)  # the file's 3 epochs are the target: nothing is trained
    assert not [w for w in caught if "skipped" in str(w.message)], [str(w.message) for w in caught]
    assert trainer.running_id == "resumed-run" and trainer.loop.completed_epochs == 3
    for mine, theirs in zip(trainer.raw_model.parameters(), source.parameters()):
        assert torch.equal(mine, theirs)
    loaded = trainer.opt[0].opt.state_dict()
    for pid, state in opt.state_dict()["state"].items():
        assert torch.equal(loaded["state"][pid]["exp_avg_sq"], state["exp_avg_sq"])
    assert trainer.opt[0].scheduler.state_dict() == sched_state
    assert len(trainer.fit(data(), epochs=4)["train"]["loss"]) == 1
    trainer.close()


def test_resume_true_continues_a_0_6_run_and_skips_a_foreign_file_without_aborting(tmp_path):
    """resume=True finds 0.6's `<ckpt_dir>/<run>/checkpoint.ckpt` and continues it (its optimizer states by
    position, which a warning says); a 0.6 file of another model (newer) is skipped with a warning naming
    it, never stopping fit()."""
    good = tmp_path / "ckpt" / "old-run" / "checkpoint.ckpt"
    source = nn.Linear(4, 2)
    _save_06_checkpoint(good, source, epoch_idx=1)
    foreign = tmp_path / "ckpt" / "other-model" / "checkpoint.ckpt"
    foreign.parent.mkdir(parents=True)
    torch.save({"model_state": nn.Linear(7, 3).state_dict(), "opt_state": [], "best_value": 1.0, "epoch": 5},
               foreign)
    os.utime(foreign, (good.stat().st_mtime + 10,) * 2)  # the newest file
    trainer = _06_trainer(tmp_path, resume=True)
    with pytest.warns(DeepEpochsWarning) as caught:
        records = trainer.fit(data())
    messages = [str(w.message) for w in caught]
    assert any(re.search(r"skipped .*other-model.checkpoint\.ckpt: .*does not fit", m) for m in messages)
    assert any(re.search(r"old-run.checkpoint\.ckpt records no parameter names", m) for m in messages)
    trainer.close()
    assert trainer.running_id == "old-run" and len(records["train"]["loss"]) == 2  # epochs 3 and 4


def test_a_0_6_file_of_an_unknown_layout_is_refused_with_how_to_convert_it(tmp_path):
    """An opt_state that is neither 0.6's list nor an optimizer state: CheckpointError with a recipe."""
    path = tmp_path / "odd.ckpt"
    torch.save({"model_state": nn.Linear(4, 2).state_dict(), "opt_state": "adam", "epoch": 0}, path)
    with pytest.raises(CheckpointError, match=r"odd\.ckpt: the 0\.6 checkpoint's opt_state .*torch\.save\("):
        _06_trainer(tmp_path).load_checkpoint(path)


def test_a_0_6_step_unpacking_a_single_input_gets_a_hint_to_call_the_model_with_batch_x():
    """0.6 passed one input as a one-item list, so 0.6 steps call self.model(*batch_x); here that unpacks the
    tensor's rows, and the TypeError carries a note saying to call self.model(batch_x)."""

    class Old(Trainer):
        def train_step(self, batch_x, batch_y, **step_args):
            self.loss(self.model(*batch_x), batch_y)

    trainer = Old(nn.Linear(4, 2), F.cross_entropy, epochs=1, **QUIET)
    with pytest.raises(TypeError) as info:
        trainer.fit(data())
    assert any("call self.model(batch_x), not self.model(*batch_x)" in n for n in info.value.__notes__)
    with pytest.raises(TypeError) as info:  # a TypeError of another origin gets no such note
        Trainer(nn.Linear(4, 2), lambda out, y: F.cross_entropy(out, y, 1, 2, 3, 4, 5, 6, 7, 8), epochs=1,
                **QUIET).fit(data())
    assert not any("self.model(*batch_x)" in n for n in getattr(info.value, "__notes__", []))


def test_int_running_id_and_resume_of_0_6_name_the_run_folder(tmp_path):
    """0.6's running_id=1 / resume=1: the run folder is '1', and resume=1 continues that run."""
    def make(**kwargs):
        check = CheckCallback("loss", on_stage="train", save_best=False, ckpt_dir=tmp_path)
        return Trainer(nn.Linear(4, 2), F.cross_entropy, epochs=2, callbacks=[check], **QUIET, **kwargs)

    first = make(running_id=1)
    first.fit(data(), epochs=1)
    first.close()
    assert first.running_id == "1" and (tmp_path / "1" / "train-loss.latest.ckpt").is_file()
    second = make(resume=1)
    records = second.fit(data())
    second.close()
    assert second.running_id == "1" and len(records["train"]["loss"]) == 2  # epoch 1 from the file, epoch 2
    with pytest.raises(ConfigError, match=r"resume must be False, True or a running id .* \(got 2\.5\)"):
        make(resume=2.5)


def test_a_patch_name_prefixes_the_keys_of_its_dict_result_like_0_6():
    """A step's `ConfusionPatch(..., name='C.')` is shown as `C.accuracy`, a nameless one behind the key it
    was returned under (`cmaccuracy`, as 0.6.18 shows it), `name=''` as `accuracy`; the value equals
    sklearn's accuracy."""
    from sklearn.metrics import accuracy_score

    from deepepochs import ConfusionPatch

    class Named(EpochTask):
        def step(self, batch_x, batch_y, **step_args):
            out = self.model(batch_x)
            self.loss(out, batch_y)
            return {"cm": ConfusionPatch(out, batch_y, metrics=["accuracy"], name=step_args["prefix"])}

    dl = data(48, 16)
    model = nn.Linear(4, 2)
    with Trainer(model, F.cross_entropy, epochs=1, **QUIET) as trainer:
        named = trainer.test(tasks=[Named(dl, prefix="C.")])
        plain = trainer.test(tasks=[Named(dl, prefix=None)])
        empty = trainer.test(tasks=[Named(dl, prefix="")])
    x, y = _all_xy(dl)
    with torch.no_grad():
        expected = accuracy_score(y.numpy(), model(x).argmax(1).numpy())
    assert set(named) == {"loss", "C.accuracy"} and set(plain) == {"loss", "cmaccuracy"}
    assert set(empty) == {"loss", "accuracy"}
    assert abs(named["C.accuracy"] - expected) < 1e-6
    assert named["C.accuracy"] == plain["cmaccuracy"] == empty["accuracy"]


def test_a_0_6_patch_that_sets_its_state_in_init_without_load_works_in_a_step():
    """0.6 patches had no load(): their state came from __init__. Such a patch returned by a step is added
    over the batches, and its dict result equals counting by hand."""
    from deepepochs import PatchBase, sum_dicts

    class HitsPatch(PatchBase):
        def __init__(self, preds, targets, name=None):
            super().__init__(name)
            top2 = preds.topk(2, dim=1).indices
            self.counts = {"@1": int((top2[:, 0] == targets).sum()), "@2": int((top2 == targets[:, None]).any(1).sum())}

        def forward(self):
            return self.counts

        def add(self, other):
            self.counts = sum_dicts([self.counts, other.counts])
            return self

    class Task(EpochTask):
        def step(self, batch_x, batch_y, **step_args):
            out = self.model(batch_x)
            self.loss(out, batch_y)
            return {"hits": HitsPatch(out, batch_y)}

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(50, 4, generator=g), torch.randint(0, 4, (50,), generator=g)
    model = nn.Linear(4, 4)
    with Trainer(model, F.cross_entropy, epochs=1, **QUIET) as trainer:
        got = trainer.test(tasks=[Task(DataLoader(TensorDataset(x, y), batch_size=16))])
    with torch.no_grad():
        top2 = model(x).topk(2, dim=1).indices
    # 0.6.18 shows a dict result behind the key its patch was returned under: hits@1, hits@2
    assert set(got) == {"loss", "hits@1", "hits@2"}
    assert got["hits@1"] == int((top2[:, 0] == y).sum())
    assert got["hits@2"] == int((top2 == y[:, None]).any(1).sum())
    with pytest.raises(NotImplementedError, match=r"HitsPatch\.load\(\) is not implemented"):
        HitsPatch(torch.eye(2), torch.tensor([0, 1])).load(torch.eye(2))


def test_set_seed_takes_0_6s_float_seed_with_an_integral_value():
    """set_seed(1.0), as 0.6's examples call it, seeds exactly like set_seed(1); 1.5 is refused."""
    import random

    import numpy as np

    from deepepochs import set_seed

    set_seed(1)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    set_seed(1.0)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
    with pytest.raises(ConfigError, match=r"seed must be an int.*\(got 1\.5\)"):
        set_seed(1.5)


def test_0_6_manual_accumulation_with_grad_accumulate_and_loss_optimize_matches_plain_pytorch():
    """0.6's hand-split step (batches/concat, self.loss(..., grad_accumulate=True), self.loss.optimize(),
    self.loss.on_metric_callback(...)) trains to the weights of the same loop in plain PyTorch and reports
    the accuracy of the outputs it saw."""
    from deepepochs import batches, concat

    class Old(Trainer):
        def train_step(self, batch_x, batch_y, **step_args):
            outs, loss_value = [], 0.0
            adjust = 4 / batch_y.shape[0]
            for sub_x, sub_y in zip(batches(batch_x, 4), batches(batch_y, 4)):
                out = self.model(sub_x)
                loss_value += self.loss(out, sub_y, loss_adjust=adjust, grad_accumulate=True) * sub_y.shape[0]
                outs.append(out)
            self.loss.optimize()
            self.loss.on_metric_callback(loss_value / batch_y.shape[0], concat(outs), batch_y)

    dl = data(48, 16)
    torch.manual_seed(5)
    model, ref = nn.Linear(4, 2), nn.Linear(4, 2)
    ref.load_state_dict(model.state_dict())
    trainer = Old(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), epochs=1,
                  metrics=[accuracy], **QUIET)
    records = trainer.fit(dl)
    trainer.close()
    ref_opt, correct = torch.optim.SGD(ref.parameters(), lr=0.1), 0
    for x, y in dl:
        outs = []
        for sub_x, sub_y in zip(torch.split(x, 4), torch.split(y, 4)):
            out = ref(sub_x)
            (F.cross_entropy(out, sub_y) * (4 / len(y))).backward()
            outs.append(out.detach())
        correct += int((torch.cat(outs).argmax(1) == y).sum())
        ref_opt.step()
        ref_opt.zero_grad()
    for mine, theirs in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(mine, theirs, atol=1e-6)
    assert abs(records["train"]["accuracy"][0] - correct / 48) < 1e-6


def test_a_state_dict_saved_by_plain_pytorch_is_refused_with_how_to_convert_it(tmp_path):
    """A bare model.state_dict() file (neither this format nor 0.6's) names the missing keys and the
    torch.save recipe; written that way it loads."""
    model = nn.Linear(4, 2)
    torch.save(model.state_dict(), tmp_path / "weights.ckpt")
    mine = nn.Linear(4, 2)
    trainer = Trainer(mine, F.cross_entropy, torch.optim.Adam(mine.parameters(), lr=0.01), epochs=4, **QUIET)
    with pytest.raises(CheckpointError, match=r"weights\.ckpt is not a deepepochs checkpoint: .*convert it with"
                                              r" torch\.save\(\{'format_version': 1"):
        trainer.load_checkpoint(tmp_path / "weights.ckpt")
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    torch.save({"format_version": 1, "epoch": 2, "model": model.state_dict(), "optimizers": [opt.state_dict()],
                "schedulers": [None]}, tmp_path / "converted.ckpt")
    trainer.load_checkpoint(tmp_path / "converted.ckpt")
    assert trainer.loop.completed_epochs == 2
    assert all(torch.equal(a, b) for a, b in zip(trainer.raw_model.parameters(), model.parameters()))


def test_epoch_task_step_args_dict_is_one_keyword_as_0_6_18_or_unpacked_for_a_step_without_it():
    """`EpochTask(dl, step_args={...})`: a step taking `**step_args` gets it as the one keyword `step_args`
    (0.6.18); a step without such a parameter gets it unpacked (older 0.6), like `EpochTask(dl, scale=...)`;
    a non-dict is refused naming the argument."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    from deepepochs import ConfigError, EpochTask, Trainer

    seen, received = [], []

    class Task(EpochTask):
        def step(self, batch_x, batch_y, scale=1.0):
            seen.append(scale)
            return None

    class Task0618(EpochTask):
        def step(self, batch_x, batch_y, **step_args):
            received.append(step_args)
            return None

    model = nn.Linear(3, 1)
    data = [(torch.randn(4, 3), torch.randn(4, 1))]
    trainer = Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), epochs=1, device="cpu",
                      log_batch=False, show_info=False)
    trainer.test(tasks=[Task(data, step_args={"scale": 3.0}), Task(data, scale=5.0)])
    trainer.test(tasks=[Task0618(data, step_args={"scale": 3.0}), Task0618(data, scale=5.0)])
    trainer.close()
    assert seen == [3.0, 5.0]
    assert received == [{"step_args": {"scale": 3.0}}, {"scale": 5.0}]
    with pytest.raises(ConfigError, match=r"step_args must be a dict"):
        EpochTask(data, step_args=[1])
