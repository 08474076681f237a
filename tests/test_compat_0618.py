"""deepepochs 0.6.18 code runs unchanged: each test runs its own copy of a pattern of 0.6.18's published
examples (synthetic data) and checks the values and names a 0.6.18 user gets, against an independent
reference (a plain PyTorch loop, scikit-learn on the whole dataset), or the exact message where 0.7 keeps a
different rule."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, fbeta_score
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import (
    CheckCallback,
    ConfigError,
    ConfusionMetrics,
    ConfusionPatch,
    EpochTask,
    InterpreteCallback,
    MeanPatch,
    TensorPatch,
    Trainer,
    TrainerBase,
    ValuePatch,
    batches,
    concat,
    rename,
)
from deepepochs import metrics as mm

QUIET = dict(device="cpu", log_batch=False, show_info=False)
CLASSES = 3


def _data(n=70, seed=0, classes=CLASSES):
    """Shuffled synthetic classification data whose labels depend on the inputs (NumPy and `random` draws)."""
    rng = np.random.default_rng(seed)
    x = torch.tensor(rng.normal(size=(n, 6)), dtype=torch.float32)
    y = (x[:, :classes].argmax(1) + torch.tensor([random.Random(seed + i).random() < 0.2 for i in range(n)])) % classes
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return x[order], y[order]


def _model(classes=CLASSES):
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, classes))


@rename("")
def acc_f1(preds, targets):
    """0.6.18 examples' dict metric: accuracy and macro F1 from one confusion matrix."""
    cmat = mm.confusion_matrix(preds, targets, CLASSES)
    return {"acc": mm.accuracy(conf_mat=cmat), "f1": mm.f1(conf_mat=cmat, average="macro")}


# ---- 1. the hand-written accumulation step ----

class SubBatches(TrainerBase):
    """0.6.18's example 22: split each batch by hand, then one update and the metrics of the whole batch."""

    via = "trainer"

    def train_step(self, batch_x, batch_y, **step_args):
        outs, loss_value, sub = [], 0.0, 4
        for sub_x, sub_y in zip(batches(batch_x, sub), batches(batch_y, sub)):
            out = self.model(sub_x)
            loss = self.loss(out, sub_y, loss_adjust=len(sub_y) / len(batch_y), do_optimize=False, do_metric=False)
            loss_value += loss.detach() * len(sub_y)
            outs.append(out)
        self.optimize()
        do_metric = self.do_metric if self.via == "trainer" else self.loss.do_metric
        do_metric(loss_value / len(batch_y), concat(outs), batch_y)


@pytest.mark.parametrize("via", ["trainer", "loss"])
def test_hand_written_accumulation_with_do_metric_equals_a_plain_loop(via):
    """`self.loss(..., do_optimize=False, do_metric=False)` per sub-batch, `self.optimize()`, then
    `self.do_metric(...)` (or `self.loss.do_metric`): the weights equal a plain loop's (dropout on), the
    epoch's acc/f1 equal scikit-learn on the epoch's outputs, the loss the sample-weighted mean."""
    x, y = _data()
    data = [(x[i:i + 10], y[i:i + 10]) for i in range(0, len(x), 10)]
    model, ref = _model(), _model()
    trainer_class = type("T", (SubBatches,), {"via": via})
    trainer = trainer_class(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), epochs=2,
                            metrics=[acc_f1], **QUIET)
    torch.manual_seed(7)
    records = trainer.fit(data)
    trainer.close()

    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    torch.manual_seed(7)
    expected = []
    for _ in range(2):
        outs, total = [], 0.0
        for bx, by in data:
            for sx, sy in zip(bx.split(4), by.split(4)):
                out = ref(sx)
                loss = F.cross_entropy(out, sy)
                (loss * len(sy) / len(by)).backward()
                outs.append(out.detach().argmax(1))
                total += float(loss.detach()) * len(sy)
            opt.step()
            opt.zero_grad()
        preds = torch.cat(outs).numpy()
        expected.append((total / len(y), accuracy_score(y.numpy(), preds), f1_score(y.numpy(), preds, average="macro")))
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert set(records["train"]) == {"loss", "acc", "f1"}
    for epoch, (loss, acc, f1) in enumerate(expected):
        assert records["train"]["loss"][epoch] == pytest.approx(loss, abs=1e-5)
        assert records["train"]["acc"][epoch] == pytest.approx(acc, abs=1e-6)
        assert records["train"]["f1"][epoch] == pytest.approx(f1, abs=1e-6)


