"""ProfileCallback: every second of a run attributed to the spec's states, checked against costs put there
on purpose (a dataset, a callback and a snapshot write that sleep, each timed by the test itself), the trace
file against the trace-event format, and the loop left as it was.

These are the suite's only timing asserts: sleeps of 0.6-0.7 s in all per test, bounds of 10 %.
"""

import json
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset
from trace_events import nested  # tests/, on sys.path under pytest

from deepepochs import Callback, ConfigError, ProfileCallback, SnapshotCallback, Trainer
from deepepochs.engine import compiled
from deepepochs.fsm.machine import load_spec
from deepepochs.reporting.profile_report import CATEGORIES


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: on a loaded machine torch's spinning worker threads make a tiny model's backward
    take 100 ms instead of 0.3 ms, which would drown the costs the tests put in."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Sleeper:
    """Sleeps `seconds` per call and adds up the time it really slept (the reference)."""

    def __init__(self, seconds):
        self.seconds, self.slept = seconds, 0.0

    def __call__(self):
        start = time.perf_counter()
        time.sleep(self.seconds)
        self.slept += time.perf_counter() - start


class Items(Dataset):
    """16 items of 4 features; each `__getitem__` calls `sleep` (None: no sleep)."""

    def __init__(self, sleep=None, n=16):
        gen = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 4, generator=gen), torch.randint(0, 2, (n,), generator=gen)
        self.sleep = sleep

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if self.sleep is not None:
            self.sleep()
        return self.x[i], self.y[i]


class SleepyCallback(Callback):
    """Sleeps after every training batch."""

    def __init__(self, sleep):
        super().__init__()
        self.sleep = sleep

    def on_after_train_batch(self, trainer, metrics, batch_idx):
        self.sleep()


class SlowSnapshots(SnapshotCallback):
    """A snapshot writer whose every write also sleeps; `written`: the seconds its writes took, sleeps and
    files together (the reference)."""

    def __init__(self, folder, sleep, **kw):
        super().__init__(folder, **kw)
        self.sleep, self.written = sleep, 0.0

    def write_snapshot(self, trainer, position):
        start = time.perf_counter()
        self.sleep()
        try:
            return super().write_snapshot(trainer, position)
        finally:
            self.written += time.perf_counter() - start


def fit(callbacks, data=None, val=None, epochs=2, **kw):
    """A tiny model fitted with `callbacks`; returns (trainer, wall seconds of fit())."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), callbacks=callbacks,
                      log_batch=False, show_info=False, **kw)
    start = time.perf_counter()
    trainer.fit(DataLoader(data or Items(), batch_size=4), val, epochs=epochs)
    return trainer, time.perf_counter() - start


def seconds(profiler, category):
    return sum(row["seconds"] for row in profiler.table if row["category"] == category)


def assert_covers_the_fit(profiler, wall):
    """The rows add up to at least 97 % of the fit's wall time as the test measured it (and no more)."""
    total = sum(row["seconds"] for row in profiler.table)
    assert 0.97 * wall <= total <= wall


def test_a_slow_dataset_lands_in_data_and_the_verdict_names_the_training_dataloader(capsys):
    """A dataset that sleeps per item: its time is the data category's, within 10 %, on the compiled path."""
    sleep = Sleeper(0.02)
    profiler = ProfileCallback()
    trainer, wall = fit([profiler], Items(sleep), epochs=2)
    assert sleep.slept > 0.6
    assert sleep.slept <= seconds(profiler, "data") <= 1.1 * sleep.slept
    fetch = next(row for row in profiler.table if row["state"] == "task_train/fetch")
    assert sleep.slept <= fetch["seconds"] <= 1.1 * sleep.slept
    assert fetch["count"] == 2 * (4 + 1)  # 4 batches per epoch and the fetch that ends each epoch
    assert profiler.bottleneck == "data"
    assert profiler.verdict.startswith("data: ") and "training DataLoader (num_workers=0)" in profiler.verdict
    assert {row["category"] for row in profiler.table} <= set(CATEGORIES)
    assert_covers_the_fit(profiler, wall)
    assert "step_forward/forward" in {row["state"] for row in profiler.table}  # the compiled micro-batch's parts
    assert profiler.verdict in capsys.readouterr().out  # the summary is printed at the fit's end


