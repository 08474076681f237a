"""Draw the loop machine as Graphviz DOT, Mermaid text, or (with the `dot` binary) PNG/SVG.

The graph is drawn from the edges of the built `transitions` machine, one level at a time
(`drawing.LEVELS`: `fit`, `epoch`, `task`, `batch`, or `full`), with guards on the edges
(`trigger [guard, !other]`). Drawn from a live trainer, the current state is filled; drawn from a crash
(a trainer's flight record or a saved one), the last transitions are numbered 1, 2, ... on the edges they
took, the state that failed is red, and a green edge leads from rollback to the last commit point.

Readable by construction (the layout test reads Graphviz's own coordinates): DOT puts each edge's label
in a node of its own (`src -> label -> dst`), so Graphviz places labels like states, and neither they
nor the states overlap or sit on a line; long labels break on their guard alternatives; fused edges are
dashed and commit edges green, explained in a legend instead of long tags; the `interrupt` edges (one per
running state) are one legend line unless `show_interrupts=True`.
"""

from __future__ import annotations

import html
import shutil
import subprocess
from collections.abc import Iterable, Mapping

from deepepochs.errors import ConfigError
from deepepochs.fsm.drawing import LEVELS, Drawing, Group, Line, auto_level, build_drawing
from deepepochs.fsm.machine import build_machine, load_spec, machine_edges

__all__ = ["FORMATS", "LEVELS", "auto_level", "drawing", "heat_colour", "render", "to_dot", "to_mermaid"]

FORMATS = ("mermaid", "dot", "png", "svg")
PATH_COLOUR, COMMIT_COLOUR, FAILED_COLOUR = "blue", "darkgreen", "red"


def _static_machine_edges():
    spec = load_spec()
    guards = {g.name: (lambda: False) for g in spec.guards}
    actions = {a.name: (lambda: None) for a in spec.actions}
    return spec, machine_edges(build_machine(spec, guards, actions))


def drawing(level: str = "full", current: str | None = None, path: Iterable[tuple] = (),
            show_interrupts: bool = False, heat: Mapping[str, float] | None = None) -> Drawing:
    """The `Drawing` (nodes, labelled edge groups, numbered path, heat) of `level`; see `render`."""
    spec, edges = _static_machine_edges()
    return build_drawing(spec, edges, level, current=current, path=[tuple(r) for r in path],
                         show_interrupts=show_interrupts, heat=heat)


def heat_colour(share: float) -> str:
    """The fill of a node with `share` of the run's time: white at 0, through orange, to red at the whole."""
    level = min(max(share, 0.0), 1.0) ** 0.5  # a root scale: a few percent already shows
    green, blue = int(255 - 175 * level), int(255 - 255 * level)
    return f"#ff{green:02x}{blue:02x}"


def _share(share: float) -> str:
    return f"{100 * share:.1f} %" if share >= 0.001 else "<0.1 %"


# ---- DOT ----
def _numbers(line: Line) -> str:
    return ", ".join(map(str, line.steps))


def _html_line(line: Line) -> list[str]:
    """A label's rows for one line: the trigger (with its path numbers) and, below it, one guard
    alternative per row, so that no label grows wide."""
    colour = COMMIT_COLOUR if line.commit else ("firebrick" if line.error else "black")
    head = f'<FONT COLOR="{colour}">{html.escape(line.trigger)}</FONT>'
    if line.steps:
        head = f'<FONT COLOR="{PATH_COLOUR}"><B>{_numbers(line)}:</B></FONT> {head}'
    rows = [head]
    alts = list(dict.fromkeys(line.guards))
    if alts and "" not in alts:
        rows += [f"  {html.escape(alt)}{' or' if i < len(alts) - 1 else ''}" for i, alt in enumerate(alts)]
    return rows


def _rows(rows: list[str], size: int = 9) -> str:
    body = "".join(f'{row}<BR ALIGN="LEFT"/>' for row in rows)
    return f'<<FONT POINT-SIZE="{size}">{body}</FONT>>'


