"""Core use of Trainer: each result is checked against an
independent computation (a plain PyTorch loop or a whole-dataset evaluation)."""

import io
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import deepepochs
from deepepochs import Callback, CheckCallback, ConfigError, EpochTask, Trainer, TrainerBase, ValuePatch, rename
from deepepochs.metrics import accuracy, f1, precision, recall


def _binary(n=256, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    return x, (x[:, 0] > 0).long()


def quiet(model, loss=F.cross_entropy, opt=None, **kw):
    kw.setdefault("device", "cpu")
    t = Trainer(model, loss, opt, log_batch=False, show_info=False, **kw)
    t._console.enabled = False
    return t


def test_seed_readme_first_example_runs_unchanged(capsys):
    """The README's first example, verbatim, prints epoch lines and returns train/val records and test metrics."""
    x = torch.randn(256, 16)
    y = (x[:, 0] > 0).long()
    train_dl = DataLoader(TensorDataset(x[:192], y[:192]), batch_size=32, shuffle=True)
    val_dl = DataLoader(TensorDataset(x[192:], y[192:]), batch_size=32)
    model = nn.Linear(16, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.001)
    trainer = Trainer(model, F.cross_entropy, opt, epochs=5)
    progress = trainer.fit(train_dl, val_dl)
    results = trainer.test(val_dl)
    trainer.close()
    out = capsys.readouterr().out
    assert len(progress["train"]["loss"]) == 5 and len(progress["val"]["loss"]) == 5
    assert set(results) == {"loss"}
    assert re.search(r"^E 5/5  TRAIN> loss: \d+\.\d{4}   VAL> loss: \d+\.\d{4}$", out, re.M)
    assert re.search(r"^E 1/1  TEST>  loss: \d+\.\d{4}$", out, re.M)
    assert "parameters: 34 (float32) | precision: fp32" in out and "device: cpu" in out


def test_the_header_names_the_parameters_dtype_a_float64_model_trains_in(capsys):
    """A float64 model trains in float64 under precision 'fp32': the header says both."""
    model = nn.Linear(4, 2).double()
    data = DataLoader(TensorDataset(torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 2, (8,))), batch_size=4)
    with Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), 0.1), epochs=1, device="cpu") as trainer:
        trainer.fit(data)
    assert "parameters: 10 (float64) | precision: fp32" in capsys.readouterr().out


def test_a_linear_model_learns_well_above_chance():
    """With lr=0.05 the seed's task reaches > 90 % validation accuracy (chance is ~50 %)."""
    torch.manual_seed(0)
    x, y = _binary()
    model = nn.Linear(16, 2)
    t = quiet(model, opt=torch.optim.Adam(model.parameters(), lr=0.05), epochs=10, metrics=[accuracy])
    rec = t.fit(DataLoader(TensorDataset(x[:192], y[:192]), batch_size=32, shuffle=True),
                DataLoader(TensorDataset(x[192:], y[192:]), batch_size=32))
    assert rec["val"]["accuracy"][-1] > 0.9
    assert rec["train"]["loss"][-1] < rec["train"]["loss"][0]


def test_training_equals_a_plain_pytorch_loop():
    """fit with SGD gives the same weights and per-epoch mean loss as a hand-written loop on the same batches."""
    x, y = _binary(100)
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 100, 16)]  # ragged last batch of 4
    torch.manual_seed(1)
    ref = nn.Linear(16, 2)
    torch.manual_seed(1)
    model = nn.Linear(16, 2)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for _ in range(3):
        total = 0.0
        for bx, by in batches:
            opt.zero_grad()
            loss = F.cross_entropy(ref(bx), by)
            loss.backward()
            opt.step()
            total += loss.item() * len(by)
        losses.append(total / 100)
    t = quiet(model, opt=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), epochs=3)
    rec = t.fit(batches)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    np.testing.assert_allclose(rec["train"]["loss"], losses, rtol=1e-6)
    assert all(p.grad is None for p in model.parameters())


