"""The claims of docs/MIGRATION.md, one test (or more) each: what deepepochs 0.6.18 code does when it runs
on this library, and what each intentional difference looks like. The page's own `python` blocks run in
tests/test_migration_doc.py; the tests here check what the page says about them."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, ConfigError, EpochTask, Trainer, TrainerBase

QUIET = dict(log_batch=False, show_info=False, device="cpu")


def data(n=64, batch_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


def model(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(4, 2)


# ---- callback hooks ----
class KeywordHooks(Callback):
    """0.6.18's style: every hook argument by keyword."""

    def __init__(self):
        self.calls = []

    def on_after_train_batch(self, trainer, **kwargs):
        self.calls.append(("batch", kwargs["batch_idx"], kwargs["metrics"]["loss"].item()))

    def on_after_epoch(self, trainer, **kwargs):
        self.calls.append(("epoch", kwargs["epoch_idx"], kwargs["train_metrics"]["loss"].item(),
                           kwargs["val_metrics"]["loss"].item()))


def test_hooks_taking_their_arguments_by_keyword_get_them_by_keyword():
    """`def on_after_train_batch(self, trainer, **kwargs)` is called with the hook's arguments by name; the
    values equal what a positional hook receives, and the records fit() returns."""
    dl = data()
    hooks = KeywordHooks()
    trainer = Trainer(model(), F.cross_entropy, epochs=2, callbacks=[hooks], **QUIET)
    records = trainer.fit(dl, dl)
    batches = [c for c in hooks.calls if c[0] == "batch"]
    assert [c[1] for c in batches] == list(range(len(dl))) * 2
    epochs = [c for c in hooks.calls if c[0] == "epoch"]
    assert [c[1] for c in epochs] == [0, 1]
    assert [c[2] for c in epochs] == records["train"]["loss"]
    assert [c[3] for c in epochs] == records["val"]["loss"]


def test_a_hook_that_takes_neither_form_is_refused_when_attached():
    """A hook whose parameters fit neither the positional nor the keyword call fails at the Trainer."""

    class Wrong(Callback):
        def on_after_train_batch(self, trainer, metric_values):
            pass

    with pytest.raises(ConfigError, match=r"on_after_train_batch.*by position or by keyword"):
        Trainer(model(), F.cross_entropy, callbacks=[Wrong()], **QUIET)


class KeepsMetrics(Callback):
    def __init__(self):
        self.kept = []

    def on_after_train_epoch(self, trainer, task, metrics):
        self.kept.append(metrics)


def test_metric_values_in_user_hooks_answer_item_and_records_stay_plain_floats(tmp_path):
    """0.6.18's hooks got tensors (`metrics['loss'].item()`); here the values are floats that answer `.item()`.
    The trainer's own records hold plain floats (`torch.load(weights_only=True)` reads them back), and a
    value a hook keeps copies and pickles as a plain float."""
    import copy

    dl = data()
    keeper = KeepsMetrics()
    trainer = Trainer(model(), F.cross_entropy, epochs=1, callbacks=[keeper], **QUIET)
    records = trainer.fit(dl)
    kept = keeper.kept[0]
    assert kept["loss"].item() == records["train"]["loss"][0]
    assert kept["loss"] + 1 == records["train"]["loss"][0] + 1 and f"{kept['loss']:.3f}"
    assert type(records["train"]["loss"][0]) is float and type(trainer.history["train"]["loss"][0]) is float
    torch.save({"records": records, "history": trainer.history}, tmp_path / "records.pt")
    loaded = torch.load(tmp_path / "records.pt", weights_only=True)
    assert loaded["records"] == records
    assert type(pickle.loads(pickle.dumps(kept["loss"]))) is float
    assert type(copy.deepcopy(kept)["loss"]) is float


