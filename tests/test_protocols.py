"""The protocols of `deepepochs.protocols` match the classes that implement them and cover what the engine uses."""

import ast
import inspect
import pathlib
import textwrap

import pytest

import deepepochs
from deepepochs import protocols
from deepepochs.callbacks import CheckCallback, EMACallback, GradClipCallback, SnapshotCallback, SWACallback
from deepepochs.callbacks.base import HookTable
from deepepochs.engine.context import Parts
from deepepochs.parallel.ddp import DDPPolicy
from deepepochs.parallel.fsdp import FSDPPolicy
from deepepochs.parallel.single import SingleProcess
from deepepochs.reporting.console import Console
from deepepochs.training.optim import Optimizers
from deepepochs.training.precision import Precision

PACKAGE = pathlib.Path(deepepochs.__file__).parent

IMPLEMENTATIONS = [
    (protocols.DistPolicy, SingleProcess),
    (protocols.DistPolicy, DDPPolicy),
    (protocols.DistPolicy, FSDPPolicy),
    (protocols.PrecisionPolicy, Precision),
    (protocols.ConsoleLike, Console),
    (protocols.HookTableLike, HookTable),
    (protocols.OptimizerSet, Optimizers),
    (protocols.Monitor, CheckCallback),
    (protocols.Clipper, GradClipCallback),
    (protocols.SnapshotWriter, SnapshotCallback),
    (protocols.Averager, EMACallback),
    (protocols.Averager, SWACallback),
]

# The Parts fields typed by a protocol, and that protocol.
PART_PROTOCOLS = {"dist": protocols.DistPolicy, "precision": protocols.PrecisionPolicy,
                  "console": protocols.ConsoleLike, "hooks": protocols.HookTableLike, "opts": protocols.OptimizerSet}


def members(proto) -> dict:
    """A protocol's members: name -> the function it declares, or None for a data attribute."""
    found = {name: None for name in proto.__dict__.get("__annotations__", {})}
    for name, value in proto.__dict__.items():
        if name.startswith("_") and name not in ("__len__", "__getitem__"):
            continue
        if inspect.isfunction(value):
            found[name] = value
        elif isinstance(value, property):
            found[name] = None
    return found


def attributes_of(cls) -> set:
    """Everything an instance of `cls` has without building one: class attributes and methods along the
    MRO, plus each `self.<name> = ...` its methods assign (read from the source)."""
    names = set(dir(cls))
    for klass in cls.__mro__:
        if klass is object or not klass.__module__.startswith("deepepochs"):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for target in targets:
                for leaf in ast.walk(target):
                    if isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name) and leaf.value.id == "self":
                        names.add(leaf.attr)
    return names


@pytest.mark.parametrize(("proto", "cls"), IMPLEMENTATIONS, ids=lambda x: x.__name__)
def test_each_implementation_has_every_member_of_its_protocol_with_compatible_parameters(proto, cls):
    """A protocol names only what its implementations have, and a call the protocol allows fits theirs."""
    have = attributes_of(cls)
    missing = sorted(name for name in members(proto) if name not in have)
    assert not missing, f"{cls.__name__} lacks {missing} of {proto.__name__}"
    for name, declared in members(proto).items():
        if declared is None:
            continue
        real = inspect.signature(getattr(cls, name))
        wanted = [p for p in inspect.signature(declared).parameters.values() if p.name != "self"]
        required = [object()] * sum(p.default is inspect.Parameter.empty for p in wanted)
        real.bind(None, *required)  # the protocol's required arguments, by position
        real.bind(None, *[object()] * len(wanted))  # and every argument it declares
        for p in wanted:
            if p.default is not inspect.Parameter.empty:
                assert real.parameters[p.name].default is not inspect.Parameter.empty, \
                    f"{cls.__name__}.{name}: {p.name} is optional in {proto.__name__} but required here"


def _part_reads(tree: ast.AST):
    """(part field, member) for each `<...>.parts.<field>.<member>` read, and for each `<alias>.<member>` where
    the function assigned `<alias> = <...>.parts.<field>` (also in tuple assignments)."""
    def field_of(node):
        if isinstance(node, ast.Attribute) and node.attr in PART_PROTOCOLS and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "parts":
            return node.attr
        return None

    for func in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
        aliases = {}
        for node in ast.walk(func):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
                pairs = zip(target.elts, value.elts) if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) \
                    and len(target.elts) == len(value.elts) else [(target, value)]
                for t, v in pairs:
                    if isinstance(t, ast.Name) and field_of(v):
                        aliases[t.id] = field_of(v)
        for node in ast.walk(func):
            if not isinstance(node, ast.Attribute):
                continue
            field = field_of(node.value)
            if field is None and isinstance(node.value, ast.Name):
                field = aliases.get(node.value.id)
            if field is not None:
                yield field, node.attr, node.lineno


def test_the_engine_uses_nothing_of_a_part_beyond_its_protocol():
    """Every member of dist, precision, console, hooks and opts that engine code reads is in the protocol
    `Parts` types it with, so the protocol is the whole interface."""
    outside, seen = [], set()
    for path in sorted((PACKAGE / "engine").glob("*.py")):
        for field, member, line in _part_reads(ast.parse(path.read_text())):
            seen.add(field)
            if member not in members(PART_PROTOCOLS[field]):
                outside.append(f"{path.name}:{line} parts.{field}.{member}")
    assert not outside, f"engine reads beyond the protocols: {outside}"
    assert seen == set(PART_PROTOCOLS), "the scan found no read of some part: the scan itself is broken"


def test_parts_types_every_policy_field_with_its_protocol():
    """No field of `Parts` that holds a policy is typed `object`."""
    hints = {a.name: a.type for a in Parts.__attrs_attrs__}
    for field, proto in PART_PROTOCOLS.items():
        assert hints[field] in (proto.__name__, proto), field
    assert "object" not in [hints[name] for name in ("config", "facade")]


def test_monitors_are_found_by_a_monitor_id_string_in_declaration_order(tmp_path):
    """`monitors_in` keeps callbacks with a str `monitor_id`, in order, whatever their class; the checkpoint
    module's name is the same function."""
    from deepepochs import checkpoint

    class Duck:
        def __init__(self, monitor_id):
            self.monitor_id = monitor_id

    first = CheckCallback("loss", ckpt_dir=tmp_path)
    duck, not_a_monitor = Duck("custom"), Duck(3)
    found = protocols.monitors_in([GradClipCallback(1.0), duck, not_a_monitor, first])
    assert found == [duck, first]
    assert checkpoint.monitors_in is protocols.monitors_in


def test_protocols_imports_nothing_of_deepepochs():
    """The module sits below every layer, so it imports no deepepochs module."""
    tree = ast.parse((PACKAGE / "protocols.py").read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.startswith("deepepochs") or m.startswith(".")], imported
