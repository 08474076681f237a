"""The update clock's edges of the spec, taken by real fits (the flight record), its guards on a bare loop
state, endless and resampled data trained to the budget, and the errors for what it cannot run."""

import itertools

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from deepepochs import CheckCallback, ConfigError, Trainer
from deepepochs.engine import actions
from deepepochs.engine.context import LoopState
from deepepochs.fsm.machine import load_spec

SPEC = load_spec()
X, Y = torch.randn(24, 4, generator=torch.Generator().manual_seed(1)), torch.arange(24) % 2


def _trainer(**kw):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    kw.setdefault("max_updates", 7)
    return Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu",
                   log_batch=False, show_info=False, **kw)


def _loaders(batch=4):
    data = TensorDataset(X, Y)
    return DataLoader(data, batch_size=batch, shuffle=True), DataLoader(data, batch_size=8)


def _edges(trainer):
    return [(r.source, r.trigger, r.dest) for r in trainer.machine.records()]


class Endless(IterableDataset):
    """A stream without a length that never ends."""

    def __iter__(self):
        for i in itertools.count():
            yield X[i % 24], Y[i % 24]


def test_the_update_clock_edges_exist_in_the_spec_with_their_guards():
    """validate from task_train (val_point_due / task_stops / neither), end_stage of a validation point back
    to the task or to task_spent, end_task from task_spent and next_epoch's budget edge are spec edges."""
    edges = {(t.source, t.trigger, t.dest, t.conditions, t.unless) for t in SPEC.transitions}
    assert ("task_train", "validate", "stage_val", ("val_point_due",), ()) in edges
    assert ("task_train", "validate", "task_spent", ("task_stops",), ("val_point_due",)) in edges
    assert ("task_train", "validate", "task_train", (), ("val_point_due", "task_stops")) in edges
    assert ("stage_val", "end_stage", "task_train", ("val_point_open",), ("task_stops",)) in edges
    assert ("stage_val", "end_stage", "task_spent", ("val_point_open", "task_stops"), ()) in edges
    assert ("stage_val", "end_stage", "epoch_end", (), ("val_point_open",)) in edges
    assert ("task_spent", "end_task", "stage_train", (), ()) in edges
    assert ("fit_running", "next_epoch", "fit_done", ("update_budget_reached",), ("stop_requested",)) in edges


def test_a_fit_on_the_update_clock_takes_the_validation_point_and_budget_edges():
    """Batches of 4 over 24 samples (6 per epoch), max_updates=7, validation every 3 updates: points at
    updates 3 and 6 inside epoch 1 return to the task, the point at 7 (the budget) leads to task_spent, the
    fit ends on the budget in epoch 2; the epoch's end validates nothing more."""
    trainer = _trainer()
    records = trainer.fit(*_loaders(), val_every_n_updates=3)
    edges = _edges(trainer)
    assert edges.count(("task_train", "validate", "stage_val")) == 3
    assert edges.count(("stage_val", "end_stage", "task_train")) == 2
    assert edges.count(("stage_val", "end_stage", "task_spent")) == 1
    assert ("task_spent", "end_task", "stage_train") in edges
    assert ("epoch_trained", "validate", "epoch_end") in edges and ("stage_val", "end_stage", "epoch_end") not in edges
    assert edges[-2:] == [("fit_running", "next_epoch", "fit_done"), ("fit_done", "finish", "idle")]
    assert records["val"]["updates"] == [3, 6, 7] and len(records["val"]["loss"]) == 3
    assert trainer.loop.run.updates == 7 and trainer.loop.completed_epochs == 2
    assert len(records["train"]["loss"]) == 2  # epoch 2 ended at the budget after 1 update


def test_without_the_clock_no_batch_fires_validate_in_a_training_task():
    """A fit with neither max_updates nor val_every_n_updates takes no update clock edge."""
    trainer = _trainer(max_updates=None, epochs=2)
    trainer.fit(*_loaders())
    assert not [e for e in _edges(trainer) if e[0] in ("task_train", "task_spent") and e[1] == "validate"]
    assert trainer.loop.run.updates == 12  # counted all the same (checkpoints and snapshots carry it)