# ---- helpers, optimizers, callbacks: 0.6.18's spellings ----
def test_optimizer_lr_accessors_answer_as_in_0618():
    """`trainer.opt.get_current_lr()` (one optimizer: a float; several: a list), `trainer.opt[i].get_last_lr()`
    (the scheduler's, None without one), checked against the torch optimizer and scheduler themselves."""
    from deepepochs import Optimizer

    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    first = torch.optim.SGD(net[0].parameters(), lr=0.1)
    second = torch.optim.SGD(net[1].parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(first, 1, gamma=0.5)
    trainer = Trainer(net, F.cross_entropy, [Optimizer(first, sched), second], epochs=2, **QUIET)
    trainer.fit(data())
    assert trainer.opt.get_current_lr() == [first.param_groups[0]["lr"], 0.5] == [0.025, 0.5]
    assert trainer.opt[0].get_last_lr() == sched.get_last_lr() and trainer.opt[1].get_last_lr() is None
    assert trainer.opt.get_last_lr() == [sched.get_last_lr(), None]
    assert trainer.opt[0].param_groups is first.param_groups
    net = model()
    single = Trainer(net, F.cross_entropy, torch.optim.SGD(net.parameters(), lr=0.3), **QUIET)
    assert single.opt.get_current_lr() == 0.3 and single.opt.get_last_lr() is None


def test_plot_confusion_takes_both_signatures():
    """0.7's `plot_confusion(cm, class_names, normalize, title)` and 0.6.18's `plot_confusion(cm, class_num,
    class_names, norm_dec, cmap, info)` draw the same matrix; 0.6.18's title counts the samples."""
    pytest.importorskip("matplotlib")
    from deepepochs import plot_confusion

    cm = torch.tensor([[3, 1], [0, 4]])
    new = plot_confusion(cm, ["a", "b"], False, "T")
    old = plot_confusion(cm, 2, ["a", "b"], 2, "Reds", "run 1")
    assert new.axes[0].get_title() == "T"
    assert old.axes[0].get_title() == "Confusion matrix (8)\nrun 1"
    for fig in (new, old):
        assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["a", "b"]
        assert sorted(t.get_text() for t in fig.axes[0].texts) == ["0", "1", "3", "4"]
    with pytest.raises(ConfigError, match=r"class_num must be the size .* class_num=3"):
        plot_confusion(cm, 3)


def test_confusion_metrics_takes_beta_third_as_0618_did():
    """`ConfusionMetrics(metrics, average, beta, name)` positionally: the F-beta equals the formula on the
    matrix counted by hand."""
    from deepepochs import ConfusionMetrics

    preds, targets = torch.tensor([1, 1, 0, 1, 0, 0, 1]), torch.tensor([1, 0, 0, 1, 1, 1, 1])
    patch = ConfusionMetrics(["fbeta"], "binary", 2.0, "B.").load(preds, targets)
    values = {patch.name + key: value for key, value in patch().items()}  # the trainer shows them so
    tp, fp, fn = 3, 1, 2
    p, r = tp / (tp + fp), tp / (tp + fn)
    assert values["B.fb"] == pytest.approx((1 + 4) * p * r / (4 * p + r))


def test_set_seed_takes_a_string_of_digits_and_sum_dicts_reads_keys_as_attributes():
    """`set_seed('3')` seeds as `set_seed(3)`; `sum_dicts([...]).a` is the sum's key 'a'."""
    from deepepochs import set_seed, sum_dicts

    set_seed("3")
    a = torch.rand(3)
    set_seed(3)
    assert torch.equal(a, torch.rand(3))
    with pytest.raises(ConfigError, match=r"seed must be an int.*got 'x'"):
        set_seed("x")
    sums = sum_dicts([{"a": 1, "b": 2}, {"a": 3}])
    assert sums == {"a": 4, "b": 2} and sums.a == 4
    with pytest.raises(AttributeError, match="no key 'c'"):
        _ = sums.c


def test_interprete_callbacks_top_is_top_samples():
    """0.6.18's `InterpreteCallback.top()` returns what `top_samples()` does."""
    from deepepochs import InterpreteCallback

    per_sample = lambda preds, targets: F.cross_entropy(preds, targets, reduction="none")
    interp = InterpreteCallback(per_sample, k=5)
    trainer = Trainer(model(), F.cross_entropy, epochs=1, callbacks=[interp], **QUIET)
    trainer.fit(data(), data())
    top = interp.top()
    assert len(top) == 5 and top == interp.top_samples()


@pytest.mark.parametrize("path, name, new", [
    ("deepepochs.loops", "flatten_dict", "deepepochs"),
    ("deepepochs.loops", "TensorTuple", "deepepochs"),
    ("deepepochs.tools", "plot_confusion", "deepepochs"),
    ("deepepochs.optimizer", "Optimizer", "deepepochs"),
    ("deepepochs.patches", "ConfusionPatch", "deepepochs"),
    ("deepepochs.trainer", "EpochTask", "deepepochs"),
])
def test_0618_import_paths_work_with_a_deprecation_warning_naming_the_new_one(path, name, new):
    """`from deepepochs.loops import flatten_dict` gives the same object as `from deepepochs import ...`, with
    a DeprecationWarning that names the new path and points at the importing line."""
    import importlib

    with pytest.warns(DeprecationWarning, match=rf"{path}\.{name} .* `from {new} import {name}`") as caught:
        value = getattr(importlib.import_module(path), name)
    assert value is getattr(importlib.import_module(new), name)
    assert caught[0].filename == __file__


def test_a_removed_name_on_an_old_path_names_its_replacement():
    """`from deepepochs.optimizer import Optimizers` raises the ImportError `from deepepochs import Optimizers`
    raises (with the replacement)."""
    with pytest.raises(ImportError, match=r"Optimizers .* was removed: pass several optimizers as a list"):
        from deepepochs.optimizer import Optimizers  # noqa: F401


# ---- what steps and tasks find on `self` ----
class Recorder(EpochTask):
    """A 0.6.18 task step reading the attributes 0.6.18 gave it."""

    seen: list

    def step(self, batch_x, batch_y, **step_args):
        self.seen.append(dict(size=self.current_batch_size, batches=self.batchs, counted=self.get_batch_size(
            batch_x, batch_y), val_freq=self.val_freq, epochs=self.max_epochs, main=self.main_process,
            metrics=list(self.metrics), same=self.model.model is self.raw_model))
        out = self.model(batch_x)
        self.loss(out, batch_y)


def test_a_0618_task_step_finds_the_attributes_0618_gave_it(capsys):
    """`self.current_batch_size`, `self.batchs`, `self.get_batch_size(x, y)`, `self.val_freq`, `self.max_epochs`,
    `self.main_process`, `self.print`, `self.model.model` and `self.metrics` (the stage's metrics and the
    task's own), compared with the data and arguments given."""
    from deepepochs.metrics import accuracy, f1

    x, y = torch.randn(20, 4), torch.randint(0, 2, (20,))
    dl = DataLoader(TensorDataset(x, y), batch_size=8)  # batches of 8, 8, 4
    Recorder.seen = []
    trainer = Trainer(model(), F.cross_entropy, epochs=3, metrics=[accuracy], **QUIET)
    trainer.fit(train_tasks=Recorder(dl), val_tasks=Recorder(dl, metrics=[f1]), val_freq=2)
    train, val = Recorder.seen[:3], Recorder.seen[6:9]  # epoch 1, then validation after epoch 2
    assert [s["size"] for s in train] == [s["counted"] for s in train] == [8, 8, 4]
    assert {s["batches"] for s in train} == {3} and {s["epochs"] for s in train} == {3}
    assert train[0]["val_freq"] is None and val[0]["val_freq"] == 2
    assert all(s["main"] and s["same"] for s in Recorder.seen)
    assert train[0]["metrics"] == [accuracy] and val[0]["metrics"] == [f1, accuracy]  # the task's own first
    trainer.print("only on rank 0")
    assert "only on rank 0" in capsys.readouterr().out
    assert "model" not in dict(trainer.raw_model.named_modules()) and "model" not in trainer.raw_model.state_dict()


def test_load_checkpoint_chains_and_keeps_the_files_contents(tmp_path):
    """`trainer.load_checkpoint(path).test(dl)` tests the loaded weights (0.6.18 chained); the contents
    are `trainer.last_checkpoint`."""
    from deepepochs import CheckCallback

    dl = data()
    first = Trainer(model(), F.cross_entropy, epochs=2, callbacks=[CheckCallback("loss", ckpt_dir=tmp_path)],
                    running_id="a", **QUIET)
    first.fit(dl, dl)
    expected = first.test(dl)
    path = next(tmp_path.glob("a/*.ckpt"))
    fresh = Trainer(model(seed=5), F.cross_entropy, **QUIET)
    assert fresh.load_checkpoint(path).test(dl) == expected
    assert fresh.last_checkpoint.epoch == 2


class LossOptimizeIndex(TrainerBase):
    def train_step(self, batch_x, batch_y, **step_args):
        self.loss(self.model(batch_x), batch_y, do_optimize=False)
        self.loss.optimize(optimize_index=1)  # 0.6.18's spelling


def test_loss_optimize_takes_an_optimize_index():
    """`self.loss.optimize(optimize_index=1)` updates optimizer 1 only: the other layer keeps its weights."""
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    before = [p.detach().clone() for p in net.parameters()]
    opts = [torch.optim.SGD(net[0].parameters(), lr=0.1), torch.optim.SGD(net[1].parameters(), lr=0.1)]
    LossOptimizeIndex(net, F.cross_entropy, opts, epochs=1, **QUIET).fit(data())
    after = list(net.parameters())
    assert all(torch.equal(a, b) for a, b in zip(after[:2], before[:2]))
    assert not any(torch.equal(a, b) for a, b in zip(after[2:], before[2:]))


@pytest.mark.parametrize("cls, kind", [("TensorPatch", "tensor"), ("MeanPatch", "mean"),
                                       ("ConfusionPatch", "confusion")])
def test_metric_patch_takes_0618s_patch_classes(cls, kind):
    """`Trainer(metric_patch=TensorPatch)` (0.6.18's documented form) is `metric_patch='tensor'`: same records."""
    import deepepochs
    from deepepochs.metrics import accuracy

    runs = []
    for value in (getattr(deepepochs, cls), kind):
        trainer = Trainer(model(), F.cross_entropy, epochs=1, metrics=[accuracy], metric_patch=value, **QUIET)
        assert trainer.config.metric_patch == kind
        runs.append(trainer.fit(data(), data()))
    assert runs[0] == runs[1]


def test_metric_patch_refuses_another_class_naming_the_accepted_ones():
    from deepepochs import PatchBase

    class Mine(PatchBase):
        pass

    with pytest.raises(ConfigError, match=r"metric_patch must be .* TensorPatch \(= 'tensor'\).*got the class Mine"):
        Trainer(model(), F.cross_entropy, metric_patch=Mine, **QUIET)


class SubBatchLoss(TrainerBase):
    """A training call with do_optimize=False and no do_metric, then the update: 0.6.18 computed metrics."""

    def train_step(self, batch_x, batch_y, **step_args):
        self.loss(self.model(batch_x), batch_y, do_optimize=False)
        self.optimize()


def test_a_loss_call_without_do_metric_computes_the_metrics_as_0618():
    """The training accuracy of such a step equals the default step's (the same model and data)."""
    from deepepochs.metrics import accuracy

    records = []
    for cls in (SubBatchLoss, Trainer):
        net = model()
        trainer = cls(net, F.cross_entropy, torch.optim.SGD(net.parameters(), lr=0.1), epochs=2,
                      metrics=[accuracy], **QUIET)
        records.append(trainer.fit(data()))
    assert len(records[0]["train"]["accuracy"]) == 2
    assert records[0]["train"]["accuracy"] == records[1]["train"]["accuracy"]


# ---- intentional differences: said once, loudly ----
def test_a_second_fit_with_epochs_trains_to_that_total_and_says_so_once():
    """`fit(epochs=3)` after 2 epochs trains 1 more (0.6.18: 3 more), with a MigrationWarning naming both and
    the replacement, once per trainer; a first fit says nothing."""
    from deepepochs import MigrationWarning

    trainer = Trainer(model(), F.cross_entropy, epochs=2, **QUIET)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MigrationWarning)
        trainer.fit(data(), epochs=2)
    with pytest.warns(MigrationWarning, match=r"fit\(epochs=3\) trains up to 3 epochs in total: 2 are done, so"
                      r" this fit trains 1 more; deepepochs 0.6.18 trained 3 more.*completed_epochs \+ 3") as w:
        records = trainer.fit(data(), epochs=3)
    assert w[0].filename == __file__
    assert len(records["train"]["loss"]) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error", MigrationWarning)
        records = trainer.fit(data(), epochs=trainer.loop.completed_epochs + 1)  # once per trainer
    assert len(records["train"]["loss"]) == 4


