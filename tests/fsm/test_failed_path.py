"""The path that failed. A run that fails at a known point (a NaN loss in epoch 2, with
gradient accumulation k=3) is drawn from the trainer and from its saved flight record; the numbered path
must be the flight record, the failed state red, and the rollback's edge must lead to the last commit."""

import re
import shutil

import pytest
import torch
from graph_layout import layout_of, problems
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from deepepochs import Trainer
from deepepochs.__main__ import main
from deepepochs.errors import ConfigError
from deepepochs.fsm.drawing import LEVELS
from deepepochs.fsm.flight import read_flight_record, save_flight_record
from deepepochs.fsm.render import run_dot

BATCHES = 12  # per epoch: 48 samples, batch 4
NAN_CALL = BATCHES + 8  # the loss's 20th call: epoch 2, batch 8 (the third window's second micro-batch)


@pytest.fixture(scope="module")
def crashed():
    """A trainer whose fit raised at the NaN loss, and the error (made once for this module)."""
    return _crash()


def _crash():
    """Fit until the NaN loss raises; returns the trainer and the error."""
    torch.manual_seed(0)
    x = torch.randn(48, 4)
    y = (x[:, 0] > 0).long()
    data = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    calls = []

    def loss(pred, target):
        calls.append(None)
        out = F.cross_entropy(pred, target)
        return out * float("nan") if len(calls) == NAN_CALL else out

    t = Trainer(nn.Linear(4, 2), loss, epochs=3, gradient_accumulation_steps=3, log_batch=False,
                show_info=False, device="cpu")
    t._console.enabled = False
    try:
        t.fit(data)
    except FloatingPointError as e:
        return t, e
    raise AssertionError("the NaN loss did not raise")


def _numbered(dot: str) -> dict[int, tuple[str, str, str]]:
    """From DOT text: path number -> (drawn source, trigger, drawn dest) of the label line holding it."""
    tails = {label: src for src, label in re.findall(r"^  (\w+) -> (e\d+) ", dot, re.M)}
    heads = dict(re.findall(r"^  (e\d+) -> (\w+)", dot, re.M))
    out = {}
    for label_id, html in re.findall(r"^  (e\d+) \[shape=plaintext, margin=0.02, label=(.*)\];$", dot, re.M):
        for numbers, trigger in re.findall(r"<B>([\d, ]+):</B></FONT> <FONT COLOR=\"\w+\">(\w+)</FONT>", html):
            for n in numbers.split(", "):
                assert int(n) not in out, f"step {n} is drawn twice"
                out[int(n)] = (tails[label_id], trigger, heads[label_id])
    return out


def test_the_drawn_path_of_a_nan_in_epoch_two_is_the_flight_record(crashed):
    """Every step of the flight record is numbered once, in order, on the edge it took; the last steps are
    the interrupt from the state that raised and the recovery; the failed state is red; a green edge leads
    from rollback to where the last committed update (the second window of epoch 2) ended."""
    t, error = crashed
    records = error.deepepochs_flight_record[-12:]
    assert [r[0] for r in records] == [2] * 12  # all in epoch 2, where the NaN was injected
    failed = re.search(r"raised in state '(\w+)'", error.__notes__[0]).group(1)
    dot = t.state_graph("dot", level="full")
    assert _numbered(dot) == {n: (r[2], r[3], r[4]) for n, r in enumerate(records, 1)}
    assert records[-2][2:] == (failed, "interrupt", "rollback") and records[-1][3] == "recover"
    assert re.search(rf'^  {failed} \[[^\n]*fillcolor="#ff8080", color=red', dot, re.M)
    commits = [n for n, r in enumerate(records, 1) if r[3] == "update_step"]
    assert commits and records[commits[-1] - 1][1] == 6  # k=3: the second window's update, at batch 6
    assert f"kept: the work up to {commits[-1]} (last commit, epoch 2 batch 6)" in dot
    (resume,) = re.findall(r"^  rollback -> (e\d+) \[arrowhead=none, color=darkgreen", dot, re.M)
    assert re.search(rf"^  {resume} -> task_train ", dot, re.M)
    mermaid = t.state_graph("mermaid", level="full")
    for n, r in enumerate(records, 1):
        assert re.search(rf"^    {r[2]} --> {r[4]} : (\d+, )*{n}(, \d+)*: {r[3]}\b", mermaid, re.M), (n, r)
    assert f"class {failed} failed" in mermaid


