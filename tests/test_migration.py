"""The claims of docs/MIGRATION.md, one test (or more) each: what deepepochs 0.6.18 code does when it runs
on this library, and what each intentional difference looks like. The page's own `python` blocks run in
tests/test_migration_doc.py; the tests here check what the page says about them."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Callback, ConfigError, EpochTask, Trainer, TrainerBase, ValuePatch

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
    """`trainer.opt.get_current_lr()` and `get_last_lr()` are lists in optimize_index order, a one-item list
    with one optimizer as in 0.6.18; `trainer.opt[i].get_last_lr()` is the scheduler's (None without one),
    checked against the torch optimizer and scheduler themselves."""
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
    assert single.opt.get_current_lr() == [0.3] and single.opt.get_last_lr() == [None]
    assert single.opt[0].get_current_lr() == 0.3


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
def test_grad_clip_callback_clips_like_torch_and_warns_no_one():
    """The weights after one epoch equal a plain loop clipping with `clip_grad_value_`. Clipping is what the
    callback always meant (0.6.18's failed to do it, a fixed bug listed on the migration page), so neither
    attaching it nor training with it gives a `MigrationWarning`."""
    from deepepochs import GradClipCallback, MigrationWarning

    clip = GradClipCallback(0.01)
    net = model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MigrationWarning)
        trainer = Trainer(net, F.cross_entropy, torch.optim.SGD(net.parameters(), lr=1e-3), epochs=1,
                          callbacks=[clip], **QUIET)
        trainer.fit(data())
    reference = model()
    opt = torch.optim.SGD(reference.parameters(), lr=1e-3)
    for x, y in data():
        F.cross_entropy(reference(x), y).backward()
        torch.nn.utils.clip_grad_value_(reference.parameters(), 0.01)
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(trainer.raw_model.state_dict().values(),
                                                 reference.state_dict().values()))
    with warnings.catch_warnings():
        warnings.simplefilter("error", MigrationWarning)
        Trainer(model(), F.cross_entropy, epochs=1, callbacks=[clip], **QUIET).close()


class TwoLossCalls(TrainerBase):
    """A step calling `self.loss` twice (with the trainer's metrics each time); `last_only` is the
    replacement the warning names for 0.6.18's values."""

    last_only = False

    def train_step(self, batch_x, batch_y, **step_args):
        self.loss(self.model(batch_x * 2), batch_y, do_metric=False if self.last_only else None)
        last = self.loss(self.model(batch_x), batch_y)
        if self.last_only:
            return {"loss": ValuePatch(last.detach(), len(batch_y))}
        return None


def test_two_loss_calls_of_a_step_add_up_and_say_once_how_to_get_0618s_last_call():
    """With lr=0 (fixed weights): the epoch loss is the sample-weighted mean of the two calls' summed losses
    and the accuracy pools both calls' outputs, computed here directly, with a MigrationWarning once per
    process; the replacement it names gives 0.6.18's values, the last call's loss and accuracy."""
    from deepepochs import MigrationWarning
    from deepepochs.metrics import accuracy

    net = model()
    x, y = data().dataset.tensors
    with torch.no_grad():
        first, last = net(x * 2), net(x)
    summed = sum(len(yb) * (F.cross_entropy(net(xb * 2), yb) + F.cross_entropy(net(xb), yb)).item()
                 for xb, yb in data()) / len(y)
    pooled = ((first.argmax(1) == y).sum() + (last.argmax(1) == y).sum()).item() / (2 * len(y))
    kwargs = dict(epochs=2, metrics=[accuracy], **QUIET)
    trainer = TwoLossCalls(net, F.cross_entropy, torch.optim.SGD(net.parameters(), lr=0.0), **kwargs)
    with pytest.warns(MigrationWarning, match=r"this step calls self.loss\(...\) with metrics again after an"
                      r" earlier such call in the same batch: the calls of one step add up .* 0.6.18 reported"
                      r" the last call's loss and metrics. For 0.6.18's values, pass do_metric=False") as said:
        records = trainer.fit(data())
    assert len([w for w in said if issubclass(w.category, MigrationWarning)]) == 1
    assert records["train"]["loss"] == pytest.approx([summed] * 2, abs=1e-6)
    assert records["train"]["accuracy"] == pytest.approx([pooled] * 2, abs=1e-6)
    as_0618 = TwoLossCalls(net, F.cross_entropy, torch.optim.SGD(net.parameters(), lr=0.0), **kwargs)
    as_0618.last_only = True
    with warnings.catch_warnings():
        warnings.simplefilter("error", MigrationWarning)
        records = as_0618.fit(data())
    assert records["train"]["loss"] == pytest.approx([F.cross_entropy(last, y).item()] * 2, abs=1e-6)
    assert records["train"]["accuracy"] == pytest.approx([(last.argmax(1) == y).float().mean().item()] * 2)


class DictLoss(nn.Module):
    """A model taking a dict batch as keywords and returning its loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)

    def forward(self, x, y):
        return F.cross_entropy(self.lin(x), y)


def test_dict_batches_weigh_their_samples_and_say_once_that_0618_counted_keys():
    """Dict batches of 16, 16 and 8 samples (lr=0): the epoch loss is the sample-weighted mean of the batch
    losses, with a MigrationWarning once per process, at the batch of another size, naming 0.6.18's count
    (2 keys) and batch_size=2, which gives 0.6.18's equal weights (the plain mean of the batch losses).
    Batches all of one size weigh alike in both versions: they warn no one."""
    from deepepochs import MigrationWarning

    x, y = data(n=48).dataset.tensors
    even = [{"x": x[i:i + 16], "y": y[i:i + 16]} for i in range(0, 48, 16)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", MigrationWarning)
        Trainer(DictLoss(), None, epochs=1, **QUIET).fit(even, even)
    x, y = x[:40], y[:40]
    batches = [{"x": x[i:i + 16], "y": y[i:i + 16]} for i in range(0, 40, 16)]
    net = DictLoss()
    with torch.no_grad():
        losses = [net(**batch).item() for batch in batches]
    trainer = Trainer(net, None, torch.optim.SGD(net.parameters(), lr=0.0), epochs=2, **QUIET)
    with pytest.warns(MigrationWarning, match=r"a dict batch weighs its 8 samples .* deepepochs 0.6.18 took its"
                      r" number of keys \(2\) as its size.* pass batch_size=2 to fit\(\)/test\(\)") as said:
        records = trainer.fit(batches, batches)
        tested = trainer.test(batches)
    assert said[0].filename == __file__
    assert len([w for w in said if issubclass(w.category, MigrationWarning)]) == 1
    weighted = (16 * losses[0] + 16 * losses[1] + 8 * losses[2]) / 40
    assert records["train"]["loss"] == records["val"]["loss"] == pytest.approx([weighted] * 2, abs=1e-6)
    assert tested["loss"] == pytest.approx(weighted, abs=1e-6)
    assert trainer.test(batches, batch_size=2)["loss"] == pytest.approx(sum(losses) / 3, abs=1e-6)


def test_a_second_fit_with_epochs_trains_to_that_total_and_says_how_0618_differed():
    """`fit(epochs=3)` after 2 epochs trains 1 more (0.6.18: 3 more): read as 0.7 code means it, with one
    run-information line naming what remains and 0.6.18's replacement, and no `MigrationWarning` (a first fit
    says nothing either). A target the run has reached trains nothing, which only 0.6.18 code means: a
    MigrationWarning naming both and the replacement, once per process."""
    import io

    from deepepochs import MigrationWarning

    trainer = Trainer(model(), F.cross_entropy, epochs=2, log_batch=False)
    trainer.console.stream = out = io.StringIO()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MigrationWarning)
        trainer.fit(data(), epochs=2)
        records = trainer.fit(data(), epochs=3)
    assert len(records["train"]["loss"]) == 3
    assert out.getvalue().count("fit(epochs=3): 3 epochs in total, 2 done, 1 to train (deepepochs 0.6.18 trained"
                                " 3 more: for that, pass fit(epochs=trainer.loop.completed_epochs + 3))") == 1
    with pytest.warns(MigrationWarning, match=r"fit\(epochs=2\) trains nothing: 2 is the run's total epoch target"
                      r" and 3 are done; deepepochs 0.6.18 trained 2 more.*completed_epochs \+ 2\)") as w:
        records = trainer.fit(data(), epochs=2)
    assert w[0].filename == __file__
    assert len(records["train"]["loss"]) == 3
    other = Trainer(model(), F.cross_entropy, epochs=1, **QUIET)
    other.fit(data())
    with warnings.catch_warnings():
        warnings.simplefilter("error", MigrationWarning)
        trainer.fit(data(), epochs=1)  # once per process: neither this trainer nor another says it again
        other.fit(data(), epochs=1)


def test_test_gives_the_model_its_pre_test_weights_back_and_says_so_once(tmp_path):
    """With a best checkpoint of another epoch than the last (the highest loss here), test() evaluates its
    weights (equal to a fresh model loaded from the file), then the model holds the last epoch's weights again;
    a MigrationWarning says 0.6.18 kept the tested ones and how to keep them, the first time only. Where the
    best file holds the last epoch's weights both versions leave the same model: no warning."""
    from deepepochs import CheckCallback, MigrationWarning

    dl = data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MigrationWarning)
        latest = CheckCallback("loss", save_best=False, ckpt_dir=tmp_path / "latest")
        with Trainer(model(), F.cross_entropy, epochs=2, callbacks=[latest], **QUIET) as same:
            same.fit(dl, dl)
            same.test(dl)
    check = CheckCallback("loss", mode="max", ckpt_dir=tmp_path)
    trainer = Trainer(model(), F.cross_entropy, epochs=3, callbacks=[check], running_id="r", **QUIET)
    trainer.fit(dl, dl)
    last = [p.detach().clone() for p in trainer.raw_model.parameters()]
    path = check.path(trainer)
    with pytest.warns(MigrationWarning, match=r"gives the model its pre-test weights back; deepepochs 0\.6\.18"
                      r" left the checkpoint's weights.*load_checkpoint\(.*best\.ckpt'\)") as w:
        tested = trainer.test(dl)
    assert w[0].filename == __file__  # the user's line
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