def _edge_attrs(group: Group) -> list[str]:
    attrs_ = []
    if group.synthetic == "gap":
        attrs_ += [f"color={PATH_COLOUR}", 'style="dotted"', "penwidth=1.5"]
    elif group.synthetic == "resume":
        attrs_ += [f"color={COMMIT_COLOUR}", 'style="dashed"', "penwidth=1.5"]
    else:
        if any(line.steps for line in group.lines):
            attrs_ += [f"color={PATH_COLOUR}", "penwidth=2"]
        elif all(line.commit for line in group.lines):
            attrs_.append(f"color={COMMIT_COLOUR}")
        if all(line.fused for line in group.lines):
            attrs_.append('style="dashed"')
    return attrs_


def to_dot(d: Drawing) -> str:
    """Graphviz DOT text of a drawing: states as rounded boxes, each edge's label as a node of its own."""
    spec = load_spec()
    title = f"deepepochs loop, level {d.level}" if d.level != "full" else "deepepochs loop, every state"
    lines = ["digraph deepepochs_loop {",
             f'  graph [rankdir=TB, nodesep=0.25, ranksep=0.22, fontname="Helvetica", fontsize=12,'
             f' labelloc=t, label="{title}"];',
             '  node [shape=box, style="rounded", fontname="Helvetica", fontsize=10, margin="0.1,0.04"];',
             '  edge [arrowsize=0.6, color=gray35];']
    for node in d.nodes:
        attrs_ = [f'tooltip="{html.escape(node.doc)}"']
        label = node.label.replace("\n", "\\n")
        if node.summary:
            attrs_.append(f'label="{label}", style="rounded,dashed", color=gray40, fontcolor=gray25')
        if node.id == "error":
            attrs_ = [f'label="{label}", shape=octagon, color=firebrick, fontcolor=firebrick']
        if node.id in d.heat:
            share = d.heat[node.id]
            attrs_ = [a for a in attrs_ if not a.startswith("label=")]
            style = "rounded,filled,dashed" if node.summary else "rounded,filled"
            attrs_.append(f'label="{label}\\n{_share(share)}", style="{style}", fillcolor="{heat_colour(share)}"')
        if node.id == d.failed:
            fill = 'style="rounded,filled,bold", fillcolor="#ff8080", color=red, penwidth=2.5'
            attrs_.append(fill + (", peripheries=2" if node.summary else ""))
        elif node.id == d.current:
            attrs_.append('style="rounded,filled", fillcolor=salmon, color=red, penwidth=2')
        if node.id == spec.initial:
            attrs_.append("peripheries=2")
        lines.append(f"  {node.id} [{', '.join(attrs_)}];")
    for i, group in enumerate(d.groups):
        label_id = f"e{i}"
        if group.synthetic:
            text = _rows([f"<I>{html.escape(group.note)}</I>"], size=8)
        else:
            text = _rows([row for line in group.lines for row in _html_line(line)])
        lines.append(f"  {label_id} [shape=plaintext, margin=0.02, label={text}];")
        attrs_ = _edge_attrs(group)
        tail = ", ".join(["arrowhead=none", *attrs_])
        lines.append(f"  {group.source} -> {label_id} [{tail}];")
        lines.append(f"  {label_id} -> {group.dest}" + (f" [{', '.join(attrs_)}];" if attrs_ else ";"))
    legend = [html.escape(row) for row in d.legend]
    if d.steps:
        legend.append("")
        for n, epoch, batch, source, trigger, dest in d.steps:
            legend.append(html.escape(f"{n:>2}  epoch {epoch} batch {batch}: {source} --{trigger}--> {dest}"))
    lines.append(f"  legend [shape=note, margin=0.1, color=gray50, label={_rows(legend, size=8)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


# ---- Mermaid ----
def to_mermaid(d: Drawing) -> str:
    """Mermaid `stateDiagram-v2` text of a drawing (one edge per line of a label; Mermaid lays it out)."""
    spec = load_spec()
    lines = ["stateDiagram-v2", f"    %% deepepochs loop, level {d.level}"]
    ids = {n.id for n in d.nodes}
    if spec.initial in ids:
        lines.append(f"    [*] --> {spec.initial}")
    for node in d.nodes:
        label = node.label.replace(chr(10), " ")
        if node.id in d.heat:
            lines.append(f'    state "{label} ({_share(d.heat[node.id])})" as {node.id}')
        elif node.summary or node.id == "error":
            lines.append(f'    state "{label}" as {node.id}')
    for group in d.groups:
        if group.synthetic:
            lines.append(f"    {group.source} --> {group.dest} : {group.note}")
            continue
        for line in group.lines:
            tags = [tag for tag, on in (("fused", line.fused), ("commit", line.commit)) if on]
            text = line.text + (f" ({', '.join(tags)})" if tags else "")
            if line.steps:
                text = f"{_numbers(line)}: {text}"
            lines.append(f"    {group.source} --> {group.dest} : {text}")
    legend = [row.replace("dashed: a fused", "(fused): a fused").replace("green: commits", "(commit): commits")
              for row in d.legend]
    lines += [f"    note right of {spec.rollback}", *(f"        {row}" for row in legend), "    end note"]
    for i, (node_id, share) in enumerate(d.heat.items()):
        lines += [f"    classDef heat{i} fill:{heat_colour(share)}", f"    class {node_id} heat{i}"]
    if d.failed:
        lines += ["    classDef failed fill:#ff8080,stroke:red,stroke-width:3px", f"    class {d.failed} failed"]
    elif d.current:
        lines += ["    classDef current fill:salmon,stroke:red,stroke-width:2px", f"    class {d.current} current"]
    return "\n".join(lines) + "\n"


def render(fmt: str = "mermaid", current: str | None = None, path: Iterable[tuple] = (),
           show_interrupts: bool = False, level: str = "full", heat: Mapping[str, float] | None = None) -> str | bytes:
    """Render the state graph of `level` in `fmt` (one of `FORMATS`); PNG/SVG need the Graphviz `dot` binary.

    Args:
        fmt: 'mermaid', 'dot', 'png' or 'svg'.
        current: a live trainer's state, highlighted.
        path: the last transitions `(epoch, batch, source, trigger, dest)`, oldest first (a flight record),
            numbered 1, 2, ... on the edges they took; an `interrupt` among them marks the failed state.
        show_interrupts: draw each running state's interrupt edge instead of one legend line.
        level: 'fit', 'epoch', 'task', 'batch' (adjacent layers of the loop, the rest folded) or 'full'.
        heat: `{state: share of a profiled run's time}`: states shaded and labelled by it (a heat map).
    """
    if fmt not in FORMATS:
        raise ConfigError(f"format must be one of {', '.join(map(repr, FORMATS))} (got {fmt!r})")
    d = drawing(level, current, path, show_interrupts, heat)
    if fmt == "mermaid":
        return to_mermaid(d)
    dot_text = to_dot(d)
    if fmt == "dot":
        return dot_text
    return run_dot(dot_text, fmt)


def run_dot(dot_text: str, fmt: str) -> bytes:
    """Graphviz's `dot -T<fmt>` output for `dot_text` (e.g. 'png', 'svg', 'json')."""
    exe = shutil.which("dot")
    if exe is None:
        raise ConfigError(
            f"format {fmt!r} needs the Graphviz 'dot' binary, which is not on PATH; install Graphviz"
            " (e.g. `apt-get install graphviz`) or use format='dot' or 'mermaid'"
        )
    return subprocess.run([exe, f"-T{fmt}"], input=dot_text.encode(), capture_output=True, check=True).stdout