def test_test_gives_the_model_its_pre_test_weights_back_and_says_so_once(tmp_path):
    """With a best checkpoint, test() evaluates its weights (equal to a fresh model loaded from the file),
    then the model holds the last epoch's weights again; a MigrationWarning says 0.6.18 kept the tested ones
    and how to keep them, the first time only."""
    from deepepochs import CheckCallback, MigrationWarning

    dl = data()
    check = CheckCallback("loss", ckpt_dir=tmp_path)
    trainer = Trainer(model(), F.cross_entropy, epochs=3, callbacks=[check], running_id="r", **QUIET)
    trainer.fit(dl, dl)
    last = [p.detach().clone() for p in trainer.raw_model.parameters()]
    path = check.path(trainer)
    with pytest.warns(MigrationWarning, match=r"gives the model its pre-test weights back; deepepochs 0\.6\.18"
                      r" left the checkpoint's weights.*load_checkpoint\(.*best\.ckpt'\)"):
        tested = trainer.test(dl)
    assert all(torch.equal(p, q) for p, q in zip(trainer.raw_model.parameters(), last))
    assert Trainer(model(seed=3), F.cross_entropy, **QUIET).load_checkpoint(path).test(dl) == tested
    with warnings.catch_warnings():
        warnings.simplefilter("error", MigrationWarning)
        trainer.test(dl)