# ---- 2. 0.6.18's patch API: XPatch(...).load(...) ----

def _acc_of_matrix(cm):
    return cm.diagonal().sum() / cm.sum()


class PatchTask(EpochTask):
    """0.6.18's examples 18-19: every built-in patch in its `.load(...)` spelling."""

    def step(self, batch_x, batch_y, **step_args):
        out = self.model(batch_x)
        loss = self.loss(out, batch_y)
        n = len(batch_y)
        return {
            "loss1": ValuePatch(n).load(loss.detach()),
            "tacc": TensorPatch(mm.accuracy).load(out, batch_y),
            "macc": MeanPatch(mm.accuracy, n).load(out, batch_y),
            "cacc": ConfusionPatch(_acc_of_matrix).load(out, batch_y),
            "cm": ConfusionMetrics(name="C.").load(out, batch_y),
            "beta": ConfusionMetrics(["fbeta"], average="macro", beta=2.0, name="B.").load(out, batch_y),
        }


def test_0618_patch_load_spelling_gives_whole_dataset_values_under_0618_names():
    """`ValuePatch(bs).load(v)`, `TensorPatch(f).load(p, t)`, `MeanPatch(f, bs).load(p, t)`,
    `ConfusionPatch(f_of_matrix).load(p, t)` and `ConfusionMetrics(..., name='C.').load(p, t)` (short keys
    acc/p/r/f1/fb) in a step: each value equals scikit-learn's on the whole test set (uneven last batch)."""
    x, y = _data(70)
    dl = DataLoader(TensorDataset(x, y), batch_size=16)
    model = _model()
    with Trainer(model, F.cross_entropy, epochs=1, **QUIET) as trainer:
        got = trainer.test(tasks=[PatchTask(dl)])
    model.eval()
    with torch.no_grad():
        out = model(x)
    preds, truth = out.argmax(1).numpy(), y.numpy()
    acc = accuracy_score(truth, preds)
    assert set(got) == {"loss", "loss1", "tacc", "macc", "cacc", "C.acc", "C.p", "C.r", "C.f1", "C.fb", "B.fb"}
    assert got["loss1"] == pytest.approx(float(F.cross_entropy(out, y)), abs=1e-5) == got["loss"]
    for key in ("tacc", "macc", "cacc", "C.acc"):
        assert got[key] == pytest.approx(acc, abs=1e-6), key
    for key in ("C.p", "C.r", "C.f1", "C.fb"):  # micro averages of single-label data: the accuracy
        assert got[key] == pytest.approx(f1_score(truth, preds, average="micro"), abs=1e-6), key
    assert got["B.fb"] == pytest.approx(fbeta_score(truth, preds, beta=2.0, average="macro"), abs=1e-6)


def test_0618_patch_constructors_keep_the_counts_and_names_they_are_given():
    """The count given to the constructor weighs the loaded value; a name given positionally is kept; an
    empty ValuePatch without a count says how to give one."""
    a, b = ValuePatch(3).load(torch.tensor(1.0)), ValuePatch(1, "L").load(torch.tensor(5.0))
    assert float((a + b)()) == pytest.approx((3 * 1.0 + 5.0) / 4) and b.name == "L"
    m = MeanPatch(mm.accuracy, 2, "m").load(torch.tensor([1, 1]), torch.tensor([1, 0]))
    assert float(m()) == 0.5 and m.name == "m" and m.state.count == 2
    assert ValuePatch(2).load({"a": torch.tensor(1.0), "b": 3.0})() == {"a": 1.0, "b": 3.0}
    with pytest.raises(ConfigError, match=r"batch_size is required: .*ValuePatch\(batch_size\)\.load"):
        ValuePatch().load(torch.tensor(1.0))


# ---- 3. a step's dict-valued patch is shown behind its key ----

class PrefixTask(EpochTask):
    """0.6.18's examples 15-17 and 20: `{'m_': TensorPatch(metrics).load(...)}` shows m_acc, m_f1."""

    def step(self, batch_x, batch_y, **step_args):
        out = self.model(batch_x)
        self.loss(out, batch_y)
        return {"m_": TensorPatch(acc_f1).load(out, batch_y)}


