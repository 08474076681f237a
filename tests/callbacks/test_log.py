"""LogCallback, the trainer's shared TensorBoard writer and the console.

Event files are read back with TensorBoard's own reader, `EventAccumulator`.
"""

import collections
import contextlib
import gc
import io
import os
import re
import shutil
import threading

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import (
    AnalyzeCallback,
    Callback,
    ConfigError,
    EpochTask,
    InterpreteCallback,
    LogCallback,
    Trainer,
    set_seed,
)
from deepepochs.reporting.summary_writer import NullWriter


def accuracy(preds, targets):
    return (preds.argmax(1) == targets).float().mean()


def loaders(n=96, d=8, batch_size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = (x[:, 0] > 0).long()
    half = n * 2 // 3
    return (DataLoader(TensorDataset(x[:half], y[:half]), batch_size=batch_size),
            DataLoader(TensorDataset(x[half:], y[half:]), batch_size=batch_size))


def make_trainer(model, callbacks, epochs=3, **kw):
    kw.setdefault("log_batch", False)
    kw.setdefault("show_info", False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return Trainer(model, F.cross_entropy, opt, epochs=epochs, device="cpu", callbacks=callbacks,
                   running_id="run", **kw)


def read_run(path):
    ea = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0, "images": 0, "histograms": 0})
    ea.Reload()
    return ea


def scalars(ea, tag):
    return [(e.step, e.value) for e in ea.Scalars(tag)]


def text(ea, tag):
    return [e.tensor_proto.string_val[0].decode() for e in ea.Tensors(f"{tag}/text_summary")]


def writer_threads():
    return {t for t in threading.enumerate() if t.is_alive() and "Writer" in type(t).__name__}


def test_fit_then_test_writes_curves_learning_rate_and_hparams_into_one_run(tmp_path):
    """fit + test + close give one run folder with epoch train/val scalars, lr, test scalars and HParams."""
    train_dl, val_dl = loaders()
    trainer = make_trainer(nn.Linear(8, 2), [LogCallback(tmp_path)],
                           hyper_params={"lr": 0.1, "optimizer": "SGD", "layers": [8, 2]})
    records = trainer.fit(train_dl, val_dl, metrics=[accuracy])
    results = trainer.test(val_dl, metrics=[accuracy])
    trainer.close()

    assert os.listdir(tmp_path) == ["run"]
    ea = read_run(tmp_path / "run")
    for stage in ("train", "val"):
        for name in ("loss", "accuracy"):
            got = scalars(ea, f"{name}/{stage}")
            assert [s for s, _ in got] == [1, 2, 3]
            assert [v for _, v in got] == pytest.approx(records[stage][name], rel=1e-6)
    assert scalars(ea, "lr") == [(1, pytest.approx(0.1)), (2, pytest.approx(0.1)), (3, pytest.approx(0.1))]
    assert scalars(ea, "loss/test") == [(3, pytest.approx(results["loss"], rel=1e-6))]
    assert scalars(ea, "accuracy/test") == [(3, pytest.approx(results["accuracy"], rel=1e-6))]

    content = ea.PluginTagToContent("hparams")
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["lr"].number_value == pytest.approx(0.1)
    assert hparams["optimizer"].string_value == "SGD"
    assert hparams["layers"].string_value == "[8, 2]"
    assert {m.name.tag for m in experiment.metric_infos} == {"loss/test", "accuracy/test"}


def test_a_scheduled_learning_rate_is_logged_per_epoch_and_param_group(tmp_path):
    """Each param group's lr is written at the epoch it was used (schedulers step after the hook)."""
    train_dl, _ = loaders()
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.1},
                           {"params": model[1].parameters(), "lr": 0.01}])
    from deepepochs import Optimizer

    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with Trainer(model, F.cross_entropy, Optimizer(opt, sched), epochs=2, device="cpu", show_info=False,
                 log_batch=False, callbacks=[LogCallback(tmp_path)], running_id="run") as trainer:
        trainer.fit(train_dl)
    ea = read_run(tmp_path / "run")
    assert scalars(ea, "lr/lr_0_0") == [(1, pytest.approx(0.1)), (2, pytest.approx(0.05))]
    assert scalars(ea, "lr/lr_0_1") == [(1, pytest.approx(0.01)), (2, pytest.approx(0.005))]