def test_a_sleeping_callback_lands_in_callbacks_by_name_and_hook():
    """A callback hook that sleeps: its time is the callbacks category's, within 10 %, under its name."""
    sleep = Sleeper(0.08)
    profiler = ProfileCallback()
    trainer, wall = fit([SleepyCallback(sleep), profiler], epochs=2)
    assert sleep.slept > 0.6
    assert sleep.slept <= seconds(profiler, "callbacks") <= 1.1 * sleep.slept
    assert profiler.table[0]["state"].endswith("/SleepyCallback.on_after_train_batch")
    assert profiler.table[0]["count"] == 8
    assert profiler.bottleneck == "callbacks"
    assert "SleepyCallback.on_after_train_batch" in profiler.verdict
    assert_covers_the_fit(profiler, wall)


def test_a_slow_snapshot_write_lands_in_checkpoint(tmp_path):
    """Snapshot writes that sleep: their time is the checkpoint category's (the spec's cost of
    save_snapshot), within 10 %."""
    sleep = Sleeper(0.1)
    profiler = ProfileCallback()
    writer = SlowSnapshots(tmp_path / "snaps", sleep, every_n_updates=2)
    trainer, wall = fit([writer, profiler], epochs=2)
    assert sleep.slept > 0.6
    assert writer.written <= seconds(profiler, "checkpoint") <= 1.1 * writer.written
    assert profiler.bottleneck == "checkpoint"
    assert profiler.verdict.startswith("checkpoint: ") and "save_snapshot" in profiler.verdict
    assert_covers_the_fit(profiler, wall)


def test_validation_and_test_runs_are_profiled_in_their_own_states():
    """Validation batches count as validation; test() is profiled as its own run."""
    profiler = ProfileCallback()
    trainer, _ = fit([profiler], val=DataLoader(Items(), batch_size=8), epochs=1)
    states = {row["state"]: row for row in profiler.table}
    assert states["val_batch"]["count"] == 2 and states["val_batch"]["category"] == "validation"
    assert states["task_val/fetch"]["category"] == "validation"
    trainer.test(DataLoader(Items(), batch_size=8))
    assert profiler.run == "test"
    assert {row["state"] for row in profiler.table} >= {"test_batch", "task_test/fetch"}
    assert "step_forward" not in {row["state"].split("/")[0] for row in profiler.table}


@pytest.mark.parametrize("kw", [{}, {"gradient_accumulation_steps": 3}, {"fuse_steps": False}],
                         ids=["compiled", "accumulating", "every-edge"])
def test_profiling_changes_no_result_and_leaves_the_loop_as_it_was(kw):
    """The same fit with and without the profiler ends with bit-identical weights (compiled micro-batches,
    accumulation windows, every edge fired), every micro-batch's states are counted, and after the fit the
    machine, the hook table and the console are the ones the trainer had."""
    plain, _ = fit([], **kw)
    profiler = ProfileCallback()
    profiled, _ = fit([profiler], **kw)
    counts = {row["state"]: row["count"] for row in profiler.table}
    assert counts["step_forward"] == 8  # 2 epochs of 4 micro-batches, each entering it once
    for a, b in zip(plain.model.parameters(), profiled.model.parameters()):
        assert torch.equal(a, b)
    ctx = profiled._driver.ctx
    assert ctx.profiler is None
    assert "fire_cold" not in vars(ctx.machine) and "batch" not in vars(ctx.parts.console)
    def timed(fn):
        return "Timeline.timed" in getattr(fn, "__qualname__", "")

    assert not any(timed(h) for handlers in ctx.parts.hooks.by_event.values() for h in handlers)
    assert not any(timed(getattr(ctx.machine.model, a.name)) for a in load_spec().actions)
    assert not any(timed(act) for edges in ctx.machine.table.values() for edge in edges for act in edge[2])


def test_the_profiled_micro_batch_is_the_same_code_with_state_entries():
    """The profiled variant of each compiled micro-batch is the plain one plus one `enter_state` line per
    state move: no second copy of the loop."""
    for folded, autocast in (({}, False), ({"sync_gradients": "one process"}, True)):
        plain = compiled.generate_all(folded, autocast)
        profiled = compiled.generate_all(folded, autocast, profiled=True)
        lines = profiled.splitlines()
        entries = [line for line in lines if line.strip().startswith("enter_state(")]
        moves = [line for line in plain.splitlines() if line.strip().startswith("model.state = ")]
        assert len(entries) == len(moves) > 0
        assert "\n".join(line for line in lines if line not in entries) == plain.rstrip("\n")