def test_a_steps_dict_patch_is_prefixed_by_its_key_and_can_be_monitored():
    """The keys shown are `m_acc`, `m_f1` as in 0.6.18; `CheckCallback('m_acc')` monitors them; the
    values equal scikit-learn on the whole validation set."""
    x, y = _data(64)
    vx, vy = _data(40, seed=3)
    model = _model()
    check = CheckCallback("m_acc", mode="max", save_best=False)
    with Trainer(model, F.cross_entropy, epochs=1, callbacks=[check], **QUIET) as trainer:
        records = trainer.fit(train_tasks=PrefixTask(DataLoader(TensorDataset(x, y), batch_size=16)),
                              val_tasks=PrefixTask(DataLoader(TensorDataset(vx, vy), batch_size=16)))
    model.eval()
    with torch.no_grad():
        preds = model(vx).argmax(1).numpy()
    assert set(records["val"]) == {"loss", "m_acc", "m_f1"}
    assert records["val"]["m_acc"][0] == pytest.approx(accuracy_score(vy.numpy(), preds), abs=1e-6)
    assert records["val"]["m_f1"][0] == pytest.approx(f1_score(vy.numpy(), preds, average="macro"), abs=1e-6)


def test_the_trainers_own_patches_returned_by_a_step_keep_their_names():
    """A step returning `self.batch_patches(out, y)` (the trainer's metric patches) shows the metrics under
    the names the default step gives them, not behind the patches' keys."""

    class Own(EpochTask):
        def step(self, batch_x, batch_y, **step_args):
            out = self.model(batch_x)
            self.loss(out, batch_y, do_metric=False)
            return self.batch_patches(out, batch_y)

    x, y = _data(40)
    dl = DataLoader(TensorDataset(x, y), batch_size=16)
    for kind, metrics in (("confusion", [mm.accuracy, mm.f1]), ("tensor", [mm.accuracy, acc_f1])):
        with Trainer(_model(), F.cross_entropy, epochs=1, metrics=metrics, metric_patch=kind, **QUIET) as trainer:
            own = trainer.test(tasks=Own(dl))
            plain = trainer.test(dl)
        assert own == plain and "accuracy" in own, kind


# ---- 4. two-class precision/recall/F1: said once ----

def test_two_class_f1_scores_class_1_and_says_so_once(capsys):
    """The trainer's F1 of a two-class problem equals scikit-learn's (class 1); the first epoch that
    reports it prints, once, which class is scored and how to choose."""
    x, y = _data(64, classes=2)
    dl = DataLoader(TensorDataset(x, y), batch_size=16)
    model = _model(2)
    with Trainer(model, F.cross_entropy, epochs=2, metrics=[mm.f1], device="cpu", log_batch=False) as trainer:
        trainer.fit(dl, dl)
        got = trainer.test(dl)
    model.eval()
    with torch.no_grad():
        preds = model(x).argmax(1).numpy()
    assert got["f1"] == pytest.approx(f1_score(y.numpy(), preds), abs=1e-6)
    out = capsys.readouterr().out
    assert out.count(mm.BINARY_DEFAULT_NOTE) == 1
    assert out.index(mm.BINARY_DEFAULT_NOTE) < out.index("E 1/2")  # at the first epoch's end


# ---- 6. metric_patch='confusion' with a function of the matrix ----

def test_metric_patch_confusion_takes_a_user_function_of_the_confusion_matrix():
    """0.6's documented `metric_patch='confusion'` with `metric(cm)`: the value equals scikit-learn's on
    the whole set; a function of (preds, targets) is refused before training, naming 'tensor'."""

    @rename("acc")
    def acc_of_cm(cm):
        return cm.diagonal().sum() / cm.sum()

    def recall0(cm):
        return {"r0": cm[0, 0] / cm[0].sum()}

    x, y = _data(70)
    dl = DataLoader(TensorDataset(x, y), batch_size=16)
    model = _model()
    with Trainer(model, F.cross_entropy, epochs=1, metrics=[acc_of_cm, recall0], metric_patch="confusion",
                 **QUIET) as trainer:
        got = trainer.test(dl)
    model.eval()
    with torch.no_grad():
        preds = model(x).argmax(1).numpy()
    cm = confusion_matrix(y.numpy(), preds, labels=list(range(CLASSES)))
    assert got["acc"] == pytest.approx(accuracy_score(y.numpy(), preds), abs=1e-6)
    assert got["r0"] == pytest.approx(cm[0, 0] / cm[0].sum(), abs=1e-6)

    def two_args(preds, targets):
        return (preds.argmax(1) == targets).float().mean()

    with Trainer(_model(), F.cross_entropy, epochs=1, metrics=[two_args], metric_patch="confusion",
                 **QUIET) as trainer:
        with pytest.raises(ConfigError, match=r"functions of one confusion matrix fn\(cm\).*\(got 'two_args'\);"
                                              r" use metric_patch='tensor'"):
            trainer.test(dl)