def test_dataset_level_metrics_are_exact_with_uneven_batches():
    """Default TensorPatch F1/precision/recall and 'mean' accuracy equal the whole-dataset values; the loss is
    the sample-weighted mean."""
    sklearn = pytest.importorskip("sklearn.metrics")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(103, 5, generator=g)
    y = torch.randint(0, 3, (103,), generator=g)
    sizes = [7, 30, 1, 40, 25]
    starts = np.cumsum([0, *sizes])
    batches = [(x[a:b], y[a:b]) for a, b in zip(starts[:-1], starts[1:])]
    torch.manual_seed(0)
    model = nn.Linear(5, 3)
    macro_f1 = rename(lambda p, t: f1(p, t, average="macro"), "f1")
    macro_p = rename(lambda p, t: precision(p, t, average="macro"), "precision")
    macro_r = rename(lambda p, t: recall(p, t, average="macro"), "recall")
    t = quiet(model, epochs=1)
    got = t.test(batches, metrics=[macro_f1, macro_p, macro_r, accuracy])
    with torch.no_grad():
        logits = model(x)
    pred = logits.argmax(1).numpy()
    assert got["f1"] == pytest.approx(sklearn.f1_score(y.numpy(), pred, average="macro", zero_division=0), abs=1e-6)
    assert got["precision"] == pytest.approx(
        sklearn.precision_score(y.numpy(), pred, average="macro", zero_division=0), abs=1e-6)
    assert got["recall"] == pytest.approx(sklearn.recall_score(y.numpy(), pred, average="macro"), abs=1e-6)
    assert got["loss"] == pytest.approx(F.cross_entropy(logits, y).item(), abs=1e-6)
    t_mean = quiet(model, epochs=1, metric_patch="mean")
    got_mean = t_mean.test(batches, metrics=[accuracy])
    assert got_mean["accuracy"] == pytest.approx(float((pred == y.numpy()).mean()), abs=1e-6)


def test_confusion_patch_gives_the_same_classification_metrics():
    """metric_patch='confusion' computes the same dataset-level values from one confusion matrix."""
    x, y = _binary(90, 4, seed=5)
    batches = [(x[i:i + 13], y[i:i + 13]) for i in range(0, 90, 13)]
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    metrics = [accuracy, f1]
    tensor = quiet(model).test(batches, metrics=metrics)
    confusion = quiet(model, metric_patch="confusion").test(batches, metrics=metrics)
    for name in ("accuracy", "f1"):
        assert confusion[name] == pytest.approx(tensor[name], abs=1e-6)


class TwoInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(3, 2), nn.Linear(4, 2)

    def forward(self, x1, x2):
        return self.a(x1) + self.b(x2)


def test_multi_input_batches_call_the_model_with_all_inputs():
    """(x1, x2, y) batches call model(x1, x2) and train."""
    g = torch.Generator().manual_seed(0)
    x1, x2 = torch.randn(64, 3, generator=g), torch.randn(64, 4, generator=g)
    y = (x1[:, 0] + x2[:, 0] > 0).long()
    model = TwoInput()
    t = quiet(model, opt=torch.optim.Adam(model.parameters(), lr=0.05), epochs=15)
    rec = t.fit(DataLoader(TensorDataset(x1, x2, y), batch_size=16))
    assert rec["train"]["loss"][-1] < 0.5 * rec["train"]["loss"][0]


def test_nested_labels_are_moved_and_passed_to_the_loss():
    """A label that is a dict of tensors reaches the loss function intact (and on the device)."""
    x, y = _binary(32, 4)
    seen = []

    def loss(out, target):
        seen.append((sorted(target), target["cls"].device.type, target["extra"][0]))
        return F.cross_entropy(out, target["cls"])

    batches = [(x[i:i + 8], {"cls": y[i:i + 8], "extra": ["tag"]}) for i in range(0, 32, 8)]
    quiet(nn.Linear(4, 2), loss=loss, epochs=1).fit(batches)
    assert seen[0] == (["cls", "extra"], "cpu", "tag") and len(seen) == 4


class SelfLoss(nn.Module):
    def __init__(self, as_dict):
        super().__init__()
        self.lin, self.as_dict = nn.Linear(4, 2), as_dict

    def forward(self, x, y):
        loss = F.cross_entropy(self.lin(x), y)
        return {"loss": loss} if self.as_dict else loss


