"""Packaging: the wheel holds the package with its generated tables (not spec/ or tests/), and installed into a
clean virtual environment it runs the quick start (examples/01-basic.py) from outside the repository."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
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


def _base_interpreter_package_dirs() -> set[Path]:
    """The site-packages folders of the interpreter this environment was made from (and the user's own):
    packages installed there by hand exist on a developer's machine, not on a fresh one."""
    probe = "import json, site, sys; print(json.dumps(site.getsitepackages() + [site.getusersitepackages()]))"
    base = getattr(sys, "_base_executable", sys.executable)
    out = subprocess.run([base, "-I", "-c", probe], check=True, capture_output=True, text=True,
                         env=_without_pythonpath()).stdout
    return {Path(p).resolve() for p in json.loads(out)}


def _is_inside(path: Path, folders: set[Path]) -> bool:
    return any(path.is_relative_to(folder) for folder in folders)  # a folder is relative to itself


def _from_base_interpreter(path_entries: list[str]) -> list[str]:
    """The entries of a sys.path that lie in the base interpreter's site-packages."""
    base = _base_interpreter_package_dirs()
    return [entry for entry in path_entries if entry and _is_inside(Path(entry).resolve(), base)]


def _project_package_dirs() -> list[str]:
    """The folders this test run imports third-party packages from (the project's environment, and any
    folder its own .pth files add), less any folder the checkout's own package would be imported from and
    the base interpreter's standard library. (The project's .venv may well lie inside the checkout.)"""
    # The base interpreter's library folders (inside a venv, sysconfig's own platstdlib is the venv's lib/).
    base = {name: sys.base_prefix for name in ("base", "platbase", "installed_base", "installed_platbase")}
    stdlib = {Path(sysconfig.get_paths(vars=base)[key]).resolve() for key in ("stdlib", "platstdlib")}
    checkout_package = (ROOT / "deepepochs").resolve()
    dirs = []
    for entry in sys.path:
        path = Path(entry or ".").resolve()
        if not path.is_dir() or (path / "deepepochs").resolve() == checkout_package or _is_inside(path, stdlib):
            continue
        dirs.append(str(path))
    return dirs


def _venv_with_project_packages(venv: Path, env: dict[str, str]) -> Path:
    """A venv that does not see the base interpreter's site-packages (a fresh machine has nothing there),
    given the project environment's packages (torch and the rest, no download) by a .pth file; anything
    installed into the venv itself comes first on its sys.path."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env)
    python = venv / ("Scripts" if sys.platform == "win32" else "bin") / "python"
    site_dir = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True, env=env).stdout.strip()
    (Path(site_dir) / "_project_packages.pth").write_text("\n".join(_project_package_dirs()) + "\n")
    return python


def test_this_test_run_imports_nothing_from_the_base_interpreters_site_packages():
    """The suite's own environment is isolated from the base interpreter: a package found only there (as on
    a developer's machine where someone installed torch by hand) would pass here and fail on a fresh one."""
    borrowed = _from_base_interpreter(sys.path)
    assert not borrowed, f"the test run imports from the base interpreter's site-packages: {borrowed}"


def test_a_child_python_found_on_path_is_the_test_environments():
    """A test that starts `python` by name gets this environment's interpreter, not the base one."""
    for name in ("python", "python3"):
        found = shutil.which(name)
        assert found is not None, f"{name} is not on PATH"
        prefix = subprocess.run([found, "-c", "import sys; print(sys.prefix)"], check=True,
                                capture_output=True, text=True).stdout.strip()
        assert Path(prefix).resolve() == Path(sys.prefix).resolve(), (
            f"{name} on PATH is {found} (prefix {prefix}), not this environment's ({sys.prefix})")


def test_the_installed_wheel_runs_the_quick_start_outside_the_repository(wheel, tmp_path):
    """The wheel installed in a fresh virtual environment, not the checkout, runs the quick start, with no
    package of the base interpreter on its path."""
    env = _without_pythonpath()
    venv = tmp_path / "venv"
    python = _venv_with_project_packages(venv, env)
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True,
                   capture_output=True, text=True, env=env)
    work = tmp_path / "work"
    work.mkdir()
    script = shutil.copy(ROOT / "examples" / "01-basic.py", work / "quick_start.py")
    probe = "import json, sys, deepepochs; print(json.dumps([deepepochs.__file__, sys.path]))"
    imported = subprocess.run([str(python), "-c", probe], cwd=work, capture_output=True, text=True, env=env)
    assert imported.returncode == 0, f"import deepepochs failed in the wheel's venv:\n{imported.stderr[-3000:]}"
    where, child_path = json.loads(imported.stdout)
    assert Path(where).is_relative_to(venv), f"imported {where}, not the installed wheel"
    borrowed = _from_base_interpreter(child_path)
    assert not borrowed, f"the wheel's venv sees the base interpreter's site-packages: {borrowed}"
    run = subprocess.run([str(python), script, "--small"], cwd=work, capture_output=True, text=True, timeout=300,
                         env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "TEST>" in run.stdout and "TRAIN>" in run.stdout
