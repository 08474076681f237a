"""Draw the loop machine as Graphviz DOT, Mermaid text, or (with the `dot` binary) PNG/SVG.

The graph is drawn from the edges of the built `transitions` machine, grouped by layer, with guards on the
edges (`trigger [guard, !other]`). Drawn from a live or crashed trainer, the current state is filled and
the last transitions are highlighted. The `interrupt` edges (one per running state) are folded into one
note so the picture stays readable; `show_interrupts=True` draws them all. A fused edge is labelled with
the first and last trigger of the path it stands for and the guard outcomes along it (dashed in DOT).
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
    spec, edges = _static_machine_edges()
    fused = {(t.source, t.trigger): t for t in spec.transitions if t.fuses}
    out = []
    for source, trigger, dest, conds, unless, _actions, _error in edges:
        if trigger == spec.interrupt and not show_interrupts:
            continue
        label = _label(trigger, conds, unless)
        if (source, trigger) in fused:
            edge = fused[source, trigger]
            # the guard outcomes along the path: what tells update_step and skip_step apart
            used = sorted({g for e in spec.fused_path(edge) for g in (*e.conditions, *e.unless)})
            guards = ", ".join(g if g in edge.assuming else f"!{g}" for g in used)
            label = f"{trigger} = {edge.fuses[0]} ... {edge.fuses[-1]} [{guards}] (fused)"
        out.append((source, trigger, dest if dest is not None else "error", label))
    return spec, out


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
    if any(t == "error" for _, _, t, _ in edges):
        lines.append('  error [shape=octagon, color=red, label="InvalidTransition"];')
    for source, trigger, dest, label in edges:
        style = ", color=blue, penwidth=2" if (source, trigger, dest) in hot else ""
        if label.endswith("(fused)"):
            style += ", style=dashed"
        lines.append(f'  {source} -> {dest} [label="{label}"{style}];')
    if not show_interrupts:
        lines.append('  note [shape=note, label="every running state --interrupt--> rollback"];')
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
    for source, trigger, dest, label in edges:
        mark = " (last)" if (source, trigger, dest) in hot else ""
        lines.append(f"    {source} --> {dest} : {label}{mark}")
    if not show_interrupts:
        lines.append("    note right of rollback : every running state --interrupt--> rollback")
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
