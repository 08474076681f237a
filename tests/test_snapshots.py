"""Mid-epoch snapshots and preemption in one process: `SnapshotCallback` writes snapshots
at commit points; a run resumed from any of them ends bit-identical to the uninterrupted run (weights,
optimizer, scheduler, and the epoch metrics, which cover the batches before the resume); a listed signal
stops the fit at the next commit point with `Preempted`. The subprocess acceptance (SIGKILL at random
moments, SIGTERM) is in tests/preemption."""

import os
import re
import shutil
import signal
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import (
    Callback,
    CheckpointError,
    ConfigError,
    Optimizer,
    PatchBase,
    Preempted,
    SnapshotCallback,
    Trainer,
)
from deepepochs.callbacks import snapshot as snapshot_module
from deepepochs.checkpoint import read_checkpoint
from deepepochs.errors import DeepEpochsWarning
from deepepochs.metrics import accuracy

needs_sigterm = pytest.mark.skipif(not hasattr(signal, "SIGTERM") or os.name == "nt", reason="POSIX signals")


def _data():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(70, 4, generator=g), torch.randint(0, 3, (70,), generator=g)
    return (DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True),
            DataLoader(TensorDataset(x[:20], y[:20]), batch_size=8))


def mean_acc(preds, targets):
    return (preds.argmax(1) == targets).float().mean()


def _trainer(folder, resume=False, callbacks=(), epochs=3, cls=Trainer, trainer_kw=None, **snap):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 5, 0.9)
    cbs = [SnapshotCallback(folder, **snap), *callbacks] if folder is not None else list(callbacks)
    trainer = cls(model, F.cross_entropy, Optimizer(opt, sched, sched_on="step"), epochs=epochs, callbacks=cbs,
                  resume=resume, running_id="run", gradient_accumulation_steps=3, log_batch=False, show_info=False,
                  **(trainer_kw or {}))
    return trainer, model


def _fit(trainer):
    train, val = _data()
    return trainer.fit(train, val, metrics=[accuracy, mean_acc])


def _state(trainer, model):
    return ({k: v.clone() for k, v in model.state_dict().items()}, trainer.opt.state_dict())


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _last(records):
    return {stage: {k: v[-1] for k, v in values.items()} for stage, values in records.items() if values}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    trainer, model = _trainer(None)
    records = _fit(trainer)
    return _state(trainer, model), records


@pytest.fixture(scope="module")
def every_update(tmp_path_factory):
    """A run writing a snapshot at every update, all kept; its files by name."""
    folder = tmp_path_factory.mktemp("snapshots")
    trainer, model = _trainer(folder, every_n_updates=1, keep=1000)
    records = _fit(trainer)
    return folder / "run", _state(trainer, model), records


def _resume_from(tmp_path, file):
    (tmp_path / "run").mkdir()
    shutil.copy(file, tmp_path / "run" / file.name)
    trainer, model = _trainer(tmp_path, resume=True, every_n_updates=1)
    torch.manual_seed(1234)  # what the new process drew before must not matter
    records = _fit(trainer)
    return _state(trainer, model), records


def test_snapshots_do_not_change_the_run(uninterrupted, every_update):
    _, state, records = every_update
    assert _equal(state, uninterrupted[0])
    assert records == uninterrupted[1]


def test_a_snapshot_at_every_update_and_epoch_end_is_written(every_update):
    folder, _, _ = every_update
    names = sorted(p.name for p in folder.iterdir())
    # 70 samples in batches of 4: 18 batches, 6 windows of k=3 per epoch; 3 epochs
    assert [n for n in names if "epoch" not in n] == [f"snapshot-u{u:09d}.ckpt" for u in range(1, 19)]
    assert [n for n in names if "epoch" in n] == [f"snapshot-u{u:09d}-epoch{u // 6}.ckpt" for u in (6, 12, 18)]
    mid = read_checkpoint(folder / "snapshot-u000000008.ckpt")  # weights_only=True reads it
    assert mid.format_version == 2 and mid.epoch == 1
    assert {k: mid.position[k] for k in ("epoch", "task_index", "batches_done", "world_size")} == {
        "epoch": 2, "task_index": 0, "batches_done": 6, "world_size": 1}
    end = read_checkpoint(folder / "snapshot-u000000012-epoch2.ckpt")
    assert end.format_version == 1 and end.epoch == 2 and end.position is None
    assert mid.monitors["snapshot"]["updates"] == 8 and mid.monitors["snapshot"]["started_ns"] > 0


@pytest.mark.parametrize("name", ["snapshot-u000000001.ckpt", "snapshot-u000000005.ckpt", "snapshot-u000000006.ckpt",
                                  "snapshot-u000000006-epoch1.ckpt", "snapshot-u000000008.ckpt",
                                  "snapshot-u000000012.ckpt", "snapshot-u000000017.ckpt"])
def test_resuming_from_a_snapshot_ends_bit_identical_with_the_same_epoch_metrics(tmp_path, uninterrupted,
                                                                                every_update, name):
    folder, _, _ = every_update
    state, records = _resume_from(tmp_path, folder / name)
    assert _equal(state, uninterrupted[0])
    # The resumed epoch's metrics cover its batches before the snapshot too (meters travel in the file).
    assert _last(records) == _last(uninterrupted[1])


def test_the_last_snapshot_of_an_epoch_keeps_the_training_metrics_for_validation_to_follow(tmp_path, uninterrupted,
                                                                                          every_update):
    folder, _, _ = every_update  # u6: after the epoch's last window, before its validation and end
    _, records = _resume_from(tmp_path, folder / "snapshot-u000000006.ckpt")
    assert records["train"]["loss"] == uninterrupted[1]["train"]["loss"]
    assert records["val"]["accuracy"] == uninterrupted[1]["val"]["accuracy"]