def test_epochs_end_the_fit_first_when_they_come_before_the_budget():
    """epochs=2 and max_updates=100 over 6 batches an epoch: the fit ends after 12 updates."""
    trainer = _trainer(epochs=2, max_updates=100)
    trainer.fit(*_loaders())
    assert trainer.loop.run.updates == 12 and trainer.loop.completed_epochs == 2
    assert ("fit_running", "next_epoch", "fit_done") in _edges(trainer)


def test_the_guards_read_the_budget_the_interval_and_the_records():
    """val_point_due: a multiple of the interval or the budget, once per count; update_budget_reached waits
    for an interrupted epoch's end; task_stops also on a stop request."""

    class Ctx:
        def __init__(self, loop):
            self.loop, self.history = loop, loop.run.history

    loop = LoopState()
    ctx = Ctx(loop)
    loop.target_updates, loop.val_every = 10, 4
    for count, due in ((0, False), (3, False), (4, True), (8, True), (9, False), (10, True)):
        loop.run.updates = count
        assert actions.GUARDS["val_point_due"](ctx) is due, count
    ctx.history["val"]["updates"] = [8]
    loop.run.updates = 8
    assert not actions.GUARDS["val_point_due"](ctx)
    loop.run.updates = 10
    assert actions.GUARDS["task_stops"](ctx) and actions.GUARDS["update_budget_reached"](ctx)
    loop.resume = object()  # an epoch interrupted after the budget's last update
    assert actions.GUARDS["task_stops"](ctx) and not actions.GUARDS["update_budget_reached"](ctx)
    loop.run.updates, loop.resume = 5, None
    assert not actions.GUARDS["task_stops"](ctx)
    loop.stop = object()
    assert actions.GUARDS["task_stops"](ctx)


@pytest.mark.parametrize("make", [
    lambda: DataLoader(Endless(), batch_size=4),
    lambda: (batch for batch in itertools.cycle([(X[:4], Y[:4]), (X[4:8], Y[4:8])])),
    lambda: itertools.cycle([(X[:4], Y[:4]), (X[4:8], Y[4:8])]),
], ids=["iterable-dataset", "generator", "itertools.cycle"])
def test_endless_streams_train_to_the_budget_without_an_epoch_end(make):
    """An IterableDataset without a length, a generator of batches and itertools.cycle: 9 updates, the one
    epoch ended by the budget, validation points at 4, 8 and 9."""
    trainer = _trainer(max_updates=9)
    records = trainer.fit(make(), _loaders()[1], val_every_n_updates=4)
    assert trainer.loop.run.updates == 9 and trainer.loop.completed_epochs == 1
    assert records["val"]["updates"] == [4, 8, 9]


