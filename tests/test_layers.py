"""deepepochs has no import cycle, counting imports inside functions (the layers themselves are checked by
the import-linter contract in pyproject.toml, run by `make lint`)."""

import ast
import pathlib

import deepepochs

PACKAGE = pathlib.Path(deepepochs.__file__).parent

# Cycles still to remove, each with who removes it (none left). Compared exactly: once a cycle is gone,
# its line must go too, so the list cannot hide a cycle that comes back.
KNOWN_CYCLES: list = []


def module_files(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the package at `root` (a package is its __init__)."""
    found = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imports_of(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The package's modules that `name` imports anywhere in its file (module level, functions, classes,
    `if TYPE_CHECKING:` blocks): `import a.b`, `from a import b` (b a module, else a itself), relative
    imports resolved against the module's package."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` where c is an attribute
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    modules = module_files(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), each
    sorted: every import cycle lies inside one of them."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_deepepochs_has_no_import_cycle_counting_imports_inside_functions():
    """No two deepepochs modules import each other, directly or through others, anywhere in their code."""
    graph = import_graph(PACKAGE)
    assert len(graph) > 50 and graph["deepepochs.trainer"], "the scan found too little: it is broken"
    assert cycles(graph) == KNOWN_CYCLES


def test_the_scan_sees_imports_inside_functions_and_relative_imports(tmp_path):
    """On a package made here, the scan resolves relative and function-level imports and reports their cycle,
    and reports nothing once the function-level import is gone."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from . import low\n")
    (pkg / "sub" / "low.py").write_text("def f():\n    from ..high import g  # a lazy import\n    return g\n")
    (pkg / "high.py").write_text("import pkg.sub.low\n\ndef g():\n    return pkg.sub.low.f\n")
    graph = import_graph(pkg)
    assert graph["pkg.sub.low"] == {"pkg.high"} and graph["pkg.high"] == {"pkg.sub.low"}
    assert graph["pkg.sub"] == {"pkg.sub.low"}
    assert cycles(graph) == [["pkg.high", "pkg.sub.low"]]
    (pkg / "sub" / "low.py").write_text("def f():\n    return 1\n")
    assert cycles(import_graph(pkg)) == []