# ---- claims without a test elsewhere ----
def test_the_0618_arguments_of_trainer_fit_and_test_come_in_0618s_order():
    """`Trainer`, `fit` and `test` take 0.6.18's arguments, positionally in 0.6.18's order."""
    import inspect

    from deepepochs import InterpreteCallback

    def names(fn, n):
        return [p for p in inspect.signature(fn).parameters if p != "self"][:n]

    trainer_0618 = ["model", "loss", "opt", "epochs", "device", "callbacks", "metrics", "metric_patch", "resume",
                    "running_id", "hyper_params", "log_long", "log_batch", "log_tqdm", "show_info", "compile_model"]
    fit_0618 = ["train_dl", "val_dl", "metrics", "val_freq", "do_val_loss", "batch_size", "train_metrics",
                "val_metrics", "train_tasks", "val_tasks"]
    test_0618 = ["test_dl", "metrics", "do_loss", "batch_size", "tasks"]
    interprete_0618 = ["metric", "k", "mode", "stages", "class_num", "log_dir", "image_data"]
    assert names(Trainer.__init__, len(trainer_0618)) == trainer_0618
    assert names(Trainer.fit, len(fit_0618)) == fit_0618
    assert names(Trainer.test, len(test_0618)) == test_0618
    assert names(InterpreteCallback.__init__, len(interprete_0618)) == interprete_0618


