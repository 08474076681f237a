"""ProfileCallback(torch_profiler=...): torch's operator trace for a window of updates merged into the profile's
trace file on the loop's clock (read back from the file and checked against the loop's own state events), and
device time per state on a CUDA device (skipped without one)."""

import json
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from trace_events import nested  # tests/, on sys.path under pytest

from deepepochs import Callback, ProfileCallback, Trainer
from deepepochs.engine.operator_trace import CLOCK_MARK, clock_offset
from deepepochs.reporting.profile_report import CATEGORIES


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: every CPU operator runs on the loop's thread (and fast on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class SlowPairs(TensorDataset):
    """(x, y) pairs whose `__getitem__` sleeps `sleep` seconds."""

    def __init__(self, x, y, sleep):
        super().__init__(x, y)
        self.sleep = sleep

    def __getitem__(self, i):
        time.sleep(self.sleep)
        return super().__getitem__(i)


class SlowBackward(nn.Module):
    """The identity, whose backward pass sleeps `sleep` seconds."""

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, sleep):
            ctx.sleep = sleep
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            time.sleep(ctx.sleep)
            return grad, None

    def __init__(self, sleep):
        super().__init__()
        self.sleep = sleep

    def forward(self, x):
        return self.Sleep.apply(x, self.sleep)


def fit(profiler, device="cpu", batches=16, epochs=1, sleep=None, backward_sleep=None):
    """A two-layer model fitted for `batches` updates (one batch per update) under `profiler` (or a list of
    callbacks); `sleep`: seconds
    each item takes to read; `backward_sleep`: seconds each backward pass sleeps."""
    torch.manual_seed(0)
    x, y = torch.randn(4 * batches, 8), torch.randint(0, 2, (4 * batches,))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    if backward_sleep is not None:
        model.append(SlowBackward(backward_sleep))
    callbacks = profiler if isinstance(profiler, list) else [profiler]
    trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), callbacks=callbacks,
                      log_batch=False, show_info=False, device=device)
    data = TensorDataset(x, y) if sleep is None else SlowPairs(x, y, sleep)
    trainer.fit(DataLoader(data, batch_size=4), epochs=epochs)
    return trainer


def read(path):
    """The trace file's complete events."""
    return [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]


def inside(event, outer):
    return outer["ts"] <= event["ts"] and event["ts"] + event["dur"] <= outer["ts"] + outer["dur"]


def test_operators_sit_inside_the_forward_and_backward_states_of_the_loop_thread(tmp_path):
    """With torch_profiler=True the trace file holds torch's operators on the loop's track (pid = rank, tid 0):
    every matrix product lies inside a forward or backward state event of that track, and the loop's and
    torch's events together nest as one stack (each operator inside the state visit that contains it)."""
    path = tmp_path / "profile.json"
    fit(ProfileCallback(trace=path, torch_profiler=True))
    events = read(path)
    ops = [e for e in events if e["cat"] == "cpu_op"]
    products = [e for e in ops if e["name"] in ("aten::addmm", "aten::mm")]
    assert {e["name"] for e in products} == {"aten::addmm", "aten::mm"}  # forward's addmm, backward's mm
    assert all(e["pid"] == 0 and e["tid"] == 0 for e in ops)
    compute = [e for e in events if e["cat"] in ("forward", "backward") and e["tid"] == 0]
    for op in products:
        assert any(inside(op, state) for state in compute), op
    mm_in_backward = [op for op in products if op["name"] == "aten::mm"]
    backward = [e for e in compute if e["name"] == "step_backward"]
    assert all(any(inside(op, state) for state in backward) for op in mm_in_backward)
    assert nested([e for e in events if e["pid"] == 0 and e["tid"] == 0])
    assert CLOCK_MARK not in {e["name"] for e in events}


def test_only_the_scheduled_updates_are_profiled(tmp_path):
    """A schedule counted in updates: wait 2, warm up 1, record 2 keeps the operators of updates 4 and 5 (each
    has its forward's addmm) and none of any other update; True's window is updates 3 to 5."""
    for schedule, recorded in ((torch.profiler.schedule(wait=2, warmup=1, active=2, repeat=1), {4, 5}),
                               (True, {3, 4, 5})):
        path = tmp_path / "profile.json"
        fit(ProfileCallback(trace=path, torch_profiler=schedule))
        events = read(path)
        updates = {int(e["name"].split()[1]): e for e in events if e["cat"] == "update"}
        assert set(range(1, 17)) <= set(updates)  # and the run's tail after the last update
        ops = [e for e in events if e["cat"] == "cpu_op"]
        assert ops
        holding = {n for n, update in updates.items() for op in ops if inside(op, update)}
        assert holding == recorded
        assert all(any(inside(op, updates[n]) for n in recorded) for op in ops)
        for n in recorded:
            assert any(op["name"] == "aten::addmm" and inside(op, updates[n]) for op in ops)
        assert json.loads(path.read_text())["otherData"]["torch_profiler"] == {
            "windows": 1, "events": len([e for e in events if e["cat"] not in ("run", "epoch", "update")
                                         and e["cat"] not in CATEGORIES]), "unplaced_windows": 0}