class SendAt(Callback):
    """Sends `sig` to this process after training batch `batch` (0-based) of epoch `epoch`, or during the
    validation of that epoch with `batch=None`."""

    def __init__(self, sig, epoch, batch):
        self.sig, self.epoch, self.batch = sig, epoch, batch

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if self.batch is not None and trainer.loop.epoch == self.epoch and batch_idx == self.batch:
            os.kill(os.getpid(), self.sig)

    def on_after_val_batch(self, trainer, metrics, batch_idx):
        if self.batch is None and trainer.loop.epoch == self.epoch and batch_idx == 0:
            os.kill(os.getpid(), self.sig)


@needs_sigterm
def test_sigterm_inside_a_window_fetches_no_more_of_it_and_stops_at_the_last_commit_point(tmp_path, uninterrupted):
    """The rest of the open window is not fetched (a scheduler's signal kills DataLoader workers too): the
    window is dropped, the snapshot is the last commit point's, and the resume is exact."""
    before = signal.getsignal(signal.SIGTERM)
    trainer, _ = _trainer(tmp_path, callbacks=[SendAt(signal.SIGTERM, 2, 7)])  # batch 8 of 18: window 3 is 7-9
    with pytest.raises(Preempted) as info:
        _fit(trainer)
    stop = info.value
    assert isinstance(stop, SystemExit) and stop.code == 143 and stop.signal_name == "SIGTERM"
    assert stop.path == tmp_path / "run" / "snapshot-u000000008.ckpt" and stop.path.is_file()  # 6 + 2 updates
    assert read_checkpoint(stop.path).position["batches_done"] == 6
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is given back
    records = [(r.source, r.trigger, r.dest) for r in stop.deepepochs_flight_record]
    assert records[-3:] == [("window_open", "snapshot", "preempted"), ("preempted", "interrupt", "rollback"),
                            ("rollback", "recover", "idle")]
    resumed, model = _trainer(tmp_path, resume=True, every_n_updates=None)
    records = _fit(resumed)
    assert _equal(_state(resumed, model), uninterrupted[0])
    assert _last(records) == _last(uninterrupted[1])


class HostDrawn(torch.utils.data.Dataset):
    """`_data()`'s training samples plus noise from NumPy's and Python's generators, drawn when loaded (in
    this process: no workers)."""

    def __init__(self):
        self.x, self.y = _data()[0].dataset.tensors

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        import random

        import numpy as np
        return self.x[i] + 0.1 * float(np.random.rand()) - 0.1 * random.random(), self.y[i]


def _fit_host_drawn(trainer, host_seed):
    import random

    import numpy as np
    np.random.seed(host_seed)
    random.seed(host_seed)
    return trainer.fit(DataLoader(HostDrawn(), batch_size=4, shuffle=True), _data()[1])


@needs_sigterm
@pytest.mark.parametrize("batch", [7, 8], ids=["inside_a_window", "at_its_end"])
def test_a_sigterm_resume_continues_numpys_and_pythons_draws_of_the_samples_as_of_the_commit_point(tmp_path, batch):
    """Samples drawing NumPy and Python noise as they load, windows of 3: a SIGTERM inside a window (its
    fetches had moved both generators on) or at its end, then a resume in a process whose generators were
    seeded otherwise, ends bit-identical to the uninterrupted run (before, the stop inside a window stored the
    generators past the dropped micro-batches, and the resumed run loaded them with other noise)."""
    trainer, model = _trainer(None)
    _fit_host_drawn(trainer, 3)
    want = _state(trainer, model)
    trainer, _ = _trainer(tmp_path, callbacks=[SendAt(signal.SIGTERM, 2, batch)])
    with pytest.raises(Preempted):
        _fit_host_drawn(trainer, 3)
    resumed, model = _trainer(tmp_path, resume=True, every_n_updates=None)
    _fit_host_drawn(resumed, 77)
    assert _equal(_state(resumed, model), want)


@needs_sigterm
def test_sigterm_at_a_windows_end_stops_at_that_commit_point(tmp_path, uninterrupted):
    """A signal after a window's last batch: that window commits, and the fit stops there."""
    trainer, _ = _trainer(tmp_path, callbacks=[SendAt(signal.SIGTERM, 2, 8)])  # batch 9 closes window 3
    with pytest.raises(Preempted) as info:
        _fit(trainer)
    assert read_checkpoint(info.value.path).position["batches_done"] == 9
    resumed, model = _trainer(tmp_path, resume=True, every_n_updates=None)
    _fit(resumed)
    assert _equal(_state(resumed, model), uninterrupted[0])


@needs_sigterm
def test_a_signal_during_validation_stops_at_the_epochs_end(tmp_path, uninterrupted):
    trainer, _ = _trainer(tmp_path, callbacks=[SendAt(signal.SIGUSR1, 1, None)], exit_code=75)
    with pytest.raises(Preempted) as info:
        _fit(trainer)
    assert info.value.code == 75 and info.value.signal_name == "SIGUSR1"
    assert info.value.path.name == "snapshot-u000000006-epoch1.ckpt"
    assert trainer.loop.completed_epochs == 1
    assert [(r.source, r.dest) for r in info.value.deepepochs_flight_record if r.trigger == "snapshot"][-1] == (
        "fit_running", "preempted")
    resumed, model = _trainer(tmp_path, resume=True, every_n_updates=None)
    _fit(resumed)
    assert _equal(_state(resumed, model), uninterrupted[0])