def test_the_default_metric_patch_gives_the_values_of_0618s_tensor_patch():
    """`metric_patch='auto'` (the default) and 'tensor' (0.6's) give equal records for deepepochs' metrics."""
    from deepepochs.metrics import accuracy, f1, precision, recall

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(90, 4, generator=g), torch.randint(0, 3, (90,), generator=g)
    dl = DataLoader(TensorDataset(x, y), batch_size=16)
    runs = []
    for kind in ("auto", "tensor"):
        torch.manual_seed(0)
        trainer = Trainer(nn.Linear(4, 3), F.cross_entropy, epochs=1, metric_patch=kind,
                          metrics=[accuracy, f1, precision, recall], **QUIET)
        runs.append(trainer.fit(dl, dl))
    assert runs[0].keys() == runs[1].keys()
    for stage in runs[0]:
        for name, values in runs[0][stage].items():
            assert values == pytest.approx(runs[1][stage][name], abs=1e-6), (stage, name)


class Boom(RuntimeError):
    pass


class StopOrRaise(Callback):
    def __init__(self, raise_at=None):
        self.raise_at = raise_at

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if self.raise_at == (trainer.loop.epoch, batch_idx):
            raise Boom("from a hook")

    def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx):
        if self.raise_at is None and epoch_idx == 1:
            trainer.request_stop("good enough")


