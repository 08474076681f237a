"""Render a `Spec` into the committed, generated modules of the package.

Two files come out: `tables.py` (states, triggers, guards, actions, edges, hooks as plain literals the
runtime loads without importing `spec/`) and `events.py` (the `Event` enum, the hook methods of `Callback`
and the `StateName`, `TriggerName`, `GuardName`, `ActionName` enums, each member with the spec's one-line
doc). `python -m spec` writes them; `python -m spec --check` exits non-zero when they differ from what the
spec renders.
"""

from __future__ import annotations

import pprint
import textwrap
from collections.abc import Mapping
from pathlib import Path

from deepepochs.fsm.schema import Spec

__all__ = ["render_events", "render_micro_batch", "render_tables", "write_or_check"]

HEADER = (
    '"""GENERATED from spec/loop.py by `make gen` (python -m spec): do not edit by hand."""\n\n'
    "# fmt: off\n"
)


def _literal(name: str, value) -> str:
    return f"{name} = {pprint.pformat(value, width=110, sort_dicts=False)}\n"


def render_tables(spec: Spec) -> str:
    """The source text of `deepepochs/fsm/tables.py`."""
    parts = [
        HEADER,
        '__all__ = ["ACTIONS", "GUARDS", "HOOKS", "INITIAL", "INTERRUPT", "ROLLBACK", "STATES",'
        ' "TRANSITIONS", "TRIGGERS"]\n\n',
        _literal("INITIAL", spec.initial),
        _literal("ROLLBACK", spec.rollback),
        _literal("INTERRUPT", spec.interrupt),
        "\n# (name, layer, idle, running, cost, doc)\n",
        _literal("STATES", tuple((s.name, s.layer, s.idle, s.running, s.cost, s.doc) for s in spec.states)),
        "\n# (name, hot, doc)\n",
        _literal("TRIGGERS", tuple((t.name, t.hot, t.doc) for t in spec.triggers)),
        "\n# (name, doc)\n",
        _literal("GUARDS", tuple((g.name, g.doc) for g in spec.guards)),
        "\n# (name, commit, after_commit, cost, doc)\n",
        _literal("ACTIONS", tuple((a.name, a.commit, a.after_commit, a.cost, a.doc) for a in spec.actions)),
        "\n# (trigger, source, dest, conditions, unless, actions, error, fuses, assuming, doc)\n",
        _literal("TRANSITIONS", tuple(
            (t.trigger, t.source, t.dest, t.conditions, t.unless, t.actions, t.error, t.fuses, t.assuming, t.doc)
            for t in spec.transitions
        )),
        "\n# (name, args, states, after, before, doc)\n",
        _literal("HOOKS", tuple((h.name, h.args, h.states, h.after, h.before, h.doc) for h in spec.hooks)),
    ]
    return "".join(parts)


def _docstring(doc: str, indent: str) -> str:
    """A one-line spec doc as a docstring at `indent`, wrapped to ruff's 120 columns where it is longer."""
    return textwrap.fill(f'"""{doc}"""', width=120, initial_indent=indent, subsequent_indent=indent,
                         break_long_words=False, break_on_hyphens=False) + "\n"


def _member(hook_name: str) -> str:
    return hook_name.removeprefix("on_").upper()


def _name_enums(spec: Spec) -> list[tuple[str, str, tuple]]:
    """(enum class, what its values name, the spec's records), in the order events.py defines them."""
    return [("StateName", "states", spec.states), ("TriggerName", "triggers", spec.triggers),
            ("GuardName", "guards", spec.guards), ("ActionName", "actions", spec.actions)]


def _enum(name: str, doc: str, members: list[tuple[str, str, str]], plain: bool = False) -> list[str]:
    """A `str` Enum's source lines: one `MEMBER = 'value'` line and one docstring line per member. `plain`:
    a member prints as its value (`str`, f-strings), so the names the engine passes to the machine read in
    flight records and messages as the spec writes them."""
    lines = [f"class {name}(str, enum.Enum):\n", f'    """{doc}"""\n\n']
    if plain:
        lines += ["    __str__ = str.__str__\n", "    __format__ = str.__format__\n\n"]
    for member, value, member_doc in members:
        lines.append(f"    {member} = {value!r}\n")
        lines.append(_docstring(member_doc, "    "))
    return lines


