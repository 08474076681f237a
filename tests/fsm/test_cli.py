"""`python -m deepepochs graph` on a machine without Graphviz."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _graph_cli(args, tmp_path, path_env):
    env = {**os.environ, "PATH": path_env,
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "deepepochs", "graph", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("fmt", ["svg", "png"])
def test_graph_cli_without_graphviz_prints_one_line_and_exits_2(fmt, tmp_path):
    """With no `dot` on PATH, svg/png exit with status 2 and one stderr line naming Graphviz and how to
    install it, no traceback, and no output file."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    out = tmp_path / f"g.{fmt}"
    proc = _graph_cli(["--format", fmt, "--output", str(out)], tmp_path, str(empty))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "Graphviz" in lines[0] and "'dot'" in lines[0] and "install" in lines[0]
    assert f"--format {fmt}" in lines[0]
    assert not out.exists()


def test_graph_cli_without_graphviz_still_writes_dot_text(tmp_path):
    """The text formats need no Graphviz: `--format dot` works with an empty PATH."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    proc = _graph_cli(["--format", "dot"], tmp_path, str(empty))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("digraph")


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz 'dot' is not installed here")
def test_graph_cli_with_graphviz_writes_svg(tmp_path):
    """Where `dot` exists, the same command writes an SVG file and exits 0 (the check above is not
    triggered by a working install)."""
    out = tmp_path / "g.svg"
    proc = _graph_cli(["--format", "svg", "--output", str(out)], tmp_path, os.environ.get("PATH", ""))
    assert proc.returncode == 0, proc.stderr
    assert b"<svg" in out.read_bytes()


@pytest.mark.parametrize("precision,processes,clip", [("fp32", 1, False), ("fp16", 1, True), ("bf16", 2, False)])
def test_loop_cli_prints_the_code_a_trainer_of_that_configuration_runs(precision, processes, clip, tmp_path):
    """`python -m deepepochs loop` prints the same compiled source as `compiled.explain` for a trainer with
    those options (one process here; the world size only decides which gradient-sync actions are left out)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    from deepepochs import GradClipCallback, Trainer
    from deepepochs.engine import compiled

    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    args = ["--precision", precision, "--processes", str(processes)] + (["--clip"] if clip else [])
    proc = subprocess.run([sys.executable, "-m", "deepepochs", "loop", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    if processes == 1:
        model = nn.Linear(2, 2)
        trainer = Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu",
                          precision=precision, callbacks=[GradClipCallback(1.0)] if clip else None,
                          show_info=False, log_batch=False)
        assert proc.stdout == compiled.explain(trainer._ctx)
    else:
        assert "sync_gradients(ctx)\n" in proc.stdout and "left out (one process" not in proc.stdout
    assert ("with autocast():" in proc.stdout) == (precision != "fp32")
    assert ("# clip_gradients(ctx): left out" in proc.stdout) == (not clip)