def test_request_stop_ends_the_fit_after_the_epoch_and_errors_come_as_raised():
    """`trainer.request_stop(reason)` (0.6's StopLoopException) ends the fit after that epoch; an error from a
    hook reaches the caller as it was raised (no wrapper type), and the trainer is usable afterwards."""
    records = Trainer(model(), F.cross_entropy, epochs=10, callbacks=[StopOrRaise()], **QUIET).fit(data())
    assert len(records["train"]["loss"]) == 2
    trainer = Trainer(model(), F.cross_entropy, epochs=2, callbacks=[StopOrRaise(raise_at=(1, 2))], **QUIET)
    with pytest.raises(Boom, match="from a hook"):
        trainer.fit(data())
    trainer.callbacks[0].raise_at = None
    assert len(trainer.fit(data())["train"]["loss"]) == 2


# ---- small differences no warning announces ----
class CtrlCAt(Callback):
    """Raises KeyboardInterrupt (what Ctrl-C raises) after the given (1-based epoch, batch), once."""

    def __init__(self, at):
        self.at = at

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if self.at == (trainer.loop.epoch, batch_idx):
            self.at = None
            raise KeyboardInterrupt


def test_ctrl_c_reaches_the_caller_and_a_later_fit_ends_as_the_uninterrupted_run():
    """0.6.18 caught Ctrl-C inside fit() and returned; 0.7 lets the KeyboardInterrupt reach the caller, and a
    second fit() ends with the weights of a plain loop that was never interrupted (SGD, 2 epochs)."""
    net = model()
    trainer = Trainer(net, F.cross_entropy, torch.optim.SGD(net.parameters(), lr=0.1), epochs=2,
                      callbacks=[CtrlCAt((1, 2))], **QUIET)
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(data())
    assert trainer.loop.completed_epochs == 0
    records = trainer.fit(data())
    assert len(records["train"]["loss"]) == 2
    reference = model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        for x, y in data():
            F.cross_entropy(reference(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), reference.state_dict().values()))


def test_a_second_fit_returns_the_whole_runs_records():
    """0.6.18's second fit() returned its own epochs; 0.7's returns every epoch of the run, the first fit's
    values unchanged, as `trainer.history` holds them."""
    trainer = Trainer(model(), F.cross_entropy, epochs=2, **QUIET)
    first = trainer.fit(data())
    second = trainer.fit(data(), epochs=3)
    assert len(second["train"]["loss"]) == 3 and second["train"]["loss"][:2] == first["train"]["loss"]
    assert second == trainer.history


def test_to_numpy_keeps_lists_tuples_and_plain_values():
    """0.6.18 made a list of a tuple and a float array of any non-tensor value; 0.7 keeps the containers and
    the plain values, and turns each tensor into its NumPy array."""
    from deepepochs.compat import to_numpy

    t = torch.tensor([1.0, 2.0])
    out = to_numpy({"list": [t, 3], "tuple": (t, "x"), "value": 5})
    assert type(out["list"]) is list and np.array_equal(out["list"][0], t.numpy()) and out["list"][1] == 3
    assert type(out["tuple"]) is tuple and out["tuple"][1] == "x" and out["value"] == 5
    assert type(to_numpy([t])) is list and type(to_numpy((t,))) is tuple


def test_confusion_matrices_are_int64_counts():
    """`confusion_matrix` (0.6.18: int32) is int64, with scikit-learn's counts (rows: true class)."""
    from sklearn.metrics import confusion_matrix as sk_confusion

    from deepepochs.metrics import confusion_matrix

    g = torch.Generator().manual_seed(0)
    preds, targets = torch.randn(50, 3, generator=g), torch.randint(0, 3, (50,), generator=g)
    cm = confusion_matrix(preds, targets, 3)
    assert cm.dtype == torch.int64
    assert cm.tolist() == sk_confusion(targets.numpy(), preds.argmax(1).numpy(), labels=range(3)).tolist()