def render_events(spec: Spec) -> str:
    """The source text of `deepepochs/fsm/events.py`."""
    enums = _name_enums(spec)
    names = ", ".join(f'"{n}"' for n in sorted(["CallbackHooks", "Event", *(cls for cls, _, _ in enums)]))
    lines = [
        HEADER,
        "import enum\n\n",
        f"__all__ = [{names}]\n\n\n",
        *_enum("Event", "Loop events; each value is the name of the `Callback` method that handles it.",
               [(_member(h.name), h.name, h.doc) for h in spec.hooks]),
    ]
    for cls, kind, records in enums:
        lines.append("\n\n")
        lines += _enum(cls, f"Names of the loop's {kind}; each value is the name `spec/loop.py` gives it.",
                       [(r.name.upper(), r.name, r.doc) for r in records], plain=True)
    lines += [
        "\n\nclass CallbackHooks:\n",
        '    """One no-op method per loop event; `Callback` subclasses override the ones they need.\n\n'
        "    `before` hooks run in callback registration order, `after` hooks in reverse order.\n"
        '    """\n',
    ]
    for h in spec.hooks:
        args = "".join(f", {a}" for a in h.args)
        lines.append(f"\n    def {h.name}(self, trainer{args}):\n")
        lines.append(_docstring(h.doc, "        "))
    return "".join(lines)


def render_micro_batch(spec: Spec, code: Mapping[str, str] | None = None) -> str:
    """The source text of `docs/micro-batch.md`: the edges a training micro-batch takes, in order, with
    the guard each edge needs, its actions (commit points marked) and the hooks the spec fires just before
    and after it. Fused or every-edge, these are the same edges and the same action functions. `code`:
    `{configuration: the compiled micro-batch's source}` (`deepepochs.engine.compiled.generate_all`),
    shown after the tables."""
    commit = {a.name for a in spec.actions if a.commit}
    action_doc = {a.name: a.doc for a in spec.actions}
    train_hooks = [h for h in spec.hooks if "_val_" not in h.name and "_test_" not in h.name]

    def fired(hop) -> str:
        """The hooks the spec fires just before this hop (`Hook.before`) and just after it (`Hook.after`)."""
        before = [f"before: `{h.name}`" for h in train_hooks if h.before == hop.trigger and hop.source in h.states]
        after = [f"after: `{h.name}`" for h in train_hooks if h.after == hop.trigger and hop.dest in h.states]
        return ", ".join(before + after) or "—"

    fused = {t.trigger: t for t in spec.transitions if t.fuses}
    lines = [
        "# Life of a training micro-batch\n\n",
        "<!-- GENERATED from spec/loop.py by `make gen` (python -m spec): do not edit by hand. -->\n\n",
        "Each table is one fused edge's path: the hops a micro-batch takes, whether the batch loop fires them\n"
        "one by one (`fuse_steps=False`, a custom step, several optimizers, or a callback hook inside the\n"
        "micro-batch) or runs the code compiled from these paths for its configuration, which records the\n"
        "fused edge (shown below the tables). Every action is one function of `deepepochs/engine/actions.py`;\n"
        "**commit** marks a commit point (rollback returns to the last one). Between the hops the step runs:\n"
        "forward and loss before `backward`, backward and the metric patches before `optimize`.\n",
    ]
    for trigger, edge in fused.items():  # every fused edge, in spec order, described by the spec
        lines.append(f"\n## `{edge.source} --{trigger}--> {edge.dest}`: {edge.doc}\n\n")
        lines.append("| # | trigger | from → to | guards | actions | hooks fired before / after the edge |\n")
        lines.append("|---|---|---|---|---|---|\n")
        for i, hop in enumerate(spec.fused_path(edge), start=1):
            acts = ", ".join(f"`{a}` (**commit**)" if a in commit else f"`{a}`" for a in hop.actions) or "—"
            guards = hop.guard_label.strip("[]") or "—"
            lines.append(f"| {i} | `{hop.trigger}` | {hop.source} → {hop.dest} | {guards} | {acts} | {fired(hop)} |\n")
    lines.append("\n## Actions\n\n")
    for name in dict.fromkeys(a for edge in fused.values() for hop in spec.fused_path(edge) for a in hop.actions):
        lines.append(f"- `{name}`{' (commit)' if name in commit else ''}: {action_doc[name]}\n")
    for configuration, source in (code or {}).items():
        lines.append(f"\n## The compiled micro-batch: {configuration}\n\n")
        lines.append("Each hop is a comment naming its edge, the state move, and its actions; an action this\n"
                     "configuration makes do nothing is a comment saying why.\n\n")
        lines.append(f"```python\n{source}```\n")
    return "".join(lines)


def write_or_check(spec: Spec, package_dir: Path, check: bool, code: Mapping[str, str] | None = None) -> list[Path]:
    """Write the generated modules (and `docs/micro-batch.md` beside the package in a checkout, with the
    compiled micro-batch sources `code`, see `render_micro_batch`), or with `check` return those that are
    stale (and write nothing)."""
    targets = {
        package_dir / "fsm" / "tables.py": render_tables(spec),
        package_dir / "fsm" / "events.py": render_events(spec),
    }
    docs = package_dir.parent / "docs"
    if docs.is_dir():
        targets[docs / "micro-batch.md"] = render_micro_batch(spec, code)
    stale = [p for p, text in targets.items() if not p.exists() or p.read_text() != text]
    if not check:
        for path in stale:
            path.write_text(targets[path])
    return stale