def test_the_trace_is_trace_event_json_with_every_visit_inside_its_update_and_epoch(tmp_path):
    """The trace file parses; its complete events carry the format's fields, nest (every event inside its
    parent: run > epoch > update > state visit > part), and keep only the last `trace_updates` updates."""
    path = tmp_path / "profile.json"
    profiler = ProfileCallback(trace=str(path), trace_updates=3)
    fit([profiler], val=DataLoader(Items(), batch_size=8), epochs=2)
    document = json.loads(path.read_text())
    events = [e for e in document["traceEvents"] if e["ph"] == "X"]
    assert all({"name", "cat", "ts", "dur", "pid", "tid"} <= set(e) and e["pid"] == 0 and e["dur"] >= 0
               for e in events)
    assert nested(events)
    run = next(e for e in events if e["cat"] == "run")
    updates = [e for e in events if e["cat"] == "update"]
    epochs = [e for e in events if e["cat"] == "epoch"]
    assert len(updates) == 3 and document["otherData"]["dropped_updates"] > 0
    visits = [e for e in events if e["cat"] in CATEGORIES]
    for visit in visits:
        assert any(u["ts"] <= visit["ts"] and visit["ts"] + visit["dur"] <= u["ts"] + u["dur"] + 1e-3 for u in updates)
    assert {e["name"] for e in epochs} == {"epoch 2"}  # epoch 1 lies wholly before the kept window
    assert run["dur"] == pytest.approx(profiler.timeline.wall_ns / 1000)
    assert {"step_forward", "forward", "task_train"} <= {e["name"] for e in visits}


@pytest.mark.parametrize(("kw", "message"), [
    ({"trace": "/no/such/folder/profile.json"}, "trace='/no/such/folder/profile.json': the folder '/no/such/folder'"
                                                " does not exist"),
    ({"trace": 3}, "trace must be a file path (str or os.PathLike) or None (got int)"),
    ({"torch_profiler": "yes", "trace": "p.json"}, "torch_profiler must be None, False, True (a window of a few"
                                                   " updates) or a torch.profiler.schedule(...) (got 'yes')"),
    ({"torch_profiler": len}, "torch_profiler must be None, False, True"),
    ({"torch_profiler": True}, "torch_profiler needs trace=<a file path>: torch's operator trace is merged into that"
                               " file (got trace=None)"),
    ({"trace_updates": 0}, "trace_updates must be a whole number >= 1 (got 0)"),
])
def test_bad_arguments_are_refused_naming_them(kw, message):
    """A bad argument raises ConfigError naming it, the accepted values and what was given."""
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ProfileCallback(**kw)


