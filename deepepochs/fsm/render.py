"""Draw the loop machine as Graphviz DOT, Mermaid text, or (with the `dot` binary) PNG/SVG.

The graph is drawn from the edges of the built `transitions` machine, grouped by layer, with guards on the
edges (`trigger [guard, !other]`). Drawn from a live or crashed trainer, the current state is filled and
the last transitions are highlighted. The `interrupt` edges (one per running state) are folded into one
note so the picture stays readable; `show_interrupts=True` draws them all. A fused edge is labelled with
the first and last trigger of the path it stands for and the guard outcomes along it, and tagged `(fused)`
(dashed in DOT). An edge that commits (`Spec.commits`: rollback never undoes its work) is tagged `(commit)`
(bold green in DOT); a legend note explains the tags.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable, Sequence

from deepepochs.errors import ConfigError
from deepepochs.fsm.machine import build_machine, load_spec, machine_edges
from deepepochs.fsm.schema import LAYERS

__all__ = ["FORMATS", "render"]

FORMATS = ("mermaid", "dot", "png", "svg")


def _static_machine_edges():
    spec = load_spec()
    guards = {g.name: (lambda: False) for g in spec.guards}
    actions = {a.name: (lambda: None) for a in spec.actions}
    return spec, machine_edges(build_machine(spec, guards, actions))


def _label(trigger, conds, unless):
    parts = [*conds, *(f"!{u}" for u in unless)]
    return f"{trigger} [{', '.join(parts)}]" if parts else trigger


def _edges(show_interrupts: bool):
    """`(source, trigger, dest, label, fused, commit)` for every edge drawn; `dest` is "error" on error edges."""
    spec, edges = _static_machine_edges()
    fused = {(t.source, t.trigger): t for t in spec.transitions if t.fuses}
    commit_actions = {a.name for a in spec.actions if a.commit}
    out = []
    for source, trigger, dest, conds, unless, actions, _error in edges:
        if trigger == spec.interrupt and not show_interrupts:
            continue
        label = _label(trigger, conds, unless)
        edge = fused.get((source, trigger))
        if edge is not None:
            # the guard outcomes along the path: what tells update_step and skip_step apart
            used = sorted({g for e in spec.fused_path(edge) for g in (*e.conditions, *e.unless)})
            guards = ", ".join(g if g in edge.assuming else f"!{g}" for g in used)
            label = f"{trigger} = {edge.fuses[0]} ... {edge.fuses[-1]} [{guards}]"
            commit = spec.commits(edge)
        else:
            commit = any(a in commit_actions for a in actions)
        tags = [tag for tag, on in (("fused", edge is not None), ("commit", commit)) if on]
        if tags:
            label += f" ({', '.join(tags)})"
        out.append((source, trigger, dest if dest is not None else "error", label, edge is not None, commit))
    return spec, out


def _legend(show_interrupts: bool, dot: bool) -> list[str]:
    """The lines of the legend note: the folded interrupt edges, the label tags and (DOT) their edge styles."""
    lines = [] if show_interrupts else ["every running state --interrupt--> rollback"]
    fused, commit = (", dashed", ", bold green") if dot else ("", "")
    return [*lines, f"(fused){fused}: one edge for a whole path of hot edges",
            f"(commit){commit}: rollback never undoes what this edge did"]


def to_dot(current: str | None = None, recent: Sequence[tuple[str, str, str]] = (),
           show_interrupts: bool = False) -> str:
    """Graphviz DOT text. `recent` holds `(source, trigger, dest)` of the last transitions."""
    spec, edges = _edges(show_interrupts)
    hot = {(s, t, d) for s, t, d in recent}
    lines = ["digraph deepepochs_loop {", '  rankdir=TB; node [shape=box, style="rounded", fontsize=10];',
             "  edge [fontsize=9];"]
    for layer in LAYERS:  # one row per layer, outermost on top
        states = [s for s in spec.states if s.layer == layer]
        lines.append(f"  subgraph layer_{layer} {{ rank=same;")
        lines.append(f'    layer_{layer}_label [shape=plaintext, label="{layer}", fontcolor=gray40];')
        for s in states:
            attrs_ = [f'tooltip="{s.doc}"']
            if s.name == current:
                attrs_.append('style="rounded,filled", fillcolor=salmon, color=red, penwidth=2')
            lines.append(f"    {s.name} [{', '.join(attrs_)}];")
        lines.append("  }")
    labels = [f"layer_{layer}_label" for layer in LAYERS]
    lines.append(f"  {' -> '.join(labels)} [style=invis];")
    if any(dest == "error" for _, _, dest, *_ in edges):
        lines.append('  error [shape=octagon, color=red, label="InvalidTransition"];')
    for source, trigger, dest, label, fused, commit in edges:
        styles = [s for s, on in (("dashed", fused), ("bold", commit)) if on]
        attrs_ = [f'label="{label}"']
        if (source, trigger, dest) in hot:  # the last transitions: blue wins over the commit colour
            attrs_.append("color=blue, penwidth=2")
        elif commit:
            attrs_.append("color=darkgreen")
        if styles:
            attrs_.append(f'style="{",".join(styles)}"')
        lines.append(f"  {source} -> {dest} [{', '.join(attrs_)}];")
    legend = "".join(f"{line}\\l" for line in _legend(show_interrupts, dot=True))  # \l: a left-justified line
    lines.append(f'  legend [shape=note, label="{legend}"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def to_mermaid(current: str | None = None, recent: Sequence[tuple[str, str, str]] = (),
               show_interrupts: bool = False) -> str:
    """Mermaid `stateDiagram-v2` text; the current state gets the `current` class."""
    spec, edges = _edges(show_interrupts)
    lines = ["stateDiagram-v2", f"    [*] --> {spec.initial}"]
    for layer in LAYERS:
        lines.append(f"    %% layer: {layer}: " + ", ".join(s.name for s in spec.states if s.layer == layer))
    hot = {(s, t, d) for s, t, d in recent}
    for source, trigger, dest, label, _fused, _commit in edges:  # stateDiagram edges take no style: tags
        mark = " (last)" if (source, trigger, dest) in hot else ""
        lines.append(f"    {source} --> {dest} : {label}{mark}")
    lines += ["    note right of rollback", *(f"        {line}" for line in _legend(show_interrupts, dot=False)),
              "    end note"]
    if current:
        lines += ["    classDef current fill:salmon,stroke:red,stroke-width:2px", f"    class {current} current"]
    return "\n".join(lines) + "\n"


def render(fmt: str = "mermaid", current: str | None = None,
           recent: Iterable[tuple[str, str, str]] = (), show_interrupts: bool = False) -> str | bytes:
    """Render the state graph in `fmt` (one of `FORMATS`); PNG/SVG need the Graphviz `dot` binary."""
    if fmt not in FORMATS:
        raise ConfigError(f"format must be one of {', '.join(map(repr, FORMATS))} (got {fmt!r})")
    recent = list(recent)
    if fmt == "mermaid":
        return to_mermaid(current, recent, show_interrupts)
    dot_text = to_dot(current, recent, show_interrupts)
    if fmt == "dot":
        return dot_text
    exe = shutil.which("dot")
    if exe is None:
        raise ConfigError(
            f"format {fmt!r} needs the Graphviz 'dot' binary, which is not on PATH; install Graphviz"
            " (e.g. `apt-get install graphviz`) or use format='dot' or 'mermaid'"
        )
    return subprocess.run([exe, f"-T{fmt}"], input=dot_text.encode(), capture_output=True, check=True).stdout