@pytest.mark.parametrize("as_dict", [False, True])
def test_models_computing_their_own_loss_train_from_tuple_batches(as_dict):
    """With loss=None every item of a tuple batch is an input; a scalar or {'loss': ...} output is the loss."""
    x, y = _binary(64, 4)
    model = SelfLoss(as_dict)
    t = quiet(model, loss=None, opt=torch.optim.SGD(model.parameters(), lr=0.5), epochs=10)
    rec = t.fit(DataLoader(TensorDataset(x, y), batch_size=16))
    assert rec["train"]["loss"][-1] < rec["train"]["loss"][0]


class DictModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, features, label):
        return {"loss": F.cross_entropy(self.lin(features), label)}


def test_dict_batches_become_keyword_arguments():
    """A dict batch calls model(**batch) and trains without a loss function."""
    x, y = _binary(64, 4)
    batches = [{"features": x[i:i + 16], "label": y[i:i + 16]} for i in range(0, 64, 16)]
    model = DictModel()
    t = quiet(model, loss=None, opt=torch.optim.SGD(model.parameters(), lr=0.5), epochs=10)
    rec = t.fit(batches)
    assert rec["train"]["loss"][-1] < rec["train"]["loss"][0]


def test_fit_and_test_can_be_called_repeatedly_toward_the_epoch_target():
    """epochs is the total target: a second fit continues; a fit at the target runs no epoch; test in between."""
    x, y = _binary(64, 4)
    data = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]
    t = quiet(nn.Linear(4, 2), epochs=2)
    assert len(t.fit(data)["train"]["loss"]) == 2
    t.test(data)
    assert t.fit(data) == t.history and len(t.history["train"]["loss"]) == 2  # nothing more trained
    assert len(t.fit(data, epochs=5)["train"]["loss"]) == 5
    assert t.loop.completed_epochs == 5 and len(t.history["train"]["loss"]) == 5


def test_trainer_as_context_manager_closes_itself():
    """`with Trainer(...)` closes on exit; a closed trainer refuses further use."""
    with quiet(nn.Linear(4, 2), epochs=1) as t:
        pass
    with pytest.raises(RuntimeError, match="closed"):
        t.fit([(torch.randn(2, 4), torch.tensor([0, 1]))])


def test_any_iterable_of_batches_works():
    """A list or a custom iterable (no len) works where a DataLoader is expected."""

    class Stream:
        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            for _ in range(3):
                xb = torch.randn(8, 4, generator=g)
                yield xb, (xb[:, 0] > 0).long()

    rec = quiet(nn.Linear(4, 2), epochs=2).fit(Stream(), Stream())
    assert len(rec["val"]["loss"]) == 2


class StepTrainer(TrainerBase):
    calls: list

    def train_step(self, batch_x, batch_y, **kw):
        self.calls.append(("trainer.train_step", kw))
        self.loss(self.model(batch_x), batch_y)

    def evaluate_step(self, batch_x, batch_y, **kw):
        self.calls.append(("trainer.evaluate_step", kw))
        return {"n": ValuePatch(torch.tensor(1.0), len(batch_y))}


class TaskWithStep(EpochTask):
    def val_step(self, batch_x, batch_y, **kw):
        self.calls.append(("task.val_step", kw))
        return {"task": ValuePatch(2.0, len(batch_y))}


def test_step_methods_are_chosen_task_first_then_trainer_then_evaluate_step():
    """A task's val_step beats the trainer's evaluate_step; step args reach the step method."""
    x, y = _binary(16, 4)
    data = [(x[:8], y[:8]), (x[8:], y[8:])]
    t = StepTrainer(nn.Linear(4, 2), F.cross_entropy, device="cpu", epochs=1, log_batch=False, show_info=False)
    t._console.enabled = False
    t.calls = []
    t.fit(train_tasks=[EpochTask(data, scale=3)], val_tasks=[TaskWithStep(data)], val_dl=data)
    kinds = {c[0] for c in t.calls}
    assert kinds == {"trainer.train_step", "trainer.evaluate_step", "task.val_step"}
    assert ("trainer.train_step", {"scale": 3}) in t.calls
    assert t.test(data) == {"n": 1.0}


class Order(Callback):
    def __init__(self, name, log):
        self.name, self.log = name, log

    def on_before_fit(self, trainer, epochs):
        self.log.append(("before", self.name))

    def on_after_fit(self, trainer):
        self.log.append(("after", self.name))