def test_validation_points_log_where_the_time_since_the_previous_point_went(tmp_path):
    """Under the update clock LogCallback writes `profile/<category>` at each validation point's update count:
    the shares of the interval since the previous point, which add up to that interval's whole time; a
    dataset that sleeps makes data the largest share once the writer has started."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from deepepochs import LogCallback

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), max_updates=6,
                      callbacks=[LogCallback(tmp_path), ProfileCallback()], log_batch=False, show_info=False,
                      running_id="run")
    trainer.fit(DataLoader(Items(Sleeper(0.03)), batch_size=4), DataLoader(Items(), batch_size=16),
                val_every_n_updates=3)
    trainer.close()
    events = EventAccumulator(str(tmp_path / "run"), size_guidance={"scalars": 0})
    events.Reload()
    shares = {c: dict((e.step, e.value) for e in events.Scalars(f"profile/{c}")) for c in CATEGORIES}
    assert all(set(points) == {3, 6} for points in shares.values())
    for step in (3, 6):
        assert sum(points[step] for points in shares.values()) == pytest.approx(1.0, abs=1e-4)
    # the first interval holds the writer's start (logging); the second is the sleeping dataset's
    assert shares["logging"][3] > 0
    assert max(CATEGORIES, key=lambda c: shares[c][6]) == "data", {c: shares[c][6] for c in CATEGORIES}


def test_the_graph_of_a_profiled_run_is_a_heat_map_at_the_level_of_its_hottest_state(tmp_path, capsys):
    """state_graph(profile=...) and `graph --profile FILE` shade and label each state by its share of the
    run's time, drawn at the coarsest level showing the hottest state (here the training task, which waits
    for the sleeping dataset)."""
    import shutil
    import xml.etree.ElementTree as ET

    from deepepochs.__main__ import main
    from deepepochs.fsm.render import heat_colour
    from deepepochs.reporting.profile_report import state_shares

    trace = tmp_path / "profile.json"
    profiler = ProfileCallback(trace=trace)
    trainer, _ = fit([profiler], Items(Sleeper(0.01)), epochs=1)
    shares = state_shares(profiler.table)
    assert max(shares, key=shares.get) == "task_train"
    assert sum(shares.values()) == pytest.approx(1.0)
    dot = trainer.state_graph("dot", profile=profiler)
    assert "level epoch" in dot
    task = next(line for line in dot.splitlines() if line.strip().startswith("task_train ["))
    assert f'{100 * shares["task_train"]:.1f} %' in task and heat_colour(shares["task_train"]) in task
    assert trainer.state_graph("mermaid", profile=profiler.table).count("classDef heat") >= 3
    if shutil.which("dot") is None:
        pytest.skip("Graphviz's dot is not installed: the SVG is not drawn")
    out = tmp_path / "heat.svg"
    assert main(["graph", "--profile", str(trace), "--format", "svg", "--output", str(out)]) == 0
    svg = out.read_text()
    ET.fromstring(svg)  # well-formed
    assert heat_colour(shares["task_train"]) in svg and f'{100 * shares["task_train"]:.1f} %' in svg
    (tmp_path / "other.json").write_text('{"traceEvents": []}')
    assert main(["graph", "--profile", str(tmp_path / "other.json"), "--format", "dot"]) == 2
    assert "not a trace written by ProfileCallback" in capsys.readouterr().err


class FailOnce(Callback):
    """Raises at the first epoch's end, once."""

    def __init__(self):
        super().__init__()
        self.failed = False

    def on_after_epoch(self, trainer, train_tasks, val_tasks, train_metrics, val_metrics, epoch_idx):
        if not self.failed:
            self.failed = True
            raise RuntimeError("boom")


def test_a_failed_fit_is_profiled_through_its_rollback_and_gives_the_loop_back(capsys):
    """A fit that raises keeps its table (the rollback included) and prints no summary; the loop is given back,
    so the refit (profiled again) ends with the weights of a run that never failed."""
    profiler = ProfileCallback()
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                      callbacks=[FailOnce(), profiler], log_batch=False, show_info=False)
    data = DataLoader(Items(), batch_size=4)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(data, epochs=2)
    assert "rollback" in {row["state"].split("/")[0] for row in profiler.table}
    assert "Where the time goes" not in capsys.readouterr().out
    assert trainer._driver.ctx.profiler is None and "fire_cold" not in vars(trainer.machine)
    trainer.fit(data, epochs=2)
    reference, _ = fit([], epochs=2)
    for a, b in zip(reference.model.parameters(), trainer.model.parameters()):
        assert torch.equal(a, b)
    assert "Where the time goes (fit" in capsys.readouterr().out


def test_predict_is_profiled_as_its_own_run():
    """predict() is profiled: its batches in the test states, its fetches timed."""
    profiler = ProfileCallback()
    trainer, _ = fit([profiler], epochs=1)
    trainer.predict(DataLoader(Items(), batch_size=8))
    assert profiler.run == "predict"
    states = {row["state"]: row for row in profiler.table}
    assert states["test_batch"]["count"] == 2 and states["task_test/fetch"]["count"] == 3


def test_the_straggler_line_names_the_rank_that_arrived_last_and_the_time_the_others_waited():
    """Arrival times per rank (aligned from the newest): the rank last most often, and the waits summed."""
    from deepepochs.reporting.profile_report import straggler_line

    line = straggler_line([[99, 0, 10_000_000, 20], [1_000_000_005, 12, 21]])  # rank 0 has one older sync
    assert line == ("straggler: rank 1 arrived last at 2 of the last 3 gradient synchronisations; the ranks waited"
                    " 1.010 s for the last one in all")
    assert straggler_line([[1, 2]]) is None and straggler_line([[], [1]]) is None