# ---- every row and section of docs/MIGRATION.md names the tests that check it ----
C6, C06, C18 = "tests/test_compat.py", "tests/test_compat_06.py", "tests/test_compat_0618.py"
HERE, DOC = "tests/test_migration.py", "tests/test_migration_doc.py::test_each_python_block_of_the_migration_page_runs"
ROWS = {  # the first cell of a table row (its start) -> the tests that check the row
    "a second `fit(epochs=k)`": [
        f"{HERE}::test_a_second_fit_with_epochs_trains_to_that_total_and_says_how_0618_differed"],
    "after `test()` with a `CheckCallback` file": [
        f"{HERE}::test_test_gives_the_model_its_pre_test_weights_back_and_says_so_once"],
    "`resume=...` always said": [f"{HERE}::test_resume_decisions_are_reported_also_with_show_info_false"],
    "precision, recall and F1 of a **two-class**": [f"{C18}::test_two_class_f1_scores_class_1_and_says_so_once"],
    "with several tasks in a stage": [f"{C18}::test_several_tasks_keep_every_tasks_loss_and_say_how_they_are_named"],
    "`resume=True` on a run that patience had stopped": [
        "tests/test_resume_finished.py::test_an_early_stopped_run_resumed_says_it_is_finished_and_returns_its_records",
        "tests/test_resume_finished.py::test_following_the_finished_message_trains_on_like_0_6"],
    "`run_tensorboard()` started": [f"{C6}::test_run_tensorboard_outside_a_terminal_warns_with_the_command_and_returns",
                                    f"{C6}::test_run_tensorboard_in_a_terminal_starts_tensorboard_on_the_folder"],
    "`device=Accelerator(...)`": [f"{C18}::test_accelerate_arguments_are_refused_up_front_naming_their_replacements"],
    "`GradClipCallback` did not clip": [f"{HERE}::test_grad_clip_callback_clips_like_torch_and_warns_no_one"],
    "Ctrl-C (`KeyboardInterrupt`) inside `fit()`": [
        f"{HERE}::test_ctrl_c_reaches_the_caller_and_a_later_fit_ends_as_the_uninterrupted_run"],
    "a second `fit()` returned the records": [f"{HERE}::test_a_second_fit_returns_the_whole_runs_records"],
    "`to_numpy(x)` made a list of a tuple": [f"{HERE}::test_to_numpy_keeps_lists_tuples_and_plain_values"],
    "`confusion_matrix(preds, targets, num_classes)` was an `int32`": [
        f"{HERE}::test_confusion_matrices_are_int64_counts"],
    "a step calling `self.loss(...)` twice with metrics": [
        f"{HERE}::test_two_loss_calls_of_a_step_add_up_and_say_once_how_to_get_0618s_last_call"],
    "a dict batch's size was its **number of keys**": [
        f"{HERE}::test_dict_batches_weigh_their_samples_and_say_once_that_0618_counted_keys"],
    "`CheckCallback` saved to `./logs`": [f"{C18}::test_resume_with_0_6_checkpoints_in_logs_says_how_to_resume_them"],
    "`Trainer(model, loss, opt, epochs,": [
        f"{HERE}::test_the_0618_arguments_of_trainer_fit_and_test_come_in_0618s_order"],
    "callback hooks and their arguments": [
        f"{C06}::test_hooks_receive_zero_based_epoch_and_batch_indices_while_the_console_counts_from_one"],
    "hooks written to take their arguments by keyword": [
        f"{HERE}::test_hooks_taking_their_arguments_by_keyword_get_them_by_keyword",
        f"{HERE}::test_a_hook_that_takes_neither_form_is_refused_when_attached"],
    "metric values in hooks were tensors": [
        f"{HERE}::test_metric_values_in_user_hooks_answer_item_and_records_stay_plain_floats"],
    "in a step: `self.current_batch_size`": [f"{HERE}::test_a_0618_task_step_finds_the_attributes_0618_gave_it"],
    "inside a task's step, `self.metrics`": [f"{HERE}::test_a_0618_task_step_finds_the_attributes_0618_gave_it"],
    "`trainer.opt.get_current_lr()`": [f"{HERE}::test_optimizer_lr_accessors_answer_as_in_0618"],
    "`trainer.load_checkpoint(path).test(test_dl)`": [
        f"{HERE}::test_load_checkpoint_chains_and_keeps_the_files_contents"],
    "`Trainer(metric_patch=TensorPatch)`": [f"{HERE}::test_metric_patch_takes_0618s_patch_classes",
                                            f"{HERE}::test_metric_patch_refuses_another_class_naming_the_accepted_ones"],
    "`set_seed('3')`": [f"{HERE}::test_set_seed_takes_a_string_of_digits_and_sum_dicts_reads_keys_as_attributes"],
    "`from deepepochs.loops import ...`": [
        f"{HERE}::test_0618_import_paths_work_with_a_deprecation_warning_naming_the_new_one",
        f"{HERE}::test_a_removed_name_on_an_old_path_names_its_replacement"],
    "an update zeroed only the gradients": [
        "tests/engine/test_kept_grads.py::test_an_optimizer_that_did_not_step_keeps_adding_up_gradients_as_in_a_plain_loop",
        "tests/engine/test_kept_grads.py::test_a_rollback_puts_back_the_kept_gradients_without_the_discarded_windows_additions",
        "tests/engine/test_kept_grads.py::test_a_later_fit_continues_from_the_kept_gradients_like_a_longer_plain_loop"],
    "the columns (and records) of a stage": [
        f"{HERE}::test_columns_follow_0618s_order_of_stage_fit_and_trainer_metrics"],
    "`@rename('acc')`": [f"{C06}::test_rename_works_as_a_decorator_and_as_a_call_like_0_6",
                         f"{C06}::test_rename_prefixes_the_keys_of_a_dict_metric_and_an_empty_name_keeps_them"],
    "`batch_size=` on `fit`/`test`/`EpochTask`": [
        f"{C06}::test_batch_size_int_weighs_every_batch_with_that_count_like_0_6",
        f"{C06}::test_batch_size_function_gives_each_batch_its_weight_in_fit_test_and_epoch_task"],
    "a custom step that only calls `self.loss(out, y)`": [
        f"{C06}::test_custom_steps_that_only_call_self_loss_keep_the_trainers_metrics"],
    "a step splitting its batch by hand": [f"{C18}::test_hand_written_accumulation_with_do_metric_equals_a_plain_loop",
                                           f"{HERE}::test_two_loss_calls_of_a_step_add_up_and_say_once_how_to_get_0618s_last_call",
                                           f"{HERE}::test_a_loss_call_without_do_metric_computes_the_metrics_as_0618",
                                           f"{HERE}::test_loss_optimize_takes_an_optimize_index"],
    "older 0.6: `self.loss(..., grad_accumulate=True)`": [
        f"{C06}::test_0_6_manual_accumulation_with_grad_accumulate_and_loss_optimize_matches_plain_pytorch"],
    "patches in 0.6.18's spelling": [
        f"{C18}::test_0618_patch_load_spelling_gives_whole_dataset_values_under_0618_names",
                                     f"{C18}::test_0618_patch_constructors_keep_the_counts_and_names_they_are_given"],
    "`ConfusionMetrics(metrics, average, beta=1.0": [
        f"{C18}::test_0618_patch_load_spelling_gives_whole_dataset_values_under_0618_names",
        f"{HERE}::test_confusion_metrics_takes_beta_third_as_0618_did"],
    "a step returning a dict-valued patch under a key": [
        f"{C18}::test_a_steps_dict_patch_is_prefixed_by_its_key_and_can_be_monitored",
        f"{C18}::test_the_trainers_own_patches_returned_by_a_step_keep_their_names"],
    "`Trainer(metric_patch='confusion', metrics=[fn])`": [
        f"{C18}::test_metric_patch_confusion_takes_a_user_function_of_the_confusion_matrix"],
    "`InterpreteCallback()` without a metric": [
        f"{C18}::test_interprete_callback_without_metric_keeps_the_confusion_matrix_only"],
    "`InterpreteCallback.top()`": [f"{HERE}::test_interprete_callbacks_top_is_top_samples"],
    "`fit()`/`test()` values were NumPy 0-d arrays": [
        f"{C18}::test_fit_and_test_values_are_plain_floats_that_torch_load_reads_back"],
    "`run_tensorboard()` on `LogCallback`": [
        f"{C6}::test_run_tensorboard_in_a_terminal_starts_tensorboard_on_the_folder"],
    "`fit(do_val_loss=False)`, `test(do_loss=False)`": [
        f"{C06}::test_do_val_loss_false_and_do_loss_false_compute_no_evaluation_loss_in_custom_steps"],
    "`deepepochs.metrics` `precision`/`recall`/`fbeta`/`f1` average": [
        "tests/test_metrics.py::test_default_average_is_0_6_micro_for_multiclass_and_sklearn_binary_for_two_classes"],
    "`accuracy(conf_mat=cm)`": [
        "tests/test_metrics.py::test_conf_mat_keyword_of_0_6_scores_a_given_confusion_matrix_like_sklearn"],
    "`TensorTuple`, `TensorDict`, `batches`, `concat`": [
        f"{C6}::test_tensor_tuple_and_tensor_dict_convert_every_tensor_they_hold",
        f"{C6}::test_batches_splits_along_the_first_dimension_and_concat_joins_the_parts_back",
        f"{C6}::test_sum_dicts_flatten_dict_and_to_numpy", f"{C6}::test_plot_confusion_draws_the_counts_in_the_cells"],
    "`InterpreteCallback(metric=None, k=100": [
        f"{HERE}::test_the_0618_arguments_of_trainer_fit_and_test_come_in_0618s_order",
        "tests/callbacks/test_interprete.py::test_keeps_exactly_the_k_best_samples_of_the_whole_dataset"],
    "0.6 checkpoints `{'model_state'": [f"{C06}::test_a_0_6_checkpoint_loads_weights_optimizer_scheduler_and_epoch",
                                        f"{C06}::test_resume_true_continues_a_0_6_run_and_skips_a_foreign_file_without_aborting"],
    "`Trainer(running_id=1, resume=1)`": [f"{C06}::test_int_running_id_and_resume_of_0_6_name_the_run_folder"],
    "`set_seed(1.0)`": [f"{C06}::test_set_seed_takes_0_6s_float_seed_with_an_integral_value"],
    "a `PatchBase` subclass that sets its state": [
        f"{C06}::test_a_0_6_patch_that_sets_its_state_in_init_without_load_works_in_a_step"],
    "`ConfusionPatch(preds, targets, metrics=['accuracy'], name='C.')`": [
        f"{C06}::test_a_patch_name_prefixes_the_keys_of_its_dict_result_like_0_6"],
    "`EpochTask(dl, step_args={'scale': 2})`": [
        f"{C06}::test_epoch_task_step_args_dict_is_one_keyword_as_0_6_18_or_unpacked_for_a_step_without_it"],
    "`TensorTuple`, `TensorDict`": [f"{C6}::test_tensor_tuple_and_tensor_dict_convert_every_tensor_they_hold"],
    "`batches(data, batch_size)`": [
        f"{C6}::test_batches_splits_along_the_first_dimension_and_concat_joins_the_parts_back"],
    "`concat(parts)`": [f"{C6}::test_batches_splits_along_the_first_dimension_and_concat_joins_the_parts_back"],
    "`sum_dicts(dicts)`": [f"{C6}::test_sum_dicts_flatten_dict_and_to_numpy",
                           f"{HERE}::test_set_seed_takes_a_string_of_digits_and_sum_dicts_reads_keys_as_attributes"],
    "`flatten_dict(d, parent_key=''": [f"{HERE}::test_flatten_dict_takes_0618s_parent_key_then_separator"],
    "`to_numpy(data)`": [f"{C6}::test_sum_dicts_flatten_dict_and_to_numpy"],
    "`plot_confusion(cm, class_num": [f"{HERE}::test_plot_confusion_takes_both_signatures",
                                      f"{C6}::test_plot_confusion_without_matplotlib_says_how_to_install_it"],
    "`Optimizers`": [f"{C18}::test_helpers_of_0_6s_star_import_name_what_to_use",
                     f"{C6}::test_a_removed_0_6_name_fails_to_import_with_its_replacement_in_the_message"],
    "`LinearCosineScheduler`": [f"{C6}::test_a_removed_0_6_name_fails_to_import_with_its_replacement_in_the_message"],
    "`StopLoopException`": [f"{C6}::test_a_removed_0_6_name_fails_to_import_with_its_replacement_in_the_message",
                            f"{HERE}::test_request_stop_ends_the_fit_after_the_epoch_and_errors_come_as_raised"],
    "`LoopException`, `CallbackException`": [
        f"{C6}::test_a_removed_0_6_name_fails_to_import_with_its_replacement_in_the_message",
        f"{HERE}::test_request_stop_ends_the_fit_after_the_epoch_and_errors_come_as_raised"],
    "`LRFindCallback`": [
        "tests/test_lr_find.py::test_lr_find_callback_makes_fit_a_sweep_as_in_0_6_then_training_resumes"],
    "`make_runningid`, `batch_size`, `listify`": [f"{C18}::test_helpers_of_0_6s_star_import_name_what_to_use"],
}
SECTIONS = {  # the page's "### " headings -> the tests that check what the section says
    "Small differences no warning announces": [
        f"{HERE}::test_ctrl_c_reaches_the_caller_and_a_later_fit_ends_as_the_uninterrupted_run",
        f"{HERE}::test_a_second_fit_returns_the_whole_runs_records",
        f"{HERE}::test_to_numpy_keeps_lists_tuples_and_plain_values",
        f"{HERE}::test_confusion_matrices_are_int64_counts"],
    "Two metrics may no longer report the same name": [
        f"{C06}::test_two_dict_metrics_with_the_same_keys_are_an_error_not_a_silent_overwrite",
        f"{C06}::test_two_different_metrics_with_one_name_are_refused_before_training",
        f"{C06}::test_an_empty_rename_on_a_single_value_metric_asks_for_a_name", DOC],
    "`metric_patch` defaults to `'auto'`": [
        f"{HERE}::test_the_default_metric_patch_gives_the_values_of_0618s_tensor_patch",
                                            DOC],
    "Two-class precision, recall and F1 score class 1": [
        "tests/test_metrics.py::test_binary_average_scores_class_one_like_sklearn", DOC],
    "Several tasks in one stage": [f"{C18}::test_several_tasks_keep_every_tasks_loss_and_say_how_they_are_named"],
    "Resuming a finished run": [
        "tests/test_resume_finished.py::test_an_early_stopped_run_resumed_says_it_is_finished_and_returns_its_records",
        "tests/test_resume_finished.py::test_a_run_that_reached_its_target_is_finished_until_the_target_is_raised"],
    "Older 0.6: a single model input as a list, dict batches as one argument": [
        f"{C06}::test_a_0_6_step_unpacking_a_single_input_gets_a_hint_to_call_the_model_with_batch_x"],
    "Keys of dict metrics": [f"{C18}::test_a_steps_dict_patch_is_prefixed_by_its_key_and_can_be_monitored", DOC],
    "Accelerate arguments are gone": [
        f"{C18}::test_accelerate_arguments_are_refused_up_front_naming_their_replacements",
        f"{C18}::test_hand_written_accumulation_with_do_metric_equals_a_plain_loop", DOC],
    "Exceptions and stopping": [
        f"{HERE}::test_request_stop_ends_the_fit_after_the_epoch_and_errors_come_as_raised", DOC],
    "Callback order": [f"{HERE}::test_callbacks_run_in_the_order_of_the_list_not_of_their_creation",
                       f"{C6}::test_a_0_6_callback_priority_is_refused_with_how_to_order_callbacks"],
    "Records of a fit without validation": [f"{HERE}::test_records_always_hold_a_val_entry_empty_without_validation"],
    "Checkpoints": [f"{C06}::test_a_0_6_checkpoint_loads_weights_optimizer_scheduler_and_epoch",
                    f"{C06}::test_resume_true_loads_a_0618_checkpoint_written_after_a_0618_resume",
                    f"{C06}::test_a_0_6_file_of_an_unknown_layout_is_refused_with_how_to_convert_it",
                    f"{C18}::test_resume_with_0_6_checkpoints_in_logs_says_how_to_resume_them", DOC],
    "Logging and interpretation": [f"{C6}::test_run_tensorboard_outside_a_terminal_warns_with_the_command_and_returns",
                                   f"{C18}::test_interprete_callback_without_metric_keeps_the_confusion_matrix_only"],
    "Helpers": [f"{C6}::test_a_removed_0_6_name_fails_to_import_with_its_replacement_in_the_message",
                f"{C18}::test_helpers_of_0_6s_star_import_name_what_to_use"],
}