def test_without_torch_profiler_nothing_of_torch_profiler_runs(tmp_path, monkeypatch):
    """torch_profiler=None (the default) never builds a torch.profiler.profile: a fit with a trace runs with
    it made to fail, and its trace holds the loop's events only; the same fit asking for it does fail."""
    def refuse(*args, **kwargs):
        raise AssertionError("torch.profiler.profile was called")

    monkeypatch.setattr(torch.profiler, "profile", refuse)
    path = tmp_path / "profile.json"
    fit(ProfileCallback(trace=path), batches=4)
    document = json.loads(path.read_text())
    assert "torch_profiler" not in document["otherData"]
    assert not [e for e in document["traceEvents"] if e.get("cat") in ("cpu_op", "user_annotation")]
    with pytest.raises(AssertionError, match="torch.profiler.profile was called"):
        fit(ProfileCallback(trace=path, torch_profiler=True), batches=4)


def test_the_trace_keeps_no_operators_older_than_its_window(tmp_path):
    """With trace_updates=3 the operators of updates 3 to 5 of 16 are dropped with their updates; a schedule
    that repeats (record every second update) keeps only the windows inside the last updates the trace keeps."""
    path = tmp_path / "profile.json"
    profiler = ProfileCallback(trace=path, torch_profiler=True, trace_updates=3)
    fit(profiler)
    assert profiler.operators.windows == 1
    assert not [e for e in read(path) if e["cat"] == "cpu_op"]
    repeating = torch.profiler.schedule(wait=0, warmup=1, active=1)  # updates 2, 4, ..., 16 recorded
    profiler = ProfileCallback(trace=path, torch_profiler=repeating, trace_updates=4)
    fit(profiler)
    assert profiler.operators.windows == 8
    events = read(path)
    updates = {int(e["name"].split()[1]): e for e in events if e["cat"] == "update"}
    assert set(updates) == {14, 15, 16, 17}  # the last three updates and the run's tail
    ops = [e for e in events if e["name"] == "aten::addmm"]
    assert len(ops) == 2 * 2 and all(any(inside(op, updates[n]) for n in (14, 16)) for op in ops)  # 2 layers


def test_the_clock_offset_is_the_middle_of_what_every_mark_allows():
    """Each mark bounds torch's clock minus ours: its start between the readings before and inside it, its end
    between inside and after; the offset is the middle of the bounds all marks share."""
    offset = 1_000_000
    marks = [(100, 110, 130), (200, 204, 220)]
    found = [{"ts": (105 + offset) / 1000, "dur": 15 / 1000}, {"ts": (203 + offset) / 1000, "dur": 10 / 1000}]
    # mark 1: start 105 -> [offset - 5, offset + 5], end 120 -> [offset - 10, offset + 10]; mark 2: start 203 ->
    # [offset - 1, offset + 3], end 213 -> [offset - 7, offset + 9]: shared [offset - 1, offset + 3]
    assert clock_offset(found, marks) == offset + 1
    assert clock_offset([], []) is None and clock_offset(found[:1], marks) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="device time per state needs a CUDA device")
def test_on_cuda_each_row_has_its_device_time_and_they_cover_the_stream():
    """On a CUDA device every row has 'device_seconds'; the compute states hold device time, and the rows add
    up to no more than the run's wall time (the stream's span lies inside the run)."""
    profiler = ProfileCallback()
    fit(profiler, device="cuda")
    rows = {row["state"]: row for row in profiler.table}
    assert all("device_seconds" in row for row in profiler.table)
    assert rows["step_forward/forward"]["device_seconds"] > 0 and rows["step_backward"]["device_seconds"] > 0
    total = sum(row["device_seconds"] for row in profiler.table)
    assert 0 < total <= 1.05 * profiler.timeline.wall_ns / 1e9
    assert "device s" in profiler.summary()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA kernels in the trace need a CUDA device")