@needs_sigterm
def test_the_same_trainer_continues_after_preempted_is_caught(tmp_path, uninterrupted):
    trainer, model = _trainer(tmp_path, callbacks=[SendAt(signal.SIGTERM, 1, 3)])
    with pytest.raises(Preempted):
        _fit(trainer)
    trainer.callbacks[1].epoch = 0  # no second signal
    _fit(trainer)
    assert _equal(_state(trainer, model), uninterrupted[0])


def test_keep_prunes_old_snapshots_and_every_n_updates_counts_windows(tmp_path):
    trainer, _ = _trainer(tmp_path, every_n_updates=4, keep=2)
    _fit(trainer)
    # windows 4, 8, 12, 16 mid-epoch (plus the epoch ends 6, 12, 18): the newest two remain
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "snapshot-u000000016.ckpt", "snapshot-u000000018-epoch3.ckpt"]


def test_every_n_minutes_writes_at_the_first_commit_point_after_the_interval(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(snapshot_module.time, "monotonic", lambda: clock[0])

    class Tick(Callback):
        def on_after_train_batch(self, trainer, metrics, batch_idx):
            clock[0] += 25  # seconds per batch: a minute passes every 2.4 batches

    trainer, _ = _trainer(tmp_path, callbacks=[Tick()], epochs=1, every_n_minutes=1, keep=100)
    _fit(trainer)
    # commit points at batches 3, 6, ...: 75 s at the first, then 75 s between each
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == sorted(
        [f"snapshot-u{u:09d}.ckpt" for u in range(1, 7)] + ["snapshot-u000000006-epoch1.ckpt"])


def test_without_a_snapshot_callback_no_snapshot_trigger_fires():
    trainer, _ = _trainer(None, epochs=1)
    _fit(trainer)
    assert "snapshot" not in {r.trigger for r in trainer.machine.records()}


def test_the_state_graph_shows_the_snapshot_edges():
    trainer, _ = _trainer(None)
    lines = {line.strip() for line in trainer.state_graph("mermaid", level="full").splitlines()}
    for state in ("task_train", "fit_running"):  # one line per trigger and ends, its guard alternatives joined
        assert f"{state} --> {state} : snapshot [!snapshot_due] or [snapshot_due, !stop_signalled]" in lines
        assert f"{state} --> preempted : snapshot [snapshot_due, stop_signalled]" in lines


class CustomPatch(PatchBase):
    """A user patch whose state is a tensor: stored like the library's own."""

    def __init__(self, preds=None, targets=None):
        super().__init__()
        self.total = torch.zeros(()) if preds is None else (preds.argmax(1) == targets).sum().float()

    def add(self, other):
        self.total = self.total + other.total
        return self

    def forward(self):
        return self.total


class UnstorablePatch(CustomPatch):
    """Holds a function besides its metric: a snapshot cannot store it."""

    def __init__(self, preds=None, targets=None):
        super().__init__(preds, targets)
        self.reduce = torch.sum


class PatchTrainer(Trainer):
    """A custom step that reports its own patches."""

    def train_step(self, batch_x, batch_y, **step_args):
        out = self.model(batch_x)
        self.loss(out, batch_y)
        return {"correct": CustomPatch(out, batch_y), "odd": UnstorablePatch(out, batch_y)}


def test_patches_of_any_class_travel_and_an_unstorable_one_warns(tmp_path):
    def run(folder, resume):
        trainer, _ = _trainer(folder, resume=resume, epochs=1, cls=PatchTrainer, every_n_updates=1, keep=100)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            records = trainer.fit(_data()[0])
        return records, [str(w.message) for w in caught if issubclass(w.category, DeepEpochsWarning)]

    records, caught = run(tmp_path / "a", False)
    assert any("cannot store the partial epoch state of metric 'odd'" in m for m in caught)
    assert not any("'correct'" in m for m in caught)
    (tmp_path / "b" / "run").mkdir(parents=True)
    shutil.copy(tmp_path / "a" / "run" / "snapshot-u000000004.ckpt", tmp_path / "b" / "run")
    resumed, _ = run(tmp_path / "b", True)
    assert resumed["train"]["correct"] == records["train"]["correct"]  # the stored patch continues
    assert resumed["train"]["odd"] < records["train"]["odd"]  # only the batches after the snapshot


def test_a_snapshot_of_another_world_size_without_a_batch_size_is_refused_naming_the_file(tmp_path, every_update):
    folder, _, _ = every_update
    data = torch.load(folder / "snapshot-u000000008.ckpt", weights_only=True)
    assert data["position"]["samples_done"] == 6 * 4 and data["position"]["batch_size"] == 4
    data["position"]["world_size"] = 2
    data["position"]["samples_done"] = None  # as for training data without a batch size
    torch.save(data, tmp_path / "w2.ckpt")
    trainer, _ = _trainer(None)
    with pytest.raises(CheckpointError, match=r"w2.ckpt is a mid-epoch snapshot of 2 process\(es\) whose training"
                                              r" data has no batch size"):
        trainer.load_checkpoint(tmp_path / "w2.ckpt")
    (tmp_path / "run").mkdir()
    shutil.copy(tmp_path / "w2.ckpt", tmp_path / "run" / "w2.ckpt")
    resumed, _ = _trainer(tmp_path, resume=True, every_n_updates=1)
    train, _ = _data()
    with pytest.warns(DeepEpochsWarning, match="resume=True skipped .*w2.ckpt"):
        resumed.fit(train, epochs=1)


def test_an_older_deepepochs_version_number_is_written_only_for_epoch_ends(every_update):
    folder, _, _ = every_update
    versions = {p.name: torch.load(p, weights_only=True)["format_version"] for p in folder.iterdir()}
    assert {v for n, v in versions.items() if "epoch" in n} == {1}
    assert {v for n, v in versions.items() if "epoch" not in n} == {2}


@pytest.mark.parametrize("kwargs, message", [
    ({"every_n_updates": 0}, "every_n_updates must be None or an int >= 1 (got 0)"),
    ({"every_n_updates": 2.5}, "every_n_updates must be None or an int >= 1 (got 2.5)"),
    ({"every_n_minutes": -1}, "every_n_minutes must be None or a positive number (got -1)"),
    ({"keep": 0}, "keep must be an int >= 1 (got 0)"),
    ({"exit_code": 300}, "exit_code must be None or an int in 0..255 (got 300)"),
    ({"on_signals": ["SIGINT"]}, "cannot hold SIGINT: Ctrl-C already rolls the fit back"),
    ({"on_signals": "SIGKILL"}, "cannot hold SIGKILL: it cannot be caught"),
    ({"on_signals": ["SIGNOPE"]}, "'SIGNOPE' is not a signal of this platform; accepted: .*SIGTERM"),
    *(({"on_signals": (name,)}, f"cannot hold {name}: it is sent for a fault of the process itself.*accepted: .*"
       "SIGTERM") for name in ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT") if hasattr(signal, name)),
    *(({"on_signals": ("SIGCHLD",)}, "cannot hold SIGCHLD: it is a child process's exit.*accepted: .*SIGUSR1"),)
    * hasattr(signal, "SIGCHLD"),
])
def test_bad_arguments_name_the_argument_the_accepted_values_and_what_was_given(kwargs, message):
    with pytest.raises(ConfigError, match=message if "accepted: ." in message else re.escape(message)):
        SnapshotCallback(**kwargs)


def test_two_snapshot_callbacks_are_refused():
    with pytest.raises(ConfigError, match="one SnapshotCallback"):
        _trainer("unused", callbacks=[SnapshotCallback()], every_n_updates=1)


def test_signals_are_taken_only_during_fit_and_given_back_after_a_failure(tmp_path):
    before = signal.getsignal(signal.SIGTERM)

    class Fail(Callback):
        def on_after_train_batch(self, trainer, metrics, batch_idx):
            assert signal.getsignal(signal.SIGTERM) != before  # armed during the fit
            raise RuntimeError("boom")

    trainer, _ = _trainer(tmp_path, callbacks=[Fail()])
    with pytest.raises(RuntimeError, match="boom"):
        _fit(trainer)
    assert signal.getsignal(signal.SIGTERM) == before


def test_with_signals_only_snapshots_are_written_at_epoch_ends_only(tmp_path):
    trainer, _ = _trainer(tmp_path, on_signals=("SIGTERM",), every_n_updates=None)
    _fit(trainer)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [
        "snapshot-u000000012-epoch2.ckpt", "snapshot-u000000018-epoch3.ckpt"]


def test_mean_patches_resume_too(tmp_path):
    kw = {"metric_patch": "mean"}
    trainer, _ = _trainer(tmp_path / "a", epochs=1, trainer_kw=kw, every_n_updates=1, keep=100)
    full = trainer.fit(_data()[0], metrics=[accuracy, mean_acc])
    (tmp_path / "b" / "run").mkdir(parents=True)
    shutil.copy(tmp_path / "a" / "run" / "snapshot-u000000003.ckpt", tmp_path / "b" / "run")
    resumed, _ = _trainer(tmp_path / "b", resume=True, epochs=1, trainer_kw=kw, every_n_updates=1)
    assert resumed.fit(_data()[0], metrics=[accuracy, mean_acc]) == full


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_two_training_tasks_resume_from_snapshots_in_either_task_bit_identical(tmp_path, precision):
    """Snapshots inside the first and the second training task of an epoch (the first's meters complete,
    the second's partial), fp16 included (the GradScaler's state travels)."""
    from deepepochs import EpochTask

    def tasks():
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(40, 4, generator=g), torch.randint(0, 3, (40,), generator=g)
        return [EpochTask(DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)),
                EpochTask(DataLoader(TensorDataset(x[:30], y[:30]), batch_size=5, shuffle=True), metrics=[mean_acc])]

    def run(folder, resume):
        trainer, model = _trainer(folder, resume=resume, epochs=2, trainer_kw={"precision": precision},
                                  every_n_updates=1, keep=1000)
        records = trainer.fit(train_tasks=tasks(), metrics=[accuracy])
        return _state(trainer, model), records

    state, records = run(tmp_path / "a", False)
    saved = tmp_path / "a" / "run"
    assert [read_checkpoint(saved / f"snapshot-u{u:09d}.ckpt").position["task_index"] for u in (2, 5, 11)] == [0, 1, 1]
    # 10 + 6 batches per epoch in windows of 3: 4 + 2 updates; u5 is inside task 2 of epoch 1, u11 of epoch 2
    for name in ("snapshot-u000000002.ckpt", "snapshot-u000000005.ckpt", "snapshot-u000000011.ckpt"):
        folder = tmp_path / name
        (folder / "run").mkdir(parents=True)
        shutil.copy(tmp_path / "a" / "run" / name, folder / "run")
        got, got_records = run(folder, True)
        assert _equal(got, state), name
        assert _last(got_records) == _last(records), name


class AugmentedStream(torch.utils.data.IterableDataset):
    """70 samples of unknown length, with torch noise added as each is read (in the main process)."""

    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(70, 4, generator=g), torch.randint(0, 3, (70,), generator=g)

    def __iter__(self):
        for x, y in zip(self.x, self.y):
            yield x + 0.1 * torch.randn(4), y


def _stateful_loader(length_less=False):
    """torchdata's StatefulDataLoader over 70 samples: shuffled by itself, or (`length_less`) streamed from
    an AugmentedStream, which with accumulation is read ahead to find its last batch."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(70, 4, generator=g), torch.randint(0, 3, (70,), generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torchdata 0.11 calls a deprecated torch function
        if length_less:
            return stateful.StatefulDataLoader(AugmentedStream(), batch_size=4)
        return stateful.StatefulDataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)


class FailOnce(Callback):
    """Raises once, after training batch `batch` (0-based) of epoch `epoch`: inside a window (k=3)."""

    def __init__(self, epoch, batch):
        self.at = (epoch, batch)

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        if (trainer.loop.epoch, batch_idx) == self.at:
            self.at = None
            raise RuntimeError("injected")


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("length_less", [False, True])
def test_a_stateful_dataloader_continues_from_its_own_state_after_a_fault_and_from_a_snapshot(tmp_path,
                                                                                              length_less):
    """torchdata's StatefulDataLoader (its own shuffling, not deepepochs'): its position is kept at every
    commit point (`state_dict()`), so a refit after a fault and a resume from a snapshot continue its
    order exactly, without the unknown-order warning. Of unknown length (read ahead to find the last batch,
    k=3), no batch of the next window is read before a commit point: its position and the augmentation's
    draws are the window's (before, a refit skipped the batch read ahead)."""
    trainer, model = _trainer(None)
    trainer.fit(_stateful_loader(length_less))
    want = _state(trainer, model)

    trainer, model = _trainer(tmp_path / "a", callbacks=[FailOnce(2, 7)], every_n_updates=1, keep=100)
    loader = _stateful_loader(length_less)
    with pytest.raises(RuntimeError, match="injected"):
        trainer.fit(loader)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeepEpochsWarning)
        trainer.fit(loader)  # the refit
    assert _equal(_state(trainer, model), want)

    name = "snapshot-u000000008.ckpt"  # epoch 2, after batch 12 of 18
    assert read_checkpoint(tmp_path / "a" / "run" / name).position["ranks"][0]["data"] is not None
    (tmp_path / "b" / "run").mkdir(parents=True)
    shutil.copy(tmp_path / "a" / "run" / name, tmp_path / "b" / "run")
    resumed, model = _trainer(tmp_path / "b", resume=True, every_n_updates=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeepEpochsWarning)
        resumed.fit(_stateful_loader(length_less))
    assert _equal(_state(resumed, model), want)