def test_model_graph_is_traced_from_the_first_training_batch(tmp_path):
    """log_graph=True without example_input writes the graph of the first training batch's inputs."""
    train_dl, _ = loaders()
    with make_trainer(nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2)),
                      [LogCallback(tmp_path, log_graph=True)], epochs=1) as trainer:
        trainer.fit(train_dl)
    graph = read_run(tmp_path / "run").Graph()
    ops = {node.op for node in graph.node}
    assert "aten::linear" in ops and "aten::relu" in ops


def test_model_graph_from_example_input_takes_several_inputs(tmp_path):
    """example_input=(x1, x2) traces a two-input model."""

    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 2), nn.Linear(3, 2)

        def forward(self, x1, x2):
            return self.a(x1) + self.b(x2)

    x1, x2, y = torch.randn(32, 8), torch.randn(32, 3), torch.randint(0, 2, (32,))
    cb = LogCallback(tmp_path, log_graph=True, example_input=(torch.randn(1, 8), torch.randn(1, 3)))
    with make_trainer(TwoInputs(), [cb], epochs=1) as trainer:
        trainer.fit(DataLoader(TensorDataset(x1, x2, y), batch_size=8))
    graph = read_run(tmp_path / "run").Graph()
    assert sum(node.op == "aten::linear" for node in graph.node) == 2


def test_tracing_the_graph_does_not_change_training(tmp_path):
    """With dropout and BatchNorm, a run logging its graph ends with the same weights and buffers as one that
    does not (tracing restores the buffers and the random state)."""
    train_dl, _ = loaders()

    def run(callbacks):
        set_seed(0)
        model = nn.Sequential(nn.Linear(8, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Linear(6, 2))
        with make_trainer(model, callbacks, epochs=2) as trainer:
            trainer.fit(train_dl)
        return model.state_dict()

    plain = run([])
    logged = run([LogCallback(tmp_path, log_graph=True)])
    assert read_run(tmp_path / "run").Graph() is not None
    for key in plain:
        assert torch.equal(plain[key], logged[key]), key


def test_state_graph_is_written_once_per_run_as_mermaid_text(tmp_path):
    """The loop machine is in the run's text (Mermaid), once although fit and test both ran; with Graphviz
    it is also an image."""
    train_dl, val_dl = loaders()
    with make_trainer(nn.Linear(8, 2), [LogCallback(tmp_path)], epochs=1) as trainer:
        trainer.fit(train_dl, val_dl)
        trainer.test(val_dl)
    ea = read_run(tmp_path / "run")
    texts = text(ea, "loop/state_graph")
    assert len(texts) == 1
    assert "stateDiagram-v2" in texts[0] and "fit_running --> epoch_running" in texts[0]
    if shutil.which("dot") is not None:
        (image,) = ea.Images("loop/state_graph")
        assert image.encoded_image_string.startswith(b"\x89PNG") and image.width > 0 and image.height > 0


def test_per_batch_metrics_are_written_when_asked(tmp_path):
    """log_batch=True writes one point per training batch with a step that keeps counting across epochs."""
    train_dl, _ = loaders()  # 64 samples, batch 16: 4 batches per epoch
    losses = []

    class Record(Callback):
        def on_after_train_batch(self, trainer, metrics, batch_idx):
            losses.append(metrics["loss"])

    with make_trainer(nn.Linear(8, 2), [LogCallback(tmp_path, log_batch=True), Record()], epochs=2) as t:
        t.fit(train_dl)
    got = scalars(read_run(tmp_path / "run"), "loss/train_batch")
    assert [s for s, _ in got] == list(range(1, 9))
    assert [v for _, v in got] == pytest.approx(losses, rel=1e-6)


def test_per_batch_steps_run_on_across_the_tasks_of_a_stage(tmp_path):
    """With two training tasks (4 and 2 batches), epoch 2's first batch is step 7 and steps never repeat."""
    train_dl, _ = loaders()
    short = DataLoader(train_dl.dataset, batch_size=32)
    with make_trainer(nn.Linear(8, 2), [LogCallback(tmp_path, log_batch=True)], epochs=2) as t:
        t.fit(train_tasks=[EpochTask(train_dl), EpochTask(short)])
    got = scalars(read_run(tmp_path / "run"), "loss/train_batch")
    assert [s for s, _ in got] == list(range(1, 13))


def test_all_logging_callbacks_share_the_trainer_writer(tmp_path):
    """LogCallback, AnalyzeCallback and InterpreteCallback write one event file through one SummaryWriter."""
    train_dl, val_dl = loaders()
    seen = []

    class Probe(Callback):
        def on_after_fit(self, trainer):
            seen.append(trainer.writer())
            seen.append(trainer.writer(tmp_path))

    images = torch.rand(48, 1, 4, 4)
    labels = torch.randint(0, 2, (48,))
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 2))
    worst = InterpreteCallback(lambda p, y: F.cross_entropy(p, y, reduction="none"), k=4, image_data=True)
    callbacks = [LogCallback(tmp_path), AnalyzeCallback(), Probe(), worst]
    with make_trainer(model, callbacks, epochs=1) as trainer:
        trainer.fit(DataLoader(TensorDataset(images, labels), batch_size=16),
                    DataLoader(TensorDataset(images[:16], labels[:16]), batch_size=8))
    assert seen[0] is seen[1]
    files = sorted(os.listdir(tmp_path / "run"))  # one event file (one writer), and the run's CSV table
    assert len(files) == 2 and files[0].startswith("events.out.tfevents") and files[1] == "metrics.csv"
    tags = read_run(tmp_path / "run").Tags()
    assert "loss/train" in tags["scalars"] and "output/1/mean" in tags["scalars"]
    assert "interprete/val" in tags["images"]