def test_a_stop_requested_at_a_validation_point_ends_an_endless_stream_there(tmp_path):
    """CheckCallback with patience 1 on a loss that cannot improve (lr 0): the second validation point stops
    the fit, which never reaches its budget; the best file, written at the first point, holds its count."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    check = CheckCallback("loss", patience=1, ckpt_dir=tmp_path)
    trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.0), max_updates=1000,
                      device="cpu", log_batch=False, show_info=False, callbacks=[check])
    records = trainer.fit(DataLoader(Endless(), batch_size=4), _loaders()[1], val_every_n_updates=5)
    assert records["val"]["updates"] == [5, 10] and trainer.loop.run.updates == 10
    assert ("stage_val", "end_stage", "task_spent") in _edges(trainer)
    assert "did not improve for 1 validation point(s)" in trainer.loop.stop.reason
    saved = torch.load(check.path(trainer), weights_only=True)
    assert saved["updates"] == 5


def test_console_prints_one_line_per_validation_point_with_the_update_count(capsys):
    """`U 3/7  VAL> loss: ...` per validation point; the epoch lines have no epoch target (unbounded)."""
    trainer = _trainer()
    trainer.console.show_info = True
    trainer.console.enabled = True
    trainer.fit(*_loaders(), val_every_n_updates=3)
    lines = [line for line in capsys.readouterr().out.splitlines() if line[:2] in ("U ", "E ")]
    assert [line.split("  ")[0] for line in lines] == ["U 3/7", "U 6/7", "E 1", "U 7/7", "E 2"]


@pytest.mark.parametrize("kw, message", [
    (dict(max_updates=0), "max_updates must be None or a positive int (got 0)"),
    (dict(max_updates=2.5), "max_updates must be None or a positive int (got 2.5)"),
    (dict(max_updates=True), "max_updates must be None or a positive int (got True)"),
    (dict(max_updates=None, epochs=0), "epochs must be a positive int, or None with max_updates=N (got 0)"),
])
def test_a_bad_budget_names_the_argument_the_accepted_values_and_what_came(kw, message):
    """Trainer(max_updates=...) and epochs=None without a budget are refused when the Trainer is made."""
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _trainer(**kw)


@pytest.mark.parametrize("every", [0, -3, 1.5, "5", True])
def test_a_bad_validation_interval_names_the_argument_and_what_came(every):
    """fit(val_every_n_updates=...) takes a positive int."""
    with pytest.raises(ConfigError, match=rf"val_every_n_updates must be None or a positive int.*\(got {every!r}\)"):
        _trainer().fit(*_loaders(), val_every_n_updates=every)


def test_a_validation_interval_without_validation_data_is_refused():
    """val_every_n_updates needs val_dl or val_tasks."""
    with pytest.raises(ConfigError, match="val_every_n_updates=5 validates every 5 updates, but fit.. got no"
                                          " validation data"):
        _trainer().fit(_loaders()[0], val_every_n_updates=5)


@pytest.mark.parametrize(("make", "why"), [
    (lambda: itertools.cycle([(X[:4], Y[:4])]), "cycle"),
    (lambda: itertools.repeat((X[:4], Y[:4])), "repeat"),
    (lambda: DataLoader(TensorDataset(X, Y), batch_size=4, sampler=itertools.cycle(range(24))),
     "a DataLoader whose sampler is cycle"),
    (lambda: DataLoader(TensorDataset(X, Y), batch_sampler=itertools.repeat([0, 1, 2, 3])),
     "a DataLoader whose batch_sampler is repeat"),
], ids=["itertools.cycle", "itertools.repeat", "loader-over-an-endless-sampler", "loader-over-endless-batches"])
def test_an_endless_stream_without_a_budget_is_refused_naming_max_updates(make, why):
    """Data that never ends by construction (an endless itertools iterator as the data, or as a DataLoader's
    sampler or batch sampler) with no max_updates would never end a fit: refused before training, naming
    what makes it endless and max_updates."""
    with pytest.raises(ConfigError, match=rf"endless stream \({why}\).*Trainer\(max_updates=N\).*got max_updates=None"):
        _trainer(max_updates=None, epochs=3).fit(make())


class Finite(IterableDataset):
    """A stream without a length that ends after 3 batches of 4 samples."""

    def __iter__(self):
        return iter(zip(X[:12], Y[:12]))


@pytest.mark.parametrize("make", [lambda: DataLoader(Finite(), batch_size=4),
                                  lambda: ((X[i:i + 4], Y[i:i + 4]) for i in (0, 4, 8))],
                         ids=["iterable-dataset", "generator"])
def test_a_stream_without_a_length_that_ends_trains_by_epochs_without_a_budget(make):
    """Nothing can tell a length-less stream that ends from one that does not before iterating it, so an
    IterableDataset or a generator is accepted without max_updates: each epoch ends with the stream."""
    trainer = _trainer(max_updates=None, epochs=1)
    trainer.fit(make())
    assert trainer.loop.run.updates == 3 and trainer.loop.completed_epochs == 1
