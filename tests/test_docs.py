"""The documentation runs: every Python code block of the README and the user-facing pages executes.

Each page runs in a fresh namespace and in a scratch folder (files its code writes land there), its blocks
in order, so a later block may use what an earlier one defined. A block is not run when it is not marked
plain `python` (e.g. a MyST ```{code-block} python directive) or when the line before its fence is
`<!-- norun: <reason> -->`; use either sparingly, for code that needs what a test cannot have (several
machines, a GPU). Pages other than these (the architecture and contributor pages) may show fragments.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import warnings
from pathlib import Path

import pytest
from mlflow_server import tracking_server  # noqa: F401  (tests/, on sys.path under pytest; a fixture)

import deepepochs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# User-facing pages: their code runs, and they speak the user's words.
USER_PAGES = sorted({ROOT / "README.md", *DOCS.glob("*.md"), *DOCS.glob("guide/*.md")}
                    - {DOCS / "ARCHITECTURE.md", DOCS / "contributing.md", DOCS / "micro-batch.md"})

FENCE = re.compile(r"^(?P<fence>```+|~~~+)\s*(?P<info>[^\n`]*)$")
NORUN = re.compile(r"^<!--\s*norun:\s*\S.*-->\s*$")


def code_blocks(text: str) -> list[tuple[int, str, str, bool]]:
    """(1-based line of the opening fence, info string, code, runnable) of each fenced block of `text`."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i].strip())
        if not m:
            i += 1
            continue
        fence, info, start = m["fence"], m["info"].strip(), i
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        norun = start > 0 and bool(NORUN.match(lines[start - 1].strip()))
        blocks.append((start + 1, info, "\n".join(body) + "\n", info in ("python", "py") and not norun))
    return blocks


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_the_block_reader_finds_runnable_blocks_and_honours_markers():
    """Plain ```python blocks run; ```{code-block} python, ```text and a norun marker do not."""
    text = ("intro\n```python\nx = 1\n```\n```text\nout\n```\n<!-- norun: needs 2 machines -->\n```python\n"
            "y = 2\n```\n```{code-block} python\nz = 3\n```\n````markdown\n```python\nw = 4\n```\n````\n")
    assert [(line, runs) for line, _, _, runs in code_blocks(text)] == [(2, True), (5, False), (9, False),
                                                                       (12, False), (15, False)]
    assert code_blocks(text)[0][2] == "x = 1\n"


# MIGRATION.md's blocks each run after the prelude the page shows, one block at a time (test_migration_doc.py).
PAGES_WITH_CODE = [p for p in USER_PAGES if p != DOCS / "MIGRATION.md"
                   and any(runs for *_, runs in code_blocks(p.read_text()))]


@pytest.mark.parametrize("page", PAGES_WITH_CODE, ids=_rel)
def test_every_python_block_of_the_page_runs(page, tmp_path, monkeypatch, capsys):
    """The page's ```python blocks run in order in one namespace, in a scratch folder, without error and
    without a `MigrationWarning` (an error here: the pages show 0.7 programs, which it does not concern)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace = {"__name__": "docs_page"}  # not __main__: a `launch(main)` guard shows code, runs none
    with warnings.catch_warnings():
        warnings.simplefilter("error", deepepochs.MigrationWarning)
        for line, _, code, runs in code_blocks(page.read_text()):
            if runs:
                exec(compile(code, f"{_rel(page)}:{line}", "exec"), namespace)  # noqa: S102
    capsys.readouterr()


def test_the_readme_is_a_front_door():
    """The README stays short (at most ~200 lines) and points to the documentation pages that exist."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\(((?:docs/)[^)#]+)", text)
    assert links and all((ROOT / link).exists() for link in links if link != "docs/img/state-graph-fit.svg"), \
        [link for link in links if not (ROOT / link).exists()]


REQUIREMENT_ID = re.compile(r"\b(?:FSM|DDP|MET|UX|PERF|DATA|CORE|CKPT|ACC|SEC|REL|CUST|COMPAT|SCALE|RES|LOG|AMP|"
                            r"PKG|GRAPH|EX|DEV|BENCH)-\d+\b")
ISSUE_NUMBER = re.compile(r"\bissues? #?\d+", re.I)