def test_before_hooks_run_in_registration_order_and_after_hooks_in_reverse():
    """The callback hooks' ordering rule."""
    log = []
    t = quiet(nn.Linear(4, 2), epochs=1, callbacks=[Order("a", log), Order("b", log)])
    t.fit([(torch.randn(4, 4), torch.tensor([0, 1, 0, 1]))])
    assert log == [("before", "a"), ("before", "b"), ("after", "b"), ("after", "a")]


class Boom(Callback):
    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if batch_idx == 1:  # 0-based: the second batch
            raise ValueError("boom at batch 2")


def test_an_error_in_the_loop_carries_the_flight_record_and_leaves_the_trainer_usable():
    """The exception notes name the last transitions with epoch/batch; the trainer returns to idle."""
    x, y = _binary(32, 4)
    data = [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)]
    t = quiet(nn.Linear(4, 2), epochs=1, callbacks=[Boom()])
    with pytest.raises(ValueError, match="boom") as info:
        t.fit(data)
    notes = "\n".join(info.value.__notes__)
    assert "last transitions of the deepepochs loop" in notes
    assert "raised in state 'task_train' (epoch 1, batch 2" in notes
    assert "epoch 1 batch 2: step_optimized --end_batch--> task_train" in notes
    assert t.machine.state == "idle"
    t._hooks.remove(t.callbacks)
    assert len(t.fit(data)["train"]["loss"]) == 1


def test_console_prints_batch_lines_with_the_familiar_shape(monkeypatch):
    """Batch lines `E 1/2  B 3/4  TRAIN> loss: ...` (throttled) and 7 digits with log_long."""
    monkeypatch.setattr(deepepochs.reporting.console, "LOG_REFRESH_S", 0.0)
    stream = io.StringIO()
    x, y = _binary(32, 4)
    data = DataLoader(TensorDataset(x, y), batch_size=8)
    t = Trainer(nn.Linear(4, 2), F.cross_entropy, device="cpu", epochs=2, log_long=True, metrics=[accuracy])
    t._console.stream = stream
    t.fit(data, data)
    out = stream.getvalue()
    assert "\r" not in out
    assert re.search(r"^E 1/2  B 3/4  TRAIN> loss: \d\.\d{7}  accuracy: \d\.\d{7}$", out, re.M)
    assert re.search(r"^E 2/2  TRAIN> loss: \d\.\d{7}  accuracy: \d\.\d{7}   VAL> loss: \d\.\d{7}", out, re.M)


def test_a_short_run_written_to_a_file_shows_its_epoch_lines_and_no_batch_line():
    """Output to a file (not a terminal): a batch line at most every 10 s (docs/MIGRATION.md), so a run of a
    few milliseconds writes its header and epoch lines only, each ending its line."""
    stream = io.StringIO()
    x, y = _binary(32, 4)
    data = DataLoader(TensorDataset(x, y), batch_size=8)
    t = Trainer(nn.Linear(4, 2), F.cross_entropy, device="cpu", epochs=2)
    t._console.stream = stream
    t.fit(data, data)
    lines = stream.getvalue().splitlines()
    assert [line[:7] for line in lines[1:]] == ["E 1/2  ", "E 2/2  "], lines
    assert not any(" B " in line for line in lines) and "\r" not in stream.getvalue()


def test_public_names_resolve_and_all_is_sorted():
    """The package root re-exports an alphabetised __all__ whose names all exist."""
    assert list(deepepochs.__all__) == sorted(deepepochs.__all__)
    for name in deepepochs.__all__:
        assert getattr(deepepochs, name) is not None


def test_state_graph_marks_the_failed_state_of_a_crashed_trainer():
    """Mermaid and DOT from a crashed trainer mark where it failed and number the last edges."""
    x, y = _binary(32, 4)
    t = quiet(nn.Linear(4, 2), epochs=1, callbacks=[Boom()])
    with pytest.raises(ValueError):
        t.fit([(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)])
    mermaid = t.state_graph("mermaid", level="full")
    assert "class task_train failed" in mermaid
    assert re.search(r"^    task_train --> rollback : 11: interrupt$", mermaid, re.M)
    dot = t.state_graph("dot")  # the coarsest level showing the failed state: epoch (epoch, stage, task)
    assert "level epoch" in dot and re.search(r'task_train \[[^\]]*fillcolor="#ff8080"', dot)


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' binary not installed")
def test_state_graph_renders_png_and_svg(tmp_path):
    """With Graphviz installed, PNG and SVG files are produced; with a path, the path comes back (not the
    drawing's bytes, which a notebook would print), and the file holds what the call without a path returns."""
    t = quiet(nn.Linear(4, 2), epochs=1)
    assert t.state_graph("png", path=tmp_path / "g.png") == tmp_path / "g.png"
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = t.state_graph("svg")
    assert b"<svg" in svg
    written = t.state_graph("svg", path=str(tmp_path / "g.svg"))
    assert written == tmp_path / "g.svg" and written.read_bytes() == svg
    assert t.state_graph("mermaid", path=tmp_path / "g.mmd").read_text() == t.state_graph("mermaid")