class Augmented(torch.utils.data.Dataset):
    """Adds torch noise to each sample as it is loaded (augmentation in the main process)."""

    def __init__(self):
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(70, 4, generator=g), torch.randint(0, 3, (70,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(4), self.y[i]


def test_augmentation_in_the_main_process_resumes_exactly_with_accumulation(tmp_path):
    """k=3: no batch is read ahead of the window's last step, so a resumed run draws the augmentation's
    numbers at the same points of torch's stream (before, the look-ahead batch drew them earlier)."""
    trainer, model = _trainer(tmp_path / "a", every_n_updates=1, keep=100)
    trainer.fit(DataLoader(Augmented(), batch_size=4, shuffle=True))
    want = _state(trainer, model)
    for name in ("snapshot-u000000002.ckpt", "snapshot-u000000010.ckpt"):
        (tmp_path / name / "run").mkdir(parents=True)
        shutil.copy(tmp_path / "a" / "run" / name, tmp_path / name / "run")
        resumed, model = _trainer(tmp_path / name, resume=True, every_n_updates=1)
        resumed.fit(DataLoader(Augmented(), batch_size=4, shuffle=True))
        assert _equal(_state(resumed, model), want), name


@pytest.mark.filterwarnings("ignore:resuming inside an epoch:deepepochs.errors.DeepEpochsWarning")
@pytest.mark.parametrize("fault", [(1, 4), (2, 2), (2, 9), (2, 16)])
def test_an_augmented_stream_continues_exactly_after_a_fault_and_from_a_snapshot(tmp_path, fault):
    """A plain DataLoader over an IterableDataset of fixed order whose samples get torch noise as they are
    read (main process), k=3, dropout: a refit (or a resume) iterates past the committed batches, and their
    noise is drawn before the commit point's generator state comes back (before, those draws moved the
    generators after it). Weights, Adam and the scheduler equal the uninterrupted run's."""
    def loader():
        return DataLoader(AugmentedStream(), batch_size=4)

    trainer, model = _trainer(tmp_path / "a", every_n_updates=1, keep=100)
    trainer.fit(loader())
    want = _state(trainer, model)
    trainer, model = _trainer(None, callbacks=[FailOnce(*fault)])
    with pytest.raises(RuntimeError, match="injected"):
        trainer.fit(loader())
    trainer.fit(loader())
    assert _equal(_state(trainer, model), want)
    if fault == (2, 9):  # a resume from a snapshot too: update 9 of 18, epoch 2 after its 9th batch
        name = "snapshot-u000000009.ckpt"
        (tmp_path / "b" / "run").mkdir(parents=True)
        shutil.copy(tmp_path / "a" / "run" / name, tmp_path / "b" / "run")
        resumed, model = _trainer(tmp_path / "b", resume=True, every_n_updates=1)
        resumed.fit(loader())
        assert _equal(_state(resumed, model), want)


class HostRandom(Callback):
    """Draws from Python's and NumPy's generators at every training batch and records the draws."""

    def __init__(self):
        self.draws = []

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        import random

        import numpy as np
        self.draws.append((trainer.loop.epoch, batch_idx, random.random(), float(np.random.rand())))


def test_a_snapshot_resume_continues_pythons_and_numpys_generators(tmp_path):
    first = HostRandom()
    trainer, _ = _trainer(tmp_path / "a", callbacks=[first], every_n_updates=1, keep=100)
    trainer.fit(_data()[0])
    (tmp_path / "b" / "run").mkdir(parents=True)
    shutil.copy(tmp_path / "a" / "run" / "snapshot-u000000008.ckpt", tmp_path / "b" / "run")
    second = HostRandom()
    resumed, _ = _trainer(tmp_path / "b", resume=True, callbacks=[second], every_n_updates=1)
    import random
    random.seed(99)  # what this process drew before must not matter
    resumed.fit(_data()[0])
    assert second.draws == first.draws[len(first.draws) - len(second.draws):]
    assert second.draws[0][:2] == (2, 6)  # epoch 2, its 7th batch: right after the snapshot


class FailingStepLR(torch.optim.lr_scheduler.StepLR):
    """StepLR raising once on its `fail_at`-th step: after the optimizer applied the update, before the
    update's commit point completed (the update stays applied; its window must not be replayed)."""

    def __init__(self, opt, fail_at):
        self.fail_at, self.steps = fail_at, 0
        super().__init__(opt, 5, 0.9)

    def step(self, *args, **kwargs):
        super().step(*args, **kwargs)
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("scheduler fault")


def _plain_loader():
    return _data()[0]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("make_loader", [_plain_loader, _stateful_loader], ids=["plain", "stateful"])
def test_a_refit_after_a_fault_between_an_update_and_its_commit_is_exact(make_loader):
    """The update was applied (its scheduler stepped, then raised): the refit keeps it, does not replay its
    window, and continues with the generators and the loader's position as they were after it (dropout)."""

    def run(fail_at):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 3))
        opt = torch.optim.Adam(model.parameters(), 1e-2)
        sched = FailingStepLR(opt, fail_at)
        trainer = Trainer(model, F.cross_entropy, Optimizer(opt, sched, sched_on="step"), epochs=2,
                          gradient_accumulation_steps=3, log_batch=False, show_info=False)
        loader = make_loader()
        if fail_at:
            with pytest.raises(RuntimeError, match="scheduler fault"):
                trainer.fit(loader)
            trainer.fit(loader)
        else:
            trainer.fit(loader)
        return {k: v.clone() for k, v in model.state_dict().items()}, opt.state_dict()

    want = run(None)
    for fail_at in (3, 8):  # epoch 1's third update; epoch 2's second
        assert _equal(run(fail_at), want), fail_at