@pytest.mark.parametrize("page", USER_PAGES, ids=_rel)
def test_user_pages_carry_no_requirement_ids_or_issue_numbers(page):
    """Requirement ids and issue numbers belong in the CHANGELOG and contributor pages, not the user's."""
    text = page.read_text()
    assert not REQUIREMENT_ID.findall(text) and not ISSUE_NUMBER.findall(text), \
        (REQUIREMENT_ID.findall(text), ISSUE_NUMBER.findall(text))


def test_the_api_reference_documents_every_public_name():
    """docs/api.md has an autodoc entry for every name of `deepepochs.__all__`, and each has a docstring."""
    text = (DOCS / "api.md").read_text()
    documented = set(re.findall(r"^\.\. auto(?:class|function):: deepepochs\.(\w+)\s*$", text, re.M))
    assert documented == set(deepepochs.__all__), set(deepepochs.__all__) ^ documented
    assert not [name for name in deepepochs.__all__ if not (getattr(deepepochs, name).__doc__ or "").strip()]


def test_the_examples_page_lists_and_includes_every_numbered_example():
    """docs/examples.md links each examples/NN-*.py and includes its source, so the site shows them all."""
    text = (DOCS / "examples.md").read_text()
    names = sorted(p.name for p in (ROOT / "examples").glob("[0-9][0-9]-*.py"))
    included = re.findall(r"^```\{literalinclude\} \.\./examples/(\S+)\s*$", text, re.M)
    assert included == names
    for name in names:
        first = (ast.get_docstring(ast.parse((ROOT / "examples" / name).read_text())) or "").split("\n\n")[0]
        assert " ".join(first.split()).replace("|", "\\|") in text, f"{name}: its summary is not listed"


def test_every_page_of_the_site_is_in_its_table_of_contents():
    """Each Markdown page under docs/ (but the included micro-batch table) is reachable from the index."""
    index = (DOCS / "index.md").read_text()
    entries = set(re.findall(r"^([\w/.-]+)\s*$", index, re.M))
    pages = {p.relative_to(DOCS).with_suffix("").as_posix() for p in [*DOCS.glob("*.md"), *DOCS.glob("guide/*.md")]}
    assert pages - {"index", "micro-batch"} <= entries, sorted(pages - {"index", "micro-batch"} - entries)


if __name__ == "__main__":  # pragma: no cover - run one page by hand: python tests/test_docs.py docs/x.md
    sys.exit(pytest.main([__file__, "-q", "-k", os.path.basename(sys.argv[1]) if len(sys.argv) > 1 else ""]))


def test_the_distributed_guide_starts_with_the_two_commands_and_names_no_test_script():
    """The distributed guide's first code block is the two commands a user runs (python and torchrun);
    the user page lists no test script (those are on the contributing page)."""
    text = (DOCS / "guide" / "distributed.md").read_text()
    first = text.split("```", 2)[1]
    assert first.startswith("bash\n")
    assert "python train.py" in first and "torchrun --nproc-per-node=2 train.py" in first
    assert "tests/" not in text
    assert "tests/smoke_launch.py" in (DOCS / "contributing.md").read_text()


def test_no_page_has_two_sections_of_the_same_title():
    """Every heading of a user page is unique on that page (a reader of the table of contents or of a
    link cannot tell two equal titles apart)."""
    for page in [*DOCS.glob("*.md"), *(DOCS / "guide").glob("*.md")]:
        lines, fenced = [], False
        for line in page.read_text().splitlines():
            if line.startswith("```"):
                fenced = not fenced
            elif not fenced and re.match(r"#{1,6} ", line):
                lines.append(line.lstrip("#").strip())
        repeated = sorted({title for title in lines if lines.count(title) > 1})
        assert not repeated, f"{page.name}: {repeated}"


def test_the_readme_says_what_optional_parts_need_and_that_the_first_set_up_takes_minutes():
    """Graphviz for drawn graphs, torchvision and DGL for the two examples that use them, and the first
    `make demo` / `make test` downloading torch for minutes are said where a newcomer reads."""
    text = (ROOT / "README.md").read_text()
    assert re.search(r"Graphviz's `dot`", text) and "apt-get install graphviz" in text
    assert "pip install torchvision" in text and "pip install dgl" in text
    setup = text[text.index("## Set up a clone"):text.index("## Documentation")]
    assert re.search(r"first run of either takes minutes", setup)