def test_close_flushes_and_stops_every_writer_thread(tmp_path):
    """After close() no SummaryWriter thread is left, and a closed trainer's writer cannot be reopened."""
    train_dl, val_dl = loaders()
    before = set(threading.enumerate())
    trainer = make_trainer(nn.Linear(8, 2), [LogCallback(tmp_path), AnalyzeCallback(log_dir=tmp_path / "b")],
                           epochs=1)
    trainer.fit(train_dl, val_dl)
    assert len(writer_threads() - before) == 2, "two folders: two writers, each with its thread"
    trainer.close()
    assert set(threading.enumerate()) - before == set()
    assert scalars(read_run(tmp_path / "run"), "loss/val")
    assert "output/model/mean" in read_run(tmp_path / "b" / "run").Tags()["scalars"]
    with pytest.raises(RuntimeError, match="closed"):
        trainer.writer()


def test_trainers_never_closed_leave_no_writer_thread_once_collected(tmp_path):
    """20 trainers fitted with a LogCallback and dropped without close(): once the garbage collector frees
    them, the thread count is back where it was and their runs' events are on disk."""
    train_dl, _ = loaders()
    gc.collect()
    before = threading.active_count()
    for i in range(20):
        trainer = Trainer(nn.Linear(8, 2), F.cross_entropy, epochs=1, callbacks=[LogCallback(tmp_path)],
                          running_id=f"run{i}", log_batch=False, show_info=False)
        trainer.fit(train_dl)
    del trainer
    gc.collect()
    assert threading.active_count() == before
    assert scalars(read_run(tmp_path / "run19"), "loss/train")


def test_a_keyboard_interrupt_inside_close_still_stops_the_writer_threads(tmp_path, monkeypatch):
    """Ctrl-C while close() closes the first writer's event file: the interrupt reaches the caller, but only
    after every writer was closed (its thread joined) and the rest of the trainer released."""
    from torch.utils.tensorboard.writer import FileWriter

    train_dl, val_dl = loaders()
    before = writer_threads()
    trainer = make_trainer(nn.Linear(8, 2), [LogCallback(tmp_path), AnalyzeCallback(log_dir=tmp_path / "b")],
                           epochs=1)
    trainer.fit(train_dl, val_dl)
    close, calls = FileWriter.close, []

    def interrupted_close(self):
        calls.append(self)
        if len(calls) == 1:
            raise KeyboardInterrupt  # before the event file is closed and its thread joined
        close(self)

    monkeypatch.setattr(FileWriter, "close", interrupted_close)
    with pytest.raises(KeyboardInterrupt):
        trainer.close()
    assert len(calls) == 3, "the interrupted writer closed again, then the other one"
    assert writer_threads() - before == set()
    assert scalars(read_run(tmp_path / "run"), "loss/val")
    trainer.close()  # closed: nothing left to do


def test_an_interrupted_fit_records_where_the_loop_failed(tmp_path):
    """An exception on batch 3 writes the error, the failing state and the flight record, and close() still
    stops the writer."""

    class Boom(Callback):
        def on_after_backward(self, trainer, loss):
            if trainer.loop.batch_idx == 3:
                raise RuntimeError("boom at batch 3")

    before = writer_threads()
    train_dl, _ = loaders()
    trainer = make_trainer(nn.Linear(8, 2), [LogCallback(tmp_path), Boom()])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(train_dl)
    trainer.close()
    assert writer_threads() - before == set()
    (record,) = text(read_run(tmp_path / "run"), "loop/interrupted")
    assert "boom at batch 3" in record and "`step_backward`" in record and "stateDiagram-v2" in record