@pytest.mark.parametrize("name", ["SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGCHLD"])
def test_the_accepted_signals_listed_in_the_refusal_hold_none_a_fault_or_a_child_sends(name):
    if not hasattr(signal, name):
        pytest.skip(f"{name} does not exist on this platform")
    with pytest.raises(ConfigError) as info:
        SnapshotCallback(on_signals=[name])
    accepted = str(info.value).split("accepted: ")[1].split(", ")
    assert "SIGTERM" in accepted and not {"SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGCHLD"} & set(accepted)


# ---- a signal after the fit's last commit point is never dropped ---------------------------------------------
class SendLate(Callback):
    """Sends SIGTERM to this process once, at `moment` of the last epoch (3 of 3)."""

    def __init__(self, moment):
        super().__init__()
        self.moment = moment

    def _send(self, moment, trainer):
        if self.moment == moment and trainer.loop.epoch == 3:
            self.moment = None
            os.kill(os.getpid(), signal.SIGTERM)

    def on_after_val_batch(self, trainer, metrics, batch_idx):
        self._send("last validation", trainer)

    def on_after_epoch(self, trainer, *args):
        self._send("last on_after_epoch", trainer)

    def on_after_fit(self, trainer):
        self._send("on_after_fit", trainer)


@needs_sigterm
@pytest.mark.parametrize("moment", ["last validation", "last on_after_epoch", "last snapshot write", "on_after_fit"])
def test_a_sigterm_after_the_last_commit_point_still_ends_the_fit_with_preempted(tmp_path, uninterrupted,
                                                                                   monkeypatch, moment):
    """Whenever SIGTERM arrives in the last epoch after its training (validation, on_after_epoch, while the
    epoch-end snapshot is written, on_after_fit): fit raises Preempted, the handler is given back, and the
    last snapshot holds the whole run (a resume trains nothing and has the uninterrupted weights)."""
    before = signal.getsignal(signal.SIGTERM)
    write = SnapshotCallback.write_snapshot

    def write_and_signal(self, trainer, position):
        path = write(self, trainer, position)
        if moment == "last snapshot write" and position is None and trainer.loop.completed_epochs == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the write is done: the decision at this point was taken
        return path

    monkeypatch.setattr(SnapshotCallback, "write_snapshot", write_and_signal)
    trainer, model = _trainer(tmp_path, callbacks=[SendLate(moment)], on_signals=("SIGTERM",))
    with pytest.raises(Preempted) as info:
        _fit(trainer)
    stop = info.value
    assert stop.code == 143 and stop.signal_name == "SIGTERM"
    assert stop.path == tmp_path / "run" / "snapshot-u000000018-epoch3.ckpt"
    assert signal.getsignal(signal.SIGTERM) == before
    assert _equal(_state(trainer, model), uninterrupted[0])
    saved = read_checkpoint(stop.path)
    assert saved.epoch == 3 and saved.position is None
    assert all(_equal(saved.model[k], v) for k, v in uninterrupted[0][0].items())