# `pip install` followed by what it installs, up to the end of the code span or line it stands in.
PIP_INSTALL = re.compile(r"pip install\s+(?P<args>[^`\n)]*)")
INDEX_DEEPEPOCHS = re.compile(r"""^(?:-e\s+)?['"]?deepepochs(?:\[[\w,]*\])?['"]?(?:\s|$)""")


def _install_lines():
    """(where, what `pip install` installs) for every `pip install` in the user pages and the library's
    own messages and docstrings (a newcomer copies both)."""
    sources = [*USER_PAGES, *sorted((ROOT / "deepepochs").rglob("*.py"))]
    for path in sources:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for m in PIP_INSTALL.finditer(line):
                yield f"{_rel(path)}:{number}", m["args"].strip(), line


def test_every_install_line_installs_this_version_not_the_index_release():
    """No page or message tells a user to `pip install deepepochs` (or `'deepepochs[extra]'`) from the package
    index, which holds the older 0.6.18: installs come from a clone (`pip install ./deepepochs`,
    `pip install -e '.[mlflow]'`); the one exception is the sentence warning of exactly that."""
    wrong = [(where, args) for where, args, line in _install_lines()
             if INDEX_DEEPEPOCHS.match(args) and "older release" not in line]
    assert not wrong, wrong
    assert any(where.startswith("docs/guide/logging.md") and "-e '.[mlflow]'" in args
               for where, args, _ in _install_lines())


def test_the_readme_lists_every_extra_and_the_number_of_examples():
    """Each optional extra of pyproject.toml is named in the README's install section, and the README's count
    of numbered examples is the number of examples/NN-*.py files."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    text = (ROOT / "README.md").read_text()
    install = text[text.index("## Install"):text.index("## Quick start")]
    assert not [name for name in extras if f"`.[{name}]`" not in install], sorted(extras)
    count = len(list((ROOT / "examples").glob("[0-9][0-9]-*.py")))
    assert re.findall(r"\[(\d+) numbered examples\]", text) == [str(count)]


def test_the_schedules_page_does_not_offer_calling_the_optimizers_step_in_a_custom_step():
    """The library refuses a custom step's own `opt.step()` (naming `self.optimize(i)`): the learning-rate
    page says so rather than suggesting it."""
    text = " ".join((DOCS / "guide" / "lr-schedules.md").read_text().split())
    assert "itself bypasses the trainer's update" not in text
    assert "is refused with an error naming `self.optimize(i)`" in text


@pytest.mark.slow  # starts an `mlflow server` (60-140 s on a busy 2-core machine; skipped without mlflow)
def test_the_logging_pages_mlflow_run_is_read_back_through_mlflows_client(request, tmp_path, monkeypatch):
    """A newcomer's task, as the logging page shows it: its MLflow block (written for a server on port 5000,
    so not run with the page) runs against a real local server and reads the run back through MLflow's own
    client: every validation loss at its epoch, equal to the trainer's history, with no MigrationWarning."""
    uri = request.getfixturevalue("tracking_server")  # the session's server (tests/mlflow_server.py)
    text = (DOCS / "guide" / "logging.md").read_text()
    block = next(code for _, info, code, _ in code_blocks(text) if info == "python" and "MLflowCallback(" in code)
    code = block.replace("'http://127.0.0.1:5000'", repr(uri))
    assert code.count(repr(uri)) == 2, "the block names its server twice: the callback's and the client's"
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "docs_page"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", deepepochs.MigrationWarning)
        exec(compile(code, "docs/guide/logging.md:MLflow", "exec"), namespace)  # noqa: S102
    client, run, trainer = namespace["client"], namespace["run"], namespace["trainer"]
    logged = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss/val")]
    expected = list(enumerate(trainer.history["val"]["loss"], 1))
    assert [step for step, _ in logged] == [step for step, _ in expected]
    assert [value for _, value in logged] == pytest.approx([value for _, value in expected], rel=1e-6)


def test_the_debugging_pages_graph_opens_at_full_size():
    """The fit level's graph is wider than the page: it is drawn at the page's width with Sphinx's link to the
    full-size file (an `{image}` with a width), and the page says so; every other level is linked."""
    text = (DOCS / "debugging.md").read_text()
    assert re.search(r"^```\{image\} img/state-graph-fit\.svg\n:alt: .+\n:width: 100%\n```$", text, re.M)
    assert "click the picture to open it at full size" in " ".join(text.split())
    for level in ("epoch", "task", "batch", "full"):
        assert f"(img/state-graph-{level}.svg)" in text, level
