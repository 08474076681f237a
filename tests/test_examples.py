"""Every numbered example runs to completion with `--small`, so none of them rots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("[0-9][0-9]-*.py"))

# Examples that take more than ~20 s with --small on a 2-core CPU machine: torch.compile's first
# compilation (cold cache ~45 s), launching several processes (~35 s when the machine is busy). The others
# take 5-12 s, most of it importing torch.
SLOW = {"19-compile.py", "21-distributed.py"}


def example_env(**extra) -> dict:
    """The environment an example runs in: this tree first on the path, and `MigrationWarning` an error in
    every process it starts (tests/migration_as_error/sitecustomize.py): an example is a 0.7 program, and
    what tells a 0.6.18 user of a difference must not reach it."""
    path = os.pathsep.join([str(ROOT / "tests" / "migration_as_error"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **extra}


def _params():
    for path in EXAMPLES:
        marks = [pytest.mark.slow] if path.name in SLOW else []
        yield pytest.param(path, id=path.stem, marks=marks)


def test_examples_exist():
    """The examples folder holds the numbered scripts the README lists."""
    names = {p.name for p in EXAMPLES}
    assert "01-basic.py" in names and len(names) >= 16, sorted(names)


@pytest.mark.parametrize("path", list(_params()))
def test_example_runs_with_small_flag(path, tmp_path):
    """`python examples/NN-name.py --small` exits 0 (run in a scratch folder so files land there), with no
    `MigrationWarning` (an error there)."""
    env = example_env(MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, str(path), "--small"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, f"{path.name} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


# ---- benchmark scripts: smoke runs at tiny sizes (numbers meaningless), so they do not rot either ----
BENCH = ROOT / "benchmarks"


def _run(args, tmp_path, timeout=150):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_loop_overhead_benchmark_runs_quickly(tmp_path):
    """loop_overhead.py --quick measures both feeds (a DataLoader and pre-batched tensors), prints the
    summary table, the budget lines and the FSM dispatch table, and writes JSON."""
    import json

    out = tmp_path / "loop.json"
    text = _run([BENCH / "loop_overhead.py", "--quick", "--models", "tiny", "--variants", "raw,deepepochs",
                 "--output", out], tmp_path)
    assert "| tiny | loader | deepepochs |" in text and "| tiny | tensors | deepepochs |" in text, text
    assert "| tiny (Linear 16→2, batch 32) | DataLoader |" in text and "FSM dispatch" in text, text
    assert "tiny, DataLoader, console off <= 1.10x" in text, text
    rows = json.loads(out.read_text())["results"]
    assert {(r["feed"], r["variant"]) for r in rows} == {(f, v) for f in ("loader", "tensors")
                                                         for v in ("raw", "deepepochs")}


def test_finite_check_benchmark_runs_quickly(tmp_path):
    """finite_check.py times the library's non-finite gradient check inside a plain update and writes JSON."""
    import json

    out = tmp_path / "finite.json"
    text = _run([BENCH / "finite_check.py", "--rounds", "2", "--updates", "1", "--models", "tiny",
                 "--output", out], tmp_path)
    assert "| tiny | deepepochs |" in text, text
    rows = {r["variant"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"none", "deepepochs", "fused", "isfinite"} and rows["deepepochs"]["check_us"] > 0


def test_profile_script_runs_quickly(tmp_path):
    """profile_loop.py prints the ablation table (every edge vs fused) and the cost of one fit() call."""
    text = _run([BENCH / "profile_loop.py", "--rounds", "2", "--batches", "5", "--no-cprofile"], tmp_path)
    assert "| every edge (fuse_steps=False) |" in text and "one fit() call costs" in text, text


def test_batch_segments_script_times_every_segment_of_both_loops(tmp_path):
    """batch_segments.py finds the calls it times in both loops (a renamed internal would leave a row of
    deepepochs empty) and writes JSON."""
    import json

    out = tmp_path / "segments.json"
    _run([BENCH / "batch_segments.py", "--rounds", "2", "--batches", "12", "--output", out], tmp_path)
    table = json.loads(out.read_text())["median_us"]
    for shared in ("forward", "loss function", "backward", "optimizer step", "zero_grad"):
        assert table[shared]["raw"] > 0 and table[shared]["deepepochs"] > 0, shared
    for own in ("finite check (unscale_gradients)", "generator copy (remember_position)", "action unscale_gradients",
                "action step_optimizer", "action commit_update", "action close_window", "step read_batch",
                "step count_batch", "compiled micro-batch (its own lines)"):
        assert table[own]["raw"] is None and table[own]["deepepochs"] > 0, own


def test_memory_benchmark_runs_quickly(tmp_path):
    """memory_steady.py reports RSS at each epoch end and writes JSON."""
    out = tmp_path / "mem.json"
    text = _run([BENCH / "memory_steady.py", "--epochs", "2", "--batches", "30", "--val-batches", "5",
                 "--every", "10", "--output", out], tmp_path)
    assert "RSS growth" in text and out.exists(), text


@pytest.mark.distributed
def test_fsdp_memory_benchmark_reports_half_the_bytes_per_rank_with_two_processes(tmp_path):
    """fsdp_memory.py at a small width: each FSDP rank holds half of DDP's parameters + optimizer state."""
    out = tmp_path / "fsdp.json"
    text = _run([BENCH / "fsdp_memory.py", "--width", "128", "--layers", "2", "--output", out], tmp_path, timeout=300)
    result = json.loads(out.read_text())
    assert {(r["strategy"], r["rank"]) for r in result["results"]} == {(s, r) for s in ("ddp", "fsdp") for r in (0, 1)}
    assert result["fsdp_over_ddp"] == pytest.approx(0.5, abs=0.01), text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_throughput_benchmark_skips_without_cuda(tmp_path):
    """multigpu_benchmark.py --device cuda on a machine without CUDA says so and exits 0."""
    assert "skipped: CUDA not available" in _run([BENCH / "multigpu_benchmark.py", "--device", "cuda"], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("raw", [False, True], ids=["deepepochs", "raw"])
def test_throughput_benchmark_cpu_smoke(tmp_path, raw):
    """multigpu_benchmark.py runs on the CPU at tiny sizes, for the trainer and the raw loop, and writes JSON."""
    out = tmp_path / "tp.json"
    args = [BENCH / "multigpu_benchmark.py", "--device", "cpu", "--steps", "3", "--warmup", "1", "--batch-size",
            "2", "--image-size", "64", "--output", out] + (["--raw"] if raw else [])
    text = _run(args, tmp_path, timeout=300)
    assert "parameters" in text and out.exists(), text


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path (on a GPU it runs for minutes)")
def test_gpu_checks_script_runs_and_summarises_without_cuda(tmp_path):
    """benchmarks/gpu_checks.sh (one GPU session's checks) runs end to end here: every CUDA step says it
    skipped, and the summary JSON holds the environment, the tests/gpu line and the smoke result."""
    import json

    env = {**os.environ, "OUT": str(tmp_path / "out")}
    proc = subprocess.run(["bash", str(BENCH / "gpu_checks.sh")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "gpu_checks.json").read_text())
    assert summary["environment"]["torch"] == torch.__version__ and summary["environment"]["gpu"] is None
    assert "skipped" in str(summary["gpu_tests"]) and summary["throughput"] == {} and summary["ratios"] == {}
    assert summary["smoke"]["status"] == "skipped"
    assert (tmp_path / "out" / "gpu_tests.txt").exists() and (tmp_path / "out" / "gpu_checks.log").exists()


def test_the_demo_learns_within_its_first_epochs(tmp_path):
    """`make demo`'s script (examples/01-basic.py, as make runs it): the training loss falls every epoch of
    the first fit, ending well below where it started, and the model beats chance clearly by then; it shows
    no `MigrationWarning` (an error there), its second `fit(epochs=...)` included."""
    env = example_env()
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "01-basic.py")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MigrationWarning" not in proc.stderr, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("per-epoch train loss:"))
    losses = json.loads(line.split(":", 1)[1])
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.5 * losses[0], losses
    first = next(line for line in proc.stdout.splitlines() if line.startswith("accuracy after the first"))
    assert float(first.rsplit(" ", 1)[1]) > 0.75, first