@needs_sigterm
def test_a_sigterm_between_disarming_and_returning_goes_to_the_previous_handler(tmp_path, monkeypatch):
    """Once fit has given the handler back, a signal is the previous handler's: it is called, not dropped."""
    received = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    disarm = SnapshotCallback._disarm

    def disarm_then_signal(self):
        disarm(self)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(SnapshotCallback, "_disarm", disarm_then_signal)
    try:
        trainer, _ = _trainer(tmp_path, on_signals=("SIGTERM",), epochs=1)
        _fit(trainer)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert received == [signal.SIGTERM]


def test_a_ctrl_c_held_inside_an_update_keeps_the_snapshot_update_count_and_cadence(tmp_path, uninterrupted):
    """SIGINT inside the 5th optimizer.step() is held until the update completes, then raised; after the
    refit the snapshot files (named by the update count, every 2 updates) and the stored count are the
    uninterrupted run's, and so are the weights."""
    reference, _ = _trainer(tmp_path / "reference", every_n_updates=2, keep=1000)
    _fit(reference)
    trainer, model = _trainer(tmp_path / "interrupted", every_n_updates=2, keep=1000)
    steps = []

    def sigint_in_fifth_step(optimizer, args, kwargs):
        steps.append(1)
        if len(steps) == 5:
            os.kill(os.getpid(), signal.SIGINT)  # inside step(): held until the update is complete

    trainer.opt.items[0].opt.register_step_pre_hook(sigint_in_fifth_step)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            _fit(trainer)
        _fit(trainer)
    finally:
        signal.signal(signal.SIGINT, previous)
    names = sorted(p.name for p in (tmp_path / "interrupted" / "run").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "reference" / "run").iterdir())
    assert "snapshot-u000000006-epoch1.ckpt" in names and "snapshot-u000000018-epoch3.ckpt" in names
    assert read_checkpoint(tmp_path / "interrupted" / "run" / names[-1]).monitors["snapshot"]["updates"] == 18
    assert _equal(_state(trainer, model), uninterrupted[0])