# ---- 7. Accelerate-era arguments ----

def _accelerate_class(name, module, **attrs):
    """A stand-in with the class and module names of Hugging Face Accelerate's (not installed here)."""
    return type(name, (), {"__module__": module, **attrs})


def test_accelerate_arguments_are_refused_up_front_naming_their_replacements():
    """`device=Accelerator(...)` names precision=/gradient_accumulation_steps= with its own settings and
    launch; `auto_traindata_to_device=` says to drop it; an `accelerator.prepare`d optimizer is refused
    before training; each points to MIGRATION.md. Other unknown keywords stay Python's TypeError."""
    model = _model()
    accelerator = _accelerate_class("Accelerator", "accelerate.accelerator", mixed_precision="bf16",
                                    gradient_accumulation_steps=4)()
    with pytest.raises(ConfigError, match=r"device=Accelerator\(\.\.\.\) .*precision='bf16',"
                                          r" gradient_accumulation_steps=4 .*launch\(main\) or torchrun.*MIGRATION"):
        Trainer(model, F.cross_entropy, epochs=1, device=accelerator)
    with pytest.raises(TypeError, match=r"auto_traindata_to_device, which is gone: .*drop the argument.*MIGRATION"):
        Trainer(model, F.cross_entropy, epochs=1, auto_traindata_to_device=False, **QUIET)
    wrapped = _accelerate_class("AcceleratedOptimizer", "accelerate.optimizer")()
    wrapped.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"AcceleratedOptimizer .*pass the torch optimizer itself.*MIGRATION"):
        Trainer(model, F.cross_entropy, wrapped, epochs=1, **QUIET)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\): 'no_such_option'"):
        Trainer(model, F.cross_entropy, epochs=1, no_such_option=1, **QUIET)


# ---- 8. several tasks: the suffixes are said once ----

def test_several_tasks_keep_every_tasks_loss_and_say_how_they_are_named(capsys):
    """Two validation tasks: `loss` is the first task's, `loss_1` the second's (each equal to its own data's
    mean loss); a note printed once says so and that 0.6 kept only the last task's."""
    x, y = _data(48)
    vx, vy = _data(30, seed=5)
    model = _model()
    with Trainer(model, F.cross_entropy, epochs=2, device="cpu", log_batch=False) as trainer:
        records = trainer.fit(DataLoader(TensorDataset(x, y), batch_size=16),
                              val_tasks=[EpochTask(DataLoader(TensorDataset(x, y), batch_size=16)),
                                         EpochTask(DataLoader(TensorDataset(vx, vy), batch_size=16))])
    model.eval()
    with torch.no_grad():
        assert records["val"]["loss"][-1] == pytest.approx(float(F.cross_entropy(model(x), y)), abs=1e-5)
        assert records["val"]["loss_1"][-1] == pytest.approx(float(F.cross_entropy(model(vx), vy)), abs=1e-5)
    assert capsys.readouterr().out.count("later tasks' get their index (`loss_1`, `loss_2`, ...)") == 1


# ---- 10. smaller ones ----