def test_graph_command_line_writes_mermaid_and_dot(tmp_path):
    """`python -m deepepochs graph` prints Mermaid and writes DOT to a file."""
    out = subprocess.run([sys.executable, "-m", "deepepochs", "graph", "--level", "batch"], capture_output=True,
                         text=True, check=True)
    assert out.stdout.startswith("stateDiagram-v2") and "window_open --> step_forward" in out.stdout
    subprocess.run([sys.executable, "-m", "deepepochs", "graph", "--format", "dot", "-o", str(tmp_path / "g.dot")],
                   check=True)
    assert (tmp_path / "g.dot").read_text().startswith("digraph deepepochs_loop")



def test_a_deepcopy_of_a_trainer_trains_like_the_original_and_leaves_the_original_alone():
    """The copy's step-wise scheduler advances once per update (8 here, as a plain loop's would), its
    weights equal the original's trained afterwards from the same state and seed, and training the copy
    changes nothing of the original."""
    import copy  # noqa: PLC0415

    from deepepochs import Optimizer  # noqa: PLC0415

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    original = Trainer(model, torch.nn.functional.mse_loss, Optimizer(opt, sched, sched_on="step"), epochs=2,
                       device="cpu", log_batch=False, show_info=False)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    data = [(x[i:i + 8], x[i:i + 8].sum(1, keepdim=True)) for i in range(0, 32, 8)]
    twin = copy.deepcopy(original)
    torch.manual_seed(2)
    twin.fit(data)
    assert twin.opt.items[0].scheduler.last_epoch == 8 and twin.opt.items[0].opt.param_groups[0]["lr"] == 0.1 * 0.5**2
    assert original.opt.items[0].scheduler.last_epoch == 0 and original.loop.completed_epochs == 0
    assert all(torch.equal(model.state_dict()[k], v) for k, v in initial.items())
    torch.manual_seed(2)
    original.fit(data)
    for key, value in original.raw_model.state_dict().items():
        assert torch.equal(twin.raw_model.state_dict()[key], value), key


def test_validation_tasks_named_by_the_user_report_their_metrics_under_their_names(tmp_path, capsys):
    """`EpochTask(dl, name='clean')` and `name='ood'`: the records hold `loss_clean` and `loss_ood`, each the
    mean loss over its own data; a monitor may name `loss_ood` from the start; no note about indices."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)
    ox, oy = torch.randn(24, 4, generator=g) * 3, torch.randint(0, 2, (24,), generator=g)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    check = CheckCallback("loss_ood", on_stage="val", ckpt_dir=tmp_path)
    with Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), 0.1), epochs=2, device="cpu",
                 callbacks=[check], log_batch=False) as trainer:
        records = trainer.fit(DataLoader(TensorDataset(x, y), batch_size=8),
                              val_tasks=[EpochTask(DataLoader(TensorDataset(x, y), batch_size=8), name="clean"),
                                         EpochTask(DataLoader(TensorDataset(ox, oy), batch_size=8), name="ood")])
    with torch.no_grad():
        assert records["val"]["loss_clean"][-1] == pytest.approx(float(F.cross_entropy(model(x), y)), abs=1e-6)
        assert records["val"]["loss_ood"][-1] == pytest.approx(float(F.cross_entropy(model(ox), oy)), abs=1e-6)
    assert "loss" not in records["val"] and "loss_1" not in records["val"]
    assert "later tasks' get their index" not in capsys.readouterr().out
    with pytest.raises(ConfigError, match=r"EpochTask name must be None or a word .* \(got 'o o d'\)"):
        EpochTask(DataLoader(TensorDataset(x, y)), name="o o d")