# ---- a snapshot position that does not fit the data ------------------------------------------------------------
def _crafted(every_update, tmp_path, name="snapshot-u000000004.ckpt", **position):
    """A copy of a real mid-epoch snapshot (4 windows of 3 batches into epoch 1) in `tmp_path/run`, with
    its position's entries replaced by `position`."""
    data = torch.load(every_update[0] / name, weights_only=True)
    data["position"] = {**data["position"], **position}
    pos = data["position"]  # the samples done follow the batches done, as in a file the library wrote
    pos["samples_done"] = pos["batches_done"] * pos["batch_size"] * pos["world_size"]
    (tmp_path / "run").mkdir(exist_ok=True)
    torch.save(data, tmp_path / "run" / name)
    return tmp_path / "run" / name


@pytest.mark.parametrize("batches_done", [10**6, -3])
def test_resume_true_skips_a_snapshot_whose_position_lies_outside_the_data_and_starts_fresh(
        tmp_path, every_update, uninterrupted, batches_done):
    """batches_done past the data (18 batches an epoch) or negative: a warning naming the file, then a fresh
    run equal to the uninterrupted one (nothing of the epoch is silently skipped)."""
    path = _crafted(every_update, tmp_path, batches_done=batches_done)
    trainer, model = _trainer(tmp_path, resume=True)
    with pytest.warns(DeepEpochsWarning, match=rf"skipped {re.escape(str(path))}: .*(after 1000000 batches of"
                                               r" training task 0, which has 18 batches here|batches_done=-3)"):
        _fit(trainer)
    assert _equal(_state(trainer, model), uninterrupted[0])


def test_resume_true_skips_a_mid_epoch_snapshot_of_a_larger_dataset_for_an_older_checkpoint(tmp_path, every_update):
    """The snapshot is 5 windows (15 batches) into epoch 2; the data now has 10 batches an epoch: the
    snapshot is skipped with a warning and the epoch-1 snapshot loads (training starts at epoch 2)."""
    shutil.copy(every_update[0] / "snapshot-u000000006-epoch1.ckpt", tmp_path / "run.tmp")
    (tmp_path / "run").mkdir()
    shutil.move(tmp_path / "run.tmp", tmp_path / "run" / "snapshot-u000000006-epoch1.ckpt")
    path = _crafted(every_update, tmp_path, name="snapshot-u000000011.ckpt")
    assert read_checkpoint(path).position["batches_done"] == 15
    os.utime(tmp_path / "run" / "snapshot-u000000006-epoch1.ckpt", ns=(10**18, 10**18))
    epoch1 = read_checkpoint(tmp_path / "run" / "snapshot-u000000006-epoch1.ckpt").history["train"]["loss"]
    trainer, _ = _trainer(tmp_path, resume=True)
    train, val = _data()
    smaller = DataLoader(torch.utils.data.Subset(train.dataset, range(40)), batch_size=4, shuffle=True)
    with pytest.warns(DeepEpochsWarning, match=r"after 15 batches of training task 0, which has 10 batches here"):
        records = trainer.fit(smaller, val)
    # the whole run's records: epoch 1's from the epoch-1 snapshot that loaded, then epochs 2 and 3 trained
    assert trainer.loop.completed_epochs == 3 and len(records["train"]["loss"]) == 3
    assert records["train"]["loss"][:1] == list(epoch1)