def _page():
    from pathlib import Path

    return (Path(__file__).resolve().parent.parent / "docs" / "MIGRATION.md").read_text(encoding="utf-8")


def _exists(test_id: str) -> bool:
    import ast
    from pathlib import Path

    path, name = test_id.split("::")
    tree = ast.parse((Path(__file__).resolve().parent.parent / path).read_text(encoding="utf-8"))
    return any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body)


def test_every_row_of_the_migration_page_names_tests_that_exist():
    """Each table row of docs/MIGRATION.md (by the start of its first cell) has tests listed in ROWS, each
    heading of a section in SECTIONS, and every listed test is defined where it says; so a claim added to
    the page without a test, or a test renamed away from its claim, fails here."""
    page = _page()
    rows = [line.split(" | ")[0].lstrip("| ").strip() for line in page.splitlines()
            if line.startswith("|") and not line.startswith("|---")]
    rows = [r for r in rows if r not in ("0.6.18", "0.6 behaviour", "0.6 name")]  # the tables' headers
    uncovered = [r for r in rows if not any(r.startswith(key) for key in ROWS)]
    assert not uncovered, f"rows without tests in ROWS: {uncovered}"
    headings = [line[4:].strip() for line in page.splitlines() if line.startswith("### ")]
    assert sorted(headings) == sorted(SECTIONS), "sections and SECTIONS differ"
    missing = [t for tests in [*ROWS.values(), *SECTIONS.values()] for t in tests if not _exists(t)]
    assert not missing, f"listed tests that do not exist: {missing}"
    stale = [key for key in ROWS if not any(r.startswith(key) for r in rows)]
    assert not stale, f"ROWS keys that match no row of the page: {stale}"