def test_resume_decisions_are_reported_also_with_show_info_false(tmp_path, capsys):
    """A resume says which run and file it loaded (and a fresh start why), with show_info=False too; the run
    header stays off."""
    from deepepochs import CheckCallback

    dl = data()
    quiet = dict(QUIET, show_info=False)
    first = Trainer(model(), F.cross_entropy, epochs=1, callbacks=[CheckCallback("loss", ckpt_dir=tmp_path)],
                    running_id="run1", **quiet)
    first.fit(dl, dl)
    capsys.readouterr()
    again = Trainer(model(), F.cross_entropy, epochs=2, callbacks=[CheckCallback("loss", ckpt_dir=tmp_path)],
                    resume=True, **quiet)
    again.fit(dl, dl)
    out = capsys.readouterr().out
    assert "Resumed run run1" in out and "run1" in out and "parameters" not in out.lower()
    fresh = Trainer(model(), F.cross_entropy, epochs=1,
                    callbacks=[CheckCallback("loss", ckpt_dir=tmp_path / "empty")], resume=True, **quiet)
    fresh.fit(dl, dl)
    assert "starting run" in capsys.readouterr().out


# ---- smaller differences: restored, or documented ----
def test_flatten_dict_takes_0618s_parent_key_then_separator():
    """`flatten_dict(d, 'p')` puts every key behind 'p.' (0.6.18's `parent_key`); `sep=` joins the levels."""
    from deepepochs import flatten_dict

    d = {"a": {"b": 1, "c": {"d": 2}}, "e": 3}
    assert flatten_dict(d) == {"a.b": 1, "a.c.d": 2, "e": 3}
    assert flatten_dict(d, "p") == {"p.a.b": 1, "p.a.c.d": 2, "p.e": 3}
    assert flatten_dict(d, "p", "/") == flatten_dict(d, parent_key="p", sep="/") == {"p/a/b": 1, "p/a/c/d": 2,
                                                                                      "p/e": 3}