def test_only_the_main_process_writes(tmp_path):
    """On a non-main rank the trainer hands out a writer that does nothing, and no file is created."""
    train_dl, val_dl = loaders()
    trainer = make_trainer(nn.Linear(8, 2), [LogCallback(tmp_path, log_graph=True)], epochs=1,
                           hyper_params={"lr": 0.1})
    trainer._dist.is_main = False  # what a DDP rank other than 0 reports
    trainer.fit(train_dl, val_dl)
    trainer.test(val_dl)
    assert isinstance(trainer.writer(), NullWriter)
    trainer.close()
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"log_dir": 3}, "log_dir must be a folder path"),
    ({"log_graph": "yes"}, "log_graph must be True or False"),
    ({"example_input": torch.zeros(1, 8)}, "pass log_graph=True"),
    ({"log_graph": True, "example_input": {"x": torch.zeros(1)}}, "positional inputs"),
])
def test_bad_log_arguments_are_refused_with_a_clear_message(kwargs, message):
    """LogCallback validates its arguments when it is created."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        LogCallback(**kwargs)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


class _Slow(nn.Module):
    """A linear model whose forward takes 30 ms, so the console's 0.1 s refresh comes due mid-task."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 2)

    def forward(self, x):
        import time

        time.sleep(0.03)
        return self.linear(x)


def test_console_without_a_terminal_prints_clean_epoch_lines():
    """Redirected to a file, output has no carriage returns or bars, only whole lines (even with log_tqdm)."""
    train_dl, val_dl = loaders()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer = Trainer(nn.Linear(8, 2), F.cross_entropy, epochs=2, device="cpu", log_tqdm=True)
        trainer.fit(train_dl, val_dl)
        trainer.test(val_dl)
        trainer.close()
    log = out.getvalue()
    assert "\r" not in log and "\x1b" not in log
    assert re.search(r"^E 1/2  TRAIN> loss: \d\.\d{4}   VAL> loss: \d\.\d{4}$", log, re.M)
    assert re.search(r"^E 2/2  TRAIN> loss: \d\.\d{4}   VAL> loss: \d\.\d{4}$", log, re.M)
    assert re.search(r"^E 1/1  TEST>  loss: \d\.\d{4}$", log, re.M)


def test_console_in_a_terminal_shows_progress_bars_with_metrics():
    """With log_tqdm in a terminal each task draws a bar whose postfix shows the batch metrics."""
    train_dl, _ = loaders()
    out = _Terminal()
    with contextlib.redirect_stdout(out):
        with Trainer(_Slow(), F.cross_entropy, epochs=1, device="cpu", log_tqdm=True) as trainer:
            trainer.fit(train_dl)
    log = out.getvalue()
    assert "\r" in log  # bars redraw in place
    # the bar's postfix carries the metrics (tqdm may shorten the bar itself to the terminal width)
    assert re.search(r"\rE 1/1  T.*loss: \d\.\d{4}\]", log)
    # tqdm clears a finished bar with "\r<spaces>\r"; the epoch line then starts on the cleared line
    assert re.search(r"(^|\r)E 1/1  TRAIN> loss: \d\.\d{4}$", log, re.M)


@pytest.mark.parametrize("options, fused", [({}, True), ({"log_batch": True}, False),
                                            ({"log_graph": True}, False)])
def test_a_default_log_callback_leaves_training_batches_on_the_fused_edges(tmp_path, options, fused):
    """LogCallback's per-batch hooks are idle unless log_batch or log_graph asks for them, so by default
    the batches take the cheap fused edges; the epoch curves are the same either way."""
    train_dl, val_dl = loaders()
    curves = {}
    for name, opts in (("logged", options), ("reference", None)):
        torch.manual_seed(0)
        callbacks = [] if opts is None else [LogCallback(tmp_path / name, **opts)]
        with make_trainer(nn.Linear(8, 2), callbacks, epochs=2) as t:
            t.machine.history = collections.deque()
            curves[name] = t.fit(train_dl, val_dl, metrics=[accuracy])
            triggers = {r.trigger for r in t.machine.records()}
        if opts is not None:
            assert ("window_step" in triggers) == fused
            assert ("backward" in triggers) != fused  # a training batch taking every edge
    assert curves["logged"] == curves["reference"]
    assert [v for _, v in scalars(read_run(tmp_path / "logged" / "run"), "loss/train")] == pytest.approx(
        curves["reference"]["train"]["loss"])


