"""What a user reads while debugging: `trainer.explain()`'s summary, flight records by plain names and
`save_flight_record` from the package, the learning-rate finder's stop reason and plot range, and what a
resume inside `find_lr` says about the fit that follows."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import deepepochs
from deepepochs import Callback, CheckCallback, GradClipCallback, Trainer
from deepepochs.training.lr_sweep import LRFindResult, smooth


def _quiet(**kwargs):
    return {"device": "cpu", "log_batch": False, "show_info": False, **kwargs}


def _summary(text):
    head, _, code = text.partition("\n\n")
    return dict(re.findall(r"^#   (\w[\w ]*?)  +(.*)$", head, re.M)), code


def test_explain_starts_with_a_summary_of_the_default_configuration():
    """fp32, one batch per update, one process, not compiled, the non-finite check, the generated code; the
    left-out steps it lists are exactly those the code below marks as left out."""
    model = nn.Linear(4, 2)
    trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), **_quiet())
    text = trainer.explain()
    assert text.startswith("# This trainer's training batches, in short:\n")
    lines, code = _summary(text)
    assert lines["precision"] == "fp32: no autocast"
    assert lines["accumulation"] == "1 batch per optimizer update"
    assert lines["processes"] == "1"
    assert lines["model"].startswith("not compiled")
    assert "nonfinite='raise'" in lines["each update"] and "clipping" not in lines["each update"]
    assert lines["batches run"].startswith("the generated code below")
    left_out = set(re.findall(r"# (\w+)\(ctx\): left out \((?!it ran above)", code))  # folds, not the repeated commit
    assert left_out == {"sync_gradients", "skip_gradient_sync", "clip_gradients", "update_scaler", "average_update"}
    assert set(re.findall(r"(\w+)(?:, | \()", lines["left out"])) >= left_out
    for why in set(re.findall(r"# \w+\(ctx\): left out \(((?!it ran above).*)\)", code)):
        assert why in lines["left out"]


class OnBackward(Callback):
    def on_after_backward(self, trainer, *args, **kwargs):
        pass


def test_explain_says_when_the_model_is_compiled_and_why_batches_fire_edge_by_edge():
    """torch.compile(model), bf16, 4 batches per update, a clipper, a hook inside the batch: each shows in
    the summary (compiling nothing: no batch runs)."""
    model = nn.Linear(4, 2)
    trainer = Trainer(torch.compile(model), F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1),
                      precision="bf16", gradient_accumulation_steps=4, nonfinite="skip",
                      callbacks=[GradClipCallback(1.0), OnBackward()], **_quiet())
    lines, code = _summary(trainer.explain())
    assert lines["model"] == "compiled with torch.compile"
    assert lines["precision"] == "bf16: autocast to bfloat16, no loss scaling"
    assert lines["accumulation"] == "4 batches per optimizer update"
    assert "nonfinite='skip'" in lines["each update"] and "gradient clipping (1 clipper)" in lines["each update"]
    assert "clip_gradients" not in lines["left out"] and "clip_gradients(ctx)\n" in code
    assert lines["batches run"].startswith("edge by edge (callback hooks inside a batch: on_after_backward)")
    plain = Trainer(model, F.cross_entropy, compile_model=True, **_quiet())
    assert _summary(plain.explain())[0]["model"] == "compiled with torch.compile"


class Boom(Callback):
    def on_after_train_batch(self, trainer, metrics, batch_idx):
        raise RuntimeError("boom")


def test_flight_records_name_triggers_plainly_and_save_from_the_package(tmp_path):
    """A failed fit's record holds plain str triggers (no `<TriggerName.INTERRUPT: ...>` in its repr);
    `deepepochs.save_flight_record` writes them as JSON, read back with the json module."""
    model = nn.Linear(4, 2)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    trainer = Trainer(model, F.cross_entropy, callbacks=[Boom()], **_quiet(epochs=1))
    with pytest.raises(RuntimeError, match="boom") as info:
        trainer.fit([(x, y)])
    records = info.value.deepepochs_flight_record
    assert [r.trigger for r in records[-2:]] == ["interrupt", "recover"]
    assert all(type(r.trigger) is str for r in records)
    assert "<TriggerName" not in repr(records) and "<TriggerName" not in repr(trainer.machine.records())
    path = deepepochs.save_flight_record(info.value, tmp_path / "crash.json")
    saved = json.loads(path.read_text())["records"]
    assert [r["trigger"] for r in saved] == [r.trigger for r in records]
    assert "save_flight_record" in deepepochs.__all__


def _least_squares():
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    return x, x @ torch.randn(4, 1)


def test_the_finders_stop_reason_states_the_limit_it_crossed():
    """A sweep to a rate that diverges stops with the smoothed loss, the factor, the lowest value and their
    product, the limit; the numbers agree with the returned curve."""
    x, y = _least_squares()
    model = nn.Linear(4, 1)
    with Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), **_quiet()) as trainer:
        result = trainer.find_lr([(x, y)], min_lr=1e-3, max_lr=100.0, num_steps=40, plot=False)
    match = re.fullmatch(r"diverged at lr (\S+): the smoothed loss (\S+) is above 4 times its lowest value (\S+)"
                         r" \(the limit (\S+)\)", result.stop_reason)
    assert match, result.stop_reason
    lr, current, best, limit = (float(v) for v in match.groups())
    smoothed = smooth(result.losses, 0.9)
    assert current == pytest.approx(smoothed[-1], rel=1e-3) and best == pytest.approx(min(smoothed), rel=1e-3)
    assert limit == pytest.approx(4 * best, rel=1e-3) and current > limit
    assert lr == pytest.approx(result.lrs[-1], rel=1e-2)


def test_the_finders_plot_spans_the_useful_part_of_the_curve(tmp_path, monkeypatch):
    """The loss axis runs from below the curve's lowest point to above its start, not up to the diverged
    tail; `plot` sets exactly that range."""
    losses = [2.0, 1.9, 1.5, 1.0, 0.6, 0.5, 0.7, 3.0, 40.0, 900.0]
    smoothed = smooth(losses, 0.5)
    result = LRFindResult(lrs=[10.0 ** (i - 5) for i in range(10)], losses=losses, smoothed=smoothed,
                          suggestion=None, stop_reason="max_lr reached")
    low, high = result.y_range()
    assert low < min(smoothed) and low < min(losses)
    assert high >= max(losses[:7]) and high < 10
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    seen = []
    original = Figure.savefig
    monkeypatch.setattr(Figure, "savefig",
                        lambda fig, *a, **k: seen.append(fig.axes[0].get_ylim()) or original(fig, *a, **k))
    assert result.plot(tmp_path / "lr.png")
    assert seen == [pytest.approx((low, high))] and (tmp_path / "lr.png").stat().st_size > 0


def test_find_lr_before_a_resumed_fit_says_what_that_fit_will_do(tmp_path, capsys):
    """A run finished at 2 epochs, resumed by Trainer(epochs=4, resume=True): find_lr (which honours the
    resume first) says it trains on to epoch 4, never that fit() returns without training; the fit then
    trains epochs 3 and 4."""
    x = torch.randn(64, 4)
    batches = [(x[i:i + 16], (x[i:i + 16, 0] > 0).long()) for i in range(0, 64, 16)]

    def trainer(epochs, **kwargs):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        return Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1), epochs=epochs,
                       callbacks=[CheckCallback("loss", on_stage="train", ckpt_dir=tmp_path)], running_id="run",
                       **_quiet(**kwargs))

    with trainer(2) as t:
        t.fit(batches)
    capsys.readouterr()
    with trainer(4, resume=True, show_info=True) as t:
        t.find_lr(batches, num_steps=5, plot=False)
        said = capsys.readouterr().out
        records = t.fit(batches)
    assert "without training" not in said
    assert "Run run had completed 2 of 2 epoch(s); training on to epoch 4" in said
    assert t.loop.completed_epochs == 4 and len(records["train"]["loss"]) == 4


def failing_at_batch_4(hook):
    """A callback raising from hook `hook` at training batch 4 (the second batch of the second window, k=2)."""
    def fail(self, trainer, *args, **kwargs):
        if trainer.loop.batch_idx == 4:
            raise RuntimeError("failed on purpose")
    return type("FailAtBatch4", (Callback,), {hook: fail})()


@pytest.mark.parametrize("hook, said, kept", [
    ("on_before_backward", "the failing batch's update was not made: its window's 2 batch(es) are dropped", 1),
    ("on_before_optimize", "the failing batch's update was not made: its window's 2 batch(es) are dropped", 1),
    ("on_after_optimize", "the failing batch's update was kept (applied before the error)", 2),
    ("on_after_train_batch", "the failing batch's update was kept (committed before the error)", 2),
])
def test_the_crash_note_says_whether_the_failing_batchs_update_was_kept(hook, said, kept):
    """A fault at batch 4 (accumulation 2): the note says whether that batch's update was kept and how many
    updates of the run are committed, and the model holds exactly that many updates of a plain SGD loop."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    reference = nn.Linear(4, 2)
    reference.load_state_dict(model.state_dict())
    trainer = Trainer(model, F.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.5), epochs=1,
                      gradient_accumulation_steps=2, callbacks=[failing_at_batch_4(hook)], **_quiet())
    with pytest.raises(RuntimeError, match="failed on purpose") as info:
        trainer.fit(data)
    note = info.value.__notes__[0]
    assert f"; {said}" in note and f"{kept} update(s) of the run committed" in note, note
    assert note.index(said) < note.index("last transitions")  # the flight record stays the note's end
    opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    batches = list(data)
    for update in range(kept):
        (xa, ya), (xb, yb) = batches[2 * update], batches[2 * update + 1]
        loss = (F.cross_entropy(reference(xa), ya, reduction="sum") + F.cross_entropy(reference(xb), yb,
                                                                                        reduction="sum")) / 8
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(model.state_dict().values(),
                                                             reference.state_dict().values()))
    trainer.close()
