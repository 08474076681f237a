"""FSM-6: the committed diagrams in docs/ are the ones the spec renders (`make graph` refreshes them)."""

from pathlib import Path

import pytest

from deepepochs.errors import ConfigError
from deepepochs.fsm.machine import load_spec
from deepepochs.fsm.render import render

DOCS = Path(__file__).resolve().parents[2] / "docs"


@pytest.mark.parametrize("fmt, name", [("mermaid", "state-graph.mmd"), ("dot", "state-graph.dot")])
def test_committed_diagrams_are_current(fmt, name):
    """docs/state-graph.* equal what the spec renders now; run `make graph` after editing the spec."""
    assert (DOCS / name).read_text() == render(fmt)


def test_every_edge_of_the_spec_appears_in_the_mermaid_text_with_its_guards():
    """Each non-interrupt edge is drawn, labelled with trigger and guards."""
    text = render("mermaid")
    spec = load_spec()
    for t in spec.transitions:
        if t.trigger == spec.interrupt:
            continue
        label = f"{t.trigger} {t.guard_label}".strip()
        assert f"{t.source} --> {t.dest or 'error'} : {label}" in text


def test_commit_edges_are_tagged_in_mermaid_and_bold_in_dot():
    """Every edge that commits (fused ones included) ends its label with the `commit` tag in both formats and
    is bold in DOT; no other edge does; both legends explain the tag."""
    spec = load_spec()
    mermaid, dot = render("mermaid").splitlines(), render("dot").splitlines()
    commits = spec.commit_edges()
    assert len([t for t in commits if t.fuses]) == 4
    for t in spec.transitions:
        if t.trigger == spec.interrupt:
            continue
        committed, dest = t in commits, t.dest or "error"
        tags = [tag for tag, on in (("fused", bool(t.fuses)), ("commit", committed)) if on]
        # a fused label is `trigger = first ... last [guards]`; a plain one `trigger [guards]`
        head = f"{t.trigger} = " if t.fuses else f"{t.trigger} {t.guard_label}".strip()
        tail = f" ({', '.join(tags)})" if tags else ""
        in_mermaid = [line.split(" : ", 1)[1] for line in mermaid
                      if line.startswith(f"    {t.source} --> {dest} : {head}")]
        in_dot = [line for line in dot if line.startswith(f'  {t.source} -> {dest} [label="{head}')]
        assert len(in_mermaid) == len(in_dot) == 1, (t.source, t.trigger, t.dest)
        assert in_mermaid[0].endswith(tail) and (t.fuses or in_mermaid[0] == head + tail), in_mermaid[0]
        assert f'{tail}"' in in_dot[0] and ("bold" in in_dot[0]) == committed, in_dot[0]
    assert any("(commit): rollback never undoes" in line for line in mermaid)
    assert any("(commit), bold green: rollback never undoes" in line for line in dot)


def test_show_interrupts_draws_every_interrupt_edge():
    """With show_interrupts=True the per-state interrupt edges are drawn instead of one note."""
    text = render("dot", show_interrupts=True)
    running = [s.name for s in load_spec().states if s.running]
    assert all(f"{name} -> rollback" in text for name in running)


def test_an_unknown_format_is_refused():
    """The error lists the accepted formats."""
    with pytest.raises(ConfigError, match=r"format must be one of 'mermaid', 'dot', 'png', 'svg' \(got 'gif'\)"):
        render("gif")