def test_idle_hooks_must_name_hooks():
    """A callback's idle_hooks is checked when it is attached: hook names only, with the bad ones named."""
    class Quiet(Callback):
        idle_hooks = frozenset({"on_after_train_batch", "on_after_everything"})

    with pytest.raises(ConfigError, match=r"idle_hooks must be a set of hook names.*on_after_everything"):
        make_trainer(nn.Linear(8, 2), [Quiet()])
    Quiet.idle_hooks = "on_after_train_batch"
    with pytest.raises(ConfigError, match=r"idle_hooks must be a set of hook names"):
        make_trainer(nn.Linear(8, 2), [Quiet()])


def test_log_batch_switched_on_before_attaching_is_honoured(tmp_path):
    """LogCallback's idle hooks follow its settings when it is attached, not when it was built: turning
    log_batch on afterwards still writes one point per training batch."""
    train_dl, _ = loaders()  # 4 batches per epoch
    cb = LogCallback(tmp_path)
    cb.log_batch = True
    with make_trainer(nn.Linear(8, 2), [cb], epochs=2) as t:
        t.fit(train_dl)
    assert [s for s, _ in scalars(read_run(tmp_path / "run"), "loss/train_batch")] == list(range(1, 9))


def _csv_rows(path):
    import csv

    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_every_run_writes_a_csv_table_of_its_epochs_that_equals_the_returned_records(tmp_path):
    """metrics.csv beside the event files, read with the csv module: one row per epoch and stage (train,
    val, then test at the completed epochs), equal to what fit and test return; a second fit continues the
    table, and the rows of that fit equal its records too."""
    train_dl, val_dl = loaders()
    with make_trainer(nn.Linear(8, 2), [LogCallback(tmp_path)], epochs=2, metrics=[accuracy]) as trainer:
        records = trainer.fit(train_dl, val_dl)
        tested = trainer.test(val_dl)
        records = trainer.fit(train_dl, val_dl, epochs=3)
    rows = _csv_rows(tmp_path / "run" / "metrics.csv")
    assert [(r["epoch"], r["stage"]) for r in rows] == [("1", "train"), ("1", "val"), ("2", "train"), ("2", "val"),
                                                        ("2", "test"), ("3", "train"), ("3", "val")]
    assert list(rows[0]) == ["epoch", "stage", "loss", "accuracy"]
    for stage in ("train", "val"):
        for name in ("loss", "accuracy"):
            assert [float(r[name]) for r in rows if r["stage"] == stage] == records[stage][name]
    [test_row] = [r for r in rows if r["stage"] == "test"]
    assert {k: float(v) for k, v in test_row.items() if k not in ("epoch", "stage")} == tested


def test_the_csv_table_can_be_left_out_and_a_retrained_epoch_replaces_its_rows(tmp_path):
    """csv=False writes no table; a run resumed from epoch 1 after logging two epochs keeps epoch 1's rows
    and replaces epoch 2's with the retrained values."""
    train_dl, _ = loaders()
    with make_trainer(nn.Linear(8, 2), [LogCallback(tmp_path / "off", csv=False)], epochs=1) as trainer:
        trainer.fit(train_dl)
    assert not (tmp_path / "off" / "run" / "metrics.csv").exists()
    with make_trainer(nn.Linear(8, 2), [LogCallback(tmp_path)], epochs=2) as trainer:
        first = trainer.fit(train_dl)
    with make_trainer(nn.Linear(8, 2), [LogCallback(tmp_path)], epochs=2) as trainer:
        trainer.loop.completed_epochs = trainer.loop.epoch = 1  # as a resume from epoch 1's checkpoint leaves it
        again = trainer.fit(train_dl)
    rows = _csv_rows(tmp_path / "run" / "metrics.csv")
    assert [(r["epoch"], r["stage"]) for r in rows] == [("1", "train"), ("2", "train")]
    assert float(rows[0]["loss"]) == first["train"]["loss"][0]
    assert float(rows[1]["loss"]) == again["train"]["loss"][-1] != first["train"]["loss"][1]
