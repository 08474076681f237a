"""PKG-1: the wheel holds the package with its generated tables (not spec/ or tests/), and installed into a
clean virtual environment it runs the quick start (examples/01-basic.py) from outside the repository."""

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out, src = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("src")
    # Build from a copy of what the wheel is made of, so no build/ folder lands in the working tree.
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "deepepochs", src / "deepepochs", ignore=shutil.ignore_patterns("__pycache__"))
    # Without build isolation when setuptools is at hand (no download); else pip builds in isolation.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-q", "-w", str(out),
                    *isolation], check=True, capture_output=True, text=True)
    (path,) = out.glob("deepepochs-*.whl")
    return path


def test_the_wheel_ships_the_package_and_its_generated_tables_only(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "deepepochs/fsm/tables.py" in names and "deepepochs/fsm/events.py" in names
    assert "deepepochs/callbacks/check.py" in names
    assert not [n for n in names if n.startswith(("spec/", "tests/", "examples/", "benchmarks/"))]


def _without_pythonpath() -> dict[str, str]:
    """This process's environment less PYTHONPATH: a PYTHONPATH naming the checkout (as when the tests run
    with PYTHONPATH=$PWD) would put the source tree before the installed wheel in every child."""
    return {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}


def test_the_installed_wheel_runs_the_quick_start_outside_the_repository(wheel, tmp_path):
    """The wheel installed in a fresh virtual environment, not the checkout, runs the quick start."""
    env = _without_pythonpath()
    venv = tmp_path / "venv"
    # System site-packages provide torch and the other dependencies (no download of a multi-GB torch);
    # the wheel goes into the venv's own site-packages, which come first on sys.path.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, env=env)
    python = venv / ("Scripts" if sys.platform == "win32" else "bin") / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True,
                   capture_output=True, text=True, env=env)
    work = tmp_path / "work"
    work.mkdir()
    script = shutil.copy(ROOT / "examples" / "01-basic.py", work / "quick_start.py")
    where = subprocess.run([str(python), "-c", "import deepepochs; print(deepepochs.__file__)"], cwd=work,
                           check=True, capture_output=True, text=True, env=env).stdout.strip()
    assert Path(where).is_relative_to(venv), f"imported {where}, not the installed wheel"
    run = subprocess.run([str(python), script, "--small"], cwd=work, capture_output=True, text=True, timeout=300,
                         env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "TEST>" in run.stdout and "TRAIN>" in run.stdout