def _named(name):
    def metric(preds, targets):
        return float((preds.argmax(1) == targets).float().mean()) + len(name)  # distinct values per name
    metric.__name__ = metric.__qualname__ = name
    return metric


def test_columns_follow_0618s_order_of_stage_fit_and_trainer_metrics():
    """0.6.18 listed a stage's own metrics (`train_metrics=`) first, then fit's `metrics=`, then the trainer's,
    each once (a metric given twice stays where the later list has it); a task's own before its stage's."""
    from deepepochs import EpochTask

    own, fit_m, shared, trainer_m, task_m = (_named(n) for n in ("own", "fit_m", "shared", "trainer_m", "task_m"))
    trainer = Trainer(model(), F.cross_entropy, epochs=1, metrics=[trainer_m, shared], **QUIET)
    records = trainer.fit(data(), val_tasks=[EpochTask(data(), metrics=[task_m])], metrics=[fit_m, shared],
                          train_metrics=[own, shared])
    assert list(records["train"]) == ["loss", "own", "fit_m", "shared", "trainer_m"]
    assert list(records["val"]) == ["loss", "task_m", "fit_m", "shared", "trainer_m"]
    assert list(trainer.test(data(), metrics=[own, trainer_m])) == ["loss", "own", "trainer_m", "shared"]


class Order(Callback):
    def __init__(self, name, log):
        self.name, self.log = name, log

    def on_before_epoch(self, trainer, train_tasks, val_tasks, epoch_idx):
        self.log.append(("before", self.name))

    def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx):
        self.log.append(("after", self.name))


def test_callbacks_run_in_the_order_of_the_list_not_of_their_creation():
    """Documented difference: 0.6.18 ran callbacks in the order they were created; here `before` hooks run
    in the order of `callbacks=[...]` and `after` hooks in reverse."""
    log = []
    first, second = Order("created first", log), Order("created second", log)
    Trainer(model(), F.cross_entropy, epochs=1, callbacks=[second, first], **QUIET).fit(data())
    assert log == [("before", "created second"), ("before", "created first"),
                   ("after", "created first"), ("after", "created second")]


def test_records_always_hold_a_val_entry_empty_without_validation():
    """Documented difference: `fit()` without validation returns `{'train': {...}, 'val': {}}` (0.6.18 had no
    'val' key); `records['val']` is falsy, so `if records['val']:` tells the cases apart."""
    records = Trainer(model(), F.cross_entropy, epochs=2, **QUIET).fit(data())
    assert set(records) == {"train", "val"} and records["val"] == {} and len(records["train"]["loss"]) == 2