def test_coarser_levels_number_the_steps_they_draw_and_name_the_folded_ones(crashed):
    """At the fit level the micro-batch steps fall inside the folded training stage: the drawn numbers are
    the record's steps whose ends are drawn apart, the legend names the others, and the folded box that
    holds the failed state is red. Without `level`, the failed state's own level is drawn."""
    t, error = crashed
    records = error.deepepochs_flight_record[-12:]
    fit = t.state_graph("dot", level="fit")
    drawn = _numbered(fit)
    assert sorted(drawn) == [11, 12] and drawn[11] == ("group_stage_train", "interrupt", "rollback")
    assert "steps 1-10 ran inside a folded box" in fit
    assert re.search(r'^  group_stage_train \[[^\n]*fillcolor="#ff8080"', fit, re.M)
    auto = t.state_graph("dot")
    assert "level batch" in auto and sorted(_numbered(auto)) == list(range(1, 13))
    assert len(records) == 12


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' is not installed here")
@pytest.mark.parametrize("level", LEVELS)
def test_a_crash_drawing_is_as_readable_as_the_static_one(crashed, level):
    """The numbered path, the gap and the rollback edges keep the layout free of overlaps and crossings."""
    t, _ = crashed
    assert problems(layout_of(run_dot(t.state_graph("dot", level=level), "json"))) == []


def _cli(args, capsys):
    """`python -m deepepochs graph ARGS`, run in this process: (exit status, stdout, stderr)."""
    code = main(["graph", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_graph_flight_draws_a_saved_record_or_a_log_like_the_trainer(crashed, tmp_path, capsys):
    """`graph --flight` on the JSON of `save_flight_record` and on a log holding the error's notes draws the
    same DOT as `trainer.state_graph` at the same level."""
    t, error = crashed
    expected = t.state_graph("dot", level="full")
    save_flight_record(error, tmp_path / "crash.json")
    log = tmp_path / "job.log"
    log.write_text("Traceback (most recent call last):\n  ...\nFloatingPointError: ...\n" + "\n".join(error.__notes__))
    for source in (tmp_path / "crash.json", log):
        code, out, err = _cli(["--flight", str(source), "--level", "full", "--format", "dot"], capsys)
        assert code == 0, err
        assert out == expected, source
    _, auto, _ = _cli(["--flight", str(tmp_path / "crash.json"), "--format", "dot"], capsys)
    assert "level batch" in auto  # the failed state's level


def test_a_flight_file_without_transitions_is_refused_with_a_clear_error(tmp_path, capsys):
    """An unrelated file names the file and the expected content; the command line prints one line, exit 2."""
    bad = tmp_path / "notes.txt"
    bad.write_text("nothing here\n")
    with pytest.raises(ConfigError, match=r"notes.txt' holds no transitions: expected the JSON"):
        read_flight_record(bad)
    code, out, err = _cli(["--flight", str(bad)], capsys)
    assert code == 2 and not out and len(err.strip().splitlines()) == 1 and "notes.txt" in err
    other = tmp_path / "other.log"
    other.write_text("  epoch 1 batch 2: window_open --warp_step--> task_train\n")
    with pytest.raises(ConfigError, match=r"names \['warp_step'\], which this version's loop does not have"):
        read_flight_record(other)


def test_a_bad_path_length_or_level_is_refused_by_state_graph(crashed):
    """`last` must be a non-negative int and `level` one of the levels; the errors say what was received."""
    t, _ = crashed
    with pytest.raises(ConfigError, match=r"last must be an int >= 0 \(got -1\)"):
        t.state_graph("dot", last=-1)
    with pytest.raises(ConfigError, match=r"level must be one of 'fit', .* \(got 'optimize'\)"):
        t.state_graph("dot", level="optimize")
    assert "blue numbers" not in t.state_graph("dot", last=0)  # no path: the plain graph, failed state unknown
