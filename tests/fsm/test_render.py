"""The state graph, level by level, readable by construction (checked on Graphviz's own layout), and
the committed pictures in docs/ are the ones the spec renders (`make graph` refreshes them)."""

import re
import shutil
from pathlib import Path

import pytest
from graph_layout import layout_of, problems

from deepepochs.errors import ConfigError
from deepepochs.fsm.drawing import LEVELS
from deepepochs.fsm.machine import load_spec
from deepepochs.fsm.render import drawing, render, run_dot
from deepepochs.fsm.schema import LAYERS

DOCS = Path(__file__).resolve().parents[2] / "docs"
needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' is not installed here")


@pytest.mark.parametrize("fmt, name", [("mermaid", "state-graph.mmd"), ("dot", "state-graph.dot")])
def test_committed_diagrams_are_current(fmt, name):
    """docs/state-graph.* (every state) equal what the spec renders now; run `make graph` after editing it."""
    assert (DOCS / name).read_text() == render(fmt)


@pytest.mark.parametrize("level", LEVELS)
def test_committed_level_pictures_show_what_the_spec_renders_now(level):
    """docs/img/state-graph-<level>.svg holds exactly the nodes and edges of the level's current DOT (its
    SVG titles), so a spec change without `make graph` fails here."""
    svg = (DOCS / "img" / f"state-graph-{level}.svg").read_text()
    titles = set(re.findall(r"<title>(.*?)</title>", svg)) - {"deepepochs_loop"}
    dot = render("dot", level=level)
    nodes = set(re.findall(r"^  (\w+) \[", dot, re.M)) - {"graph", "node", "edge"}
    edges = {f"{a}&#45;&gt;{b}" for a, b in re.findall(r"^  (\w+) -> (\w+)", dot, re.M)}
    assert titles == nodes | edges


def test_levels_are_windows_of_the_spec_layers_and_fold_the_rest():
    """Each level draws the states of its layers (and rollback) one by one; every other state is inside
    exactly one dashed summary node, and no edge is drawn inside a folded group."""
    spec = load_spec()
    assert LEVELS["full"] == LAYERS and all(set(layers) <= set(LAYERS) for layers in LEVELS.values())
    for level, layers in LEVELS.items():
        d = drawing(level)
        shown = sorted(s.name for s in spec.states if s.layer in (*layers, "rollback"))
        assert sorted(n.id for n in d.nodes if not n.summary and n.id != "error") == shown
        folded = [s for n in d.nodes if n.summary for s in n.states]
        assert sorted(folded) == sorted(s.name for s in spec.states if s.name not in shown)
        assert all(not (g.source == g.dest and g.source.startswith("group_")) for g in d.groups)
    assert "epoch_running" in {n.id for n in drawing("fit").nodes}  # the fit view shows the epoch's states
    assert {"step_forward", "optimize_unscaled"} <= {n.id for n in drawing("batch").nodes}


def _edge_lines(text):
    """Mermaid `src --> dst : label` lines as (src, dst, label)."""
    return [tuple(m) for m in re.findall(r"^    (\w+) --> (\w+) : (.*)$", text, re.M)]


def test_every_edge_of_the_spec_appears_in_the_full_mermaid_text_with_its_guards():
    """Each non-interrupt edge is drawn from its source to its dest under its trigger; its guards are on the
    line unless the trigger's alternatives there together always hold (e.g. `begin_batch`, whichever
    `window_boundary` is, goes to step_forward)."""
    spec = load_spec()
    lines = _edge_lines(render("mermaid"))
    for t in spec.transitions:
        if t.trigger == spec.interrupt:
            continue
        dest = t.dest or "error"
        drawn = [label for s, d, label in lines if s == t.source and d == dest
                 and label.split(" ")[0] == t.trigger]
        assert len(drawn) == 1, (t.source, t.trigger, dest, drawn)
        siblings = [e for e in spec.edges(t.source, t.trigger) if (e.dest or "error") == dest]
        if len(siblings) == 1 and t.guard_label and not t.fuses:
            assert drawn[0].split(" (")[0] == f"{t.trigger} {t.guard_label}", drawn[0]
    assert ("window_open", "step_forward", "begin_batch") in lines


def test_commit_edges_are_tagged_in_mermaid_and_green_in_dot():
    """A line holding a committing edge (fused ones included) is tagged `commit` in Mermaid and its trigger is
    green in DOT; no other line is; both legends explain it."""
    spec = load_spec()
    commits = {(t.source, t.trigger, t.dest) for t in spec.commit_edges()}
    mermaid, dot = render("mermaid"), render("dot")
    for source, dest, label in _edge_lines(mermaid):
        trigger = label.split(" ")[0]
        assert label.endswith("commit)") == ((source, trigger, dest) in commits), label
    green = set(re.findall(r'<FONT COLOR="darkgreen">(\w+)</FONT>', dot))
    assert green == {t for _, t, _ in commits}
    assert "(commit): commits" in mermaid and "green: commits" in dot


def test_show_interrupts_draws_every_interrupt_edge():
    """With show_interrupts=True the per-state interrupt edges are drawn instead of one legend line."""
    lines = _edge_lines(render("mermaid", show_interrupts=True))
    running = [s.name for s in load_spec().states if s.running]
    assert sorted(s for s, d, label in lines if label == "interrupt") == sorted(running)
    assert "every running state --interrupt--> rollback (not drawn)" in render("mermaid")


def test_an_unknown_format_or_level_is_refused():
    """The errors list the accepted values and what was received."""
    with pytest.raises(ConfigError, match=r"format must be one of 'mermaid', 'dot', 'png', 'svg' \(got 'gif'\)"):
        render("gif")
    with pytest.raises(ConfigError, match=r"level must be one of 'fit', 'epoch', 'task', 'batch', 'full' "
                                          r"\(got 'step'\)"):
        render("dot", level="step")


# ---- readable by construction: Graphviz's own layout ----
@needs_dot
@pytest.mark.parametrize("show_interrupts", [False, True])
@pytest.mark.parametrize("level", LEVELS)
def test_each_level_lays_out_without_overlaps_or_lines_through_labels_and_fits_a_screen(level, show_interrupts):
    """From `dot -Tjson`: no label or node overlaps another, no edge's curve crosses a label or a node it
    does not join, and width/height is between 1:2 and 2:1."""
    layout = layout_of(run_dot(render("dot", level=level, show_interrupts=show_interrupts), "json"))
    assert problems(layout) == []


@needs_dot
def test_the_layout_check_finds_the_collisions_of_edge_labels_on_self_loops():
    """The check is not vacuous: plain edge labels on three self-loops and on a wide row of edges (the
    previous drawing's style) are reported."""
    long = "window_step = begin_window ... end_batch [grads_finite, window_boundary] (fused, commit)"
    dot = ("digraph g { rankdir=TB; {rank=same; a; b; c; d; e; f}"
           + "".join(f' a -> a [label="{long} {i}"];' for i in range(3))
           + "".join(f' a -> {x} [label="{long}"]; {x} -> a [label="{long}"];' for x in "bcdef") + " }")
    found = problems(layout_of(run_dot(dot, "json")))
    assert any("crosses label" in p for p in found) and any("aspect ratio" in p for p in found), found