def test_an_explicitly_loaded_snapshot_whose_position_lies_outside_the_data_is_an_error(tmp_path, every_update):
    """load_checkpoint: a negative position is refused at once; one past the data when fit meets the data."""
    trainer, _ = _trainer(None)
    with pytest.raises(CheckpointError, match=r"position is damaged \(batches_done=-3"):
        trainer.load_checkpoint(_crafted(every_update, tmp_path, batches_done=-3))
    trainer.load_checkpoint(_crafted(every_update, tmp_path, batches_done=10**6))
    with pytest.raises(CheckpointError, match="after 1000000 batches of training task 0, which has 18 batches here"):
        _fit(trainer)


def _renamed(value, old_names: dict):
    """`value` (a snapshot's nest of dicts, lists, strings) with every string in `old_names` replaced."""
    if isinstance(value, str):
        return old_names.get(value, value)
    if isinstance(value, dict):
        return {key: _renamed(item, old_names) for key, item in value.items()}
    if isinstance(value, list):
        return [_renamed(item, old_names) for item in value]
    return value


def test_a_snapshot_naming_its_patches_by_their_public_module_resumes_bit_identical(tmp_path, uninterrupted,
                                                                                    every_update):
    """Snapshots written before `deepepochs.patches` became a package name a patch class and its state record
    `deepepochs.patches:TensorPatch`, `deepepochs.patches:TensorState`: such a file still resumes exactly."""
    from deepepochs.patches import MeanPatch, MeanState, TensorPatch, TensorState, ValuePatch

    data = torch.load(every_update[0] / "snapshot-u000000008.ckpt", weights_only=True)
    old_names = {f"{cls.__module__}:{cls.__qualname__}": f"deepepochs.patches:{cls.__qualname__}"
                 for cls in (TensorPatch, MeanPatch, ValuePatch, TensorState, MeanState)}
    renamed = _renamed(data, old_names)
    assert str(renamed) != str(data) and "deepepochs.patches:TensorPatch" in str(renamed)
    (tmp_path / "old").mkdir()
    torch.save(renamed, tmp_path / "old" / "snapshot-u000000008.ckpt")
    state, records = _resume_from(tmp_path, tmp_path / "old" / "snapshot-u000000008.ckpt")
    assert _equal(state, uninterrupted[0])
    assert _last(records) == _last(uninterrupted[1])


def test_a_snapshot_naming_confusion_patches_by_their_module_before_the_layout_move_resumes_the_same(tmp_path):
    """Snapshots written before the package layout moved `ConfusionPatch` into `deepepochs.patches` name it
    and its state record `deepepochs.confusion:...`: such a file resumes to the same metrics as the file
    as written."""
    from deepepochs.patches.confusion import ConfusionPatch, ConfusionState

    kw = {"metric_patch": "confusion"}
    trainer, _ = _trainer(tmp_path / "a", epochs=1, trainer_kw=kw, every_n_updates=1, keep=100)
    trainer.fit(_data()[0], metrics=[accuracy])
    data = torch.load(tmp_path / "a" / "run" / "snapshot-u000000003.ckpt", weights_only=True)
    old_names = {f"{cls.__module__}:{cls.__qualname__}": f"deepepochs.confusion:{cls.__qualname__}"
                 for cls in (ConfusionPatch, ConfusionState)}
    renamed = _renamed(data, old_names)
    assert "deepepochs.confusion:ConfusionPatch" in str(renamed)
    assert "deepepochs.confusion:ConfusionState" in str(renamed)
    results = []
    for name, content in (("new", data), ("old", renamed)):
        (tmp_path / name / "run").mkdir(parents=True)
        torch.save(content, tmp_path / name / "run" / "snapshot-u000000003.ckpt")
        resumed, model = _trainer(tmp_path / name, resume=True, epochs=1, trainer_kw=kw, every_n_updates=1)
        results.append((resumed.fit(_data()[0], metrics=[accuracy]), _state(resumed, model)))
    assert results[1][0] == results[0][0]
    assert _equal(results[1][1], results[0][1])


def test_every_n_updates_writes_at_multiples_of_the_runs_count_across_epoch_ends_and_resumes(tmp_path):
    """Epochs of 6 windows and every_n_updates=8: snapshots at updates 8 and 16 besides the epoch ends
    (6, 12, 18), also when the run stops after epoch 2 and a new trainer resumes it (its count goes on from
    12: 16 is written, not 20)."""
    trainer, _ = _trainer(tmp_path / "whole", every_n_updates=8, keep=100)
    _fit(trainer)
    expected = ["snapshot-u000000006-epoch1.ckpt", "snapshot-u000000008.ckpt", "snapshot-u000000012-epoch2.ckpt",
                "snapshot-u000000016.ckpt", "snapshot-u000000018-epoch3.ckpt"]
    assert sorted(p.name for p in (tmp_path / "whole" / "run").iterdir()) == expected
    first, _ = _trainer(tmp_path / "parts", epochs=2, every_n_updates=8, keep=100)
    _fit(first)
    resumed, _ = _trainer(tmp_path / "parts", resume=True, every_n_updates=8, keep=100)
    _fit(resumed)
    assert sorted(p.name for p in (tmp_path / "parts" / "run").iterdir()) == expected