def test_interprete_callback_without_metric_keeps_the_confusion_matrix_only():
    """0.6's `InterpreteCallback()` without a metric: the test set's confusion matrix (equal to
    scikit-learn's), no samples; 0.6.18's positional arguments (metric, k, mode, stages, class_num) with a
    class count larger than the classes seen give a matrix of that size."""
    x, y = _data(50)
    model = _model()
    interpreter = InterpreteCallback()
    sized = InterpreteCallback(None, 10, "max", ("val", "test"), 5)
    with Trainer(model, F.cross_entropy, epochs=1, callbacks=[interpreter, sized], **QUIET) as trainer:
        trainer.test(DataLoader(TensorDataset(x, y), batch_size=16))
    model.eval()
    with torch.no_grad():
        preds = model(x).argmax(1).numpy()
    assert interpreter.top_samples("test") == [] and sized.top_samples("test") == []
    assert interpreter.confusion_matrix("test").tolist() == confusion_matrix(y.numpy(), preds).tolist()
    assert sized.confusion_matrix("test").tolist() == confusion_matrix(y.numpy(), preds, labels=range(5)).tolist()


def test_fit_and_test_values_are_plain_floats_that_torch_load_reads_back(tmp_path):
    """0.6 returned NumPy 0-d arrays (`.item()`); 0.7 returns plain floats (MIGRATION.md says to drop
    `.item()`), so results saved with `torch.save` load with `torch.load`'s default `weights_only=True` (a
    float subclass or a NumPy scalar would be refused there) and print, serialise and pickle as floats."""
    import json

    x, y = _data(32)
    dl = DataLoader(TensorDataset(x, y), batch_size=16)
    with Trainer(_model(), F.cross_entropy, epochs=1, metrics=[mm.accuracy], **QUIET) as trainer:
        records = trainer.fit(dl)
        got = trainer.test(dl)
    assert all(type(v) is float for v in got.values())
    assert all(type(v) is float for values in records["train"].values() for v in values)
    assert json.loads(json.dumps(got)) == got
    torch.save({"test": got, "fit": records}, tmp_path / "results.pt")
    assert torch.load(tmp_path / "results.pt") == {"test": got, "fit": records}


@pytest.mark.parametrize("name", [
    "make_runningid", "batch_size", "listify", "ddict", "tensor_tuple", "compose_data", "clone_value", "log_batch",
    "log_epoch", "info", "print_out", "concat_dicts", "keyset", "detach_clone", "check_path", "default_loss",
    "SeriesPlots", "Moveing", "TopKQueue", "groupby_apply", "load_yaml", "CallbackPool", "DefaultCallback",
])
def test_helpers_of_0_6s_star_import_name_what_to_use(name):
    """Each helper 0.6's `from deepepochs import *` exported raises an ImportError naming the helper and a
    replacement, not Python's bare "cannot import name"."""
    with pytest.raises(ImportError, match=rf"deepepochs\.{name} \(deepepochs 0\.6\) was removed: \S.{{20,}}"):
        exec(f"from deepepochs import {name}", {})


def test_resume_with_0_6_checkpoints_in_logs_says_how_to_resume_them(tmp_path, monkeypatch, capsys):
    """0.6 saved checkpoints in ./logs (0.7's default is ./checkpoints): resume=True finding none says where
    0.6's are and how to resume them; following the advice loads the 0.6 file's weights."""
    monkeypatch.chdir(tmp_path)
    saved = _model()
    (tmp_path / "logs" / "run1").mkdir(parents=True)
    opt = torch.optim.SGD(saved.parameters(), lr=0.1)
    torch.save({"model_state": saved.state_dict(), "opt_state": opt.state_dict(), "best_value": 0.5, "epoch": 1},
               tmp_path / "logs" / "run1" / "checkpoint.ckpt")
    x, y = _data(32)
    dl = DataLoader(TensorDataset(x, y), batch_size=16)
    fresh = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, CLASSES))
    with Trainer(fresh, F.cross_entropy, epochs=2, callbacks=[CheckCallback("loss")], resume=True,
                 device="cpu", log_batch=False) as trainer:
        trainer.test(dl)
    assert ("deepepochs 0.6 checkpoints are in ./logs, 0.6's default folder: pass CheckCallback(...,"
            " ckpt_dir='./logs') to resume them") in capsys.readouterr().out
    with Trainer(fresh, F.cross_entropy, torch.optim.SGD(fresh.parameters(), lr=0.1), epochs=2,
                 callbacks=[CheckCallback("loss", ckpt_dir="./logs")], resume=True, **QUIET) as trainer:
        trainer.test(dl)
        assert all(torch.equal(a, b) for a, b in zip(trainer.raw_model.state_dict().values(),
                                                     saved.state_dict().values()))