def test_on_cuda_the_kernels_get_a_track_beside_the_loops_and_the_operators_stay_under_their_states(tmp_path):
    """With torch_profiler on a CUDA run, the host's operators sit on the loop's track under forward and
    backward, and the kernels on tracks of their own (named after torch's streams) of the same process."""
    path = tmp_path / "profile.json"
    fit(ProfileCallback(trace=path, torch_profiler=True), device="cuda")
    events = read(path)
    compute = [e for e in events if e["cat"] in ("forward", "backward") and e["tid"] == 0]
    products = [e for e in events if e["name"] in ("aten::addmm", "aten::mm") and e["tid"] == 0]
    assert products and all(any(inside(op, state) for state in compute) for op in products)
    kernels = [e for e in events if e["cat"] == "kernel"]
    assert kernels and all(e["pid"] == 0 and e["tid"] != 0 for e in kernels)
    names = {e["tid"]: e["args"]["name"] for e in json.loads(path.read_text())["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert all(names[e["tid"]].startswith("torch: ") for e in kernels)


def test_on_the_cpu_the_rows_have_no_device_time():
    """Without CUDA the table is the host's alone: no 'device_seconds' field, no device column."""
    profiler = ProfileCallback()
    fit(profiler, batches=4)
    assert not any("device_seconds" in row for row in profiler.table)
    assert "device s" not in profiler.summary()


class HostEvent:
    """A stand-in for a CUDA event on the CPU: `record()` reads the host clock, and a device that lags `lag`
    events behind the newest recorded one (`query()` is False for those); counts the events made."""

    made = 0
    recorded: list = []
    lag = 0

    def __init__(self):
        HostEvent.made += 1
        self.t = None

    def record(self):
        self.t = time.perf_counter_ns()
        HostEvent.recorded.append(self)

    def query(self):
        return self not in HostEvent.recorded[len(HostEvent.recorded) - HostEvent.lag:]

    def synchronize(self):
        HostEvent.lag = 0

    def elapsed_time(self, later):
        assert self.query() and later.query(), "read before the device passed it"
        return (later.t - self.t) / 1e6


@pytest.mark.parametrize("lag", [0, 3])
def test_device_times_are_read_at_update_boundaries_into_each_row(monkeypatch, lag):
    """The device-time bookkeeping, with events that read the host clock standing in for CUDA's (on a device
    lagging `lag` events behind): the DataLoader's wait and the backward pass (8 ms a batch each) have the
    same device time as host time (both clocks are the host's here, the events recorded where the host time
    moves, so a time charged to the wrong row shows), the rows add up to the same time, no event is read
    before the device passed it, and read events are reused: a run of 32 updates makes about one update's
    worth, not one per mark."""
    from deepepochs.engine.device_times import DeviceTimes

    monkeypatch.setattr(HostEvent, "recorded", [])
    monkeypatch.setattr(HostEvent, "made", 0)
    monkeypatch.setattr(HostEvent, "lag", lag)
    monkeypatch.setattr(DeviceTimes, "for_device", classmethod(lambda cls, device: cls(event=HostEvent)))
    profiler = ProfileCallback()
    fit(profiler, batches=32, sleep=0.002, backward_sleep=0.008)
    assert all("device_seconds" in row for row in profiler.table)
    rows = {row["state"]: row for row in profiler.table}
    for state in ("task_train/fetch", "step_backward"):  # a part's row and a state's
        assert rows[state]["seconds"] > 32 * 0.008
        # a mark is recorded a few microseconds beside the host's reading (more where the machine preempts us)
        assert rows[state]["device_seconds"] == pytest.approx(rows[state]["seconds"], rel=0.05)
    device = sum(row["device_seconds"] for row in profiler.table)
    assert device == pytest.approx(sum(row["seconds"] for row in profiler.table), rel=0.02)
    per_update = len(HostEvent.recorded) / 32
    assert per_update > 10  # a dozen marks and more per batch
    assert HostEvent.made <= 2 * per_update  # an update's worth of events in use, not the run's
    assert "device s" in profiler.summary()


class BrokenDevice(HostEvent):
    """A device whose every wait raises, as CUDA does after a kernel failed."""

    def synchronize(self):
        raise RuntimeError("CUDA error: device-side assert triggered")


class Boom(Callback):
    def on_after_train_batch(self, trainer, metrics, batch_idx):
        raise ValueError("the run's own error")


def test_a_failed_runs_own_error_is_raised_not_the_devices_at_the_profiles_end(monkeypatch):
    """When the device fails (every wait raises) a run that failed raises its own error, its table without
    device time; a run that did not fail raises the device's."""
    from deepepochs.engine.device_times import DeviceTimes

    monkeypatch.setattr(HostEvent, "recorded", [])
    monkeypatch.setattr(DeviceTimes, "for_device", classmethod(lambda cls, device: cls(event=BrokenDevice)))
    profiler = ProfileCallback()
    with pytest.raises(ValueError, match="the run's own error"):
        fit([Boom(), profiler], batches=2)
    assert profiler.table and not any("device_seconds" in row for row in profiler.table)
    with pytest.raises(RuntimeError, match="device-side assert"):
        fit(profiler, batches=2)
