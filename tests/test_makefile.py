"""The README's two set-up commands need nothing before them: read from `make -n` (what make would
run, nothing run), `make demo` and `make test` create their own virtual environment, install the pinned
torch into it first and on its own, and `make demo` installs the runtime dependencies only. A real run in
a fresh clone takes minutes (it installs torch); it was done by hand for this change."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def dry_run(target: str, venv: Path, *overrides: str) -> list[str]:
    """The commands `make <target>` would run with a not-yet-existing environment at `venv`."""
    proc = subprocess.run(["make", "-n", "-C", str(ROOT), target, f"VENV={venv}", *overrides], capture_output=True,
                          text=True, check=True)
    return [line for line in proc.stdout.splitlines() if line.strip() and not line.startswith("make")]


def test_make_demo_creates_its_environment_installs_torch_first_and_runtime_dependencies_only(tmp_path):
    """venv, then torch (pinned), then `pip install -e .` without extras, then the demo."""
    venv = tmp_path / "env"
    lines = dry_run("demo", venv)
    assert lines[0].endswith(f"-m venv {venv}")
    python = f"{venv}/bin/python"
    installs = [line for line in lines if "pip install" in line]
    assert all(line.startswith(python) for line in installs), installs
    assert '"torch==2.13.0"' in installs[0]
    assert len(installs) == 2 and installs[1].endswith("pip install -q -e ."), installs
    assert lines[-1] == f"{python} examples/01-basic.py"


def test_make_test_adds_the_dev_extra_and_runs_pytest_in_the_environment(tmp_path):
    """The dev extra comes after torch; pytest runs with the environment's Python and PYTEST_ARGS."""
    venv = tmp_path / "env"
    lines = dry_run("test", venv, "PYTEST_ARGS=-k docs")
    installs = [line for line in lines if "pip install" in line]
    assert '"torch==2.13.0"' in installs[0] and installs[-1].endswith('-e ".[dev]"'), installs
    assert lines[-1] == f"{venv}/bin/python -m pytest -q -rfEs -k docs"


def test_the_torch_build_can_be_chosen(tmp_path):
    """TORCH_SPEC picks the version and TORCH_INDEX the index; by default pip's own configuration."""
    lines = dry_run("demo", tmp_path / "env", "TORCH_SPEC=torch==2.6.0")
    torch_line = next(line for line in lines if "torch==" in line)
    assert '"torch==2.6.0"' in torch_line and "--index-url" not in torch_line
    lines = dry_run("demo", tmp_path / "env", "TORCH_INDEX=https://example.invalid/cpu")
    torch_line = next(line for line in lines if "torch==" in line)
    assert torch_line.endswith("--index-url https://example.invalid/cpu")


def test_the_extras_are_named_for_what_they_add():
    """plot, bench, docs and dev extras exist; the runtime dependencies are the six the package needs."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {"plot", "bench", "docs", "dev"} <= set(project["optional-dependencies"])
    names = {re.split(r"[<>=!~ \[]", dep, maxsplit=1)[0] for dep in project["dependencies"]}
    assert names == {"torch", "transitions", "attrs", "tensorboard", "tqdm", "numpy"}
    assert any(dep.startswith("matplotlib") for dep in project["optional-dependencies"]["plot"])
    assert {re.split(r"[<>=]", d)[0] for d in project["optional-dependencies"]["docs"]} >= {"sphinx", "myst-parser"}
