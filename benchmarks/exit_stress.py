"""Clean two-process DDP runs, repeated, must all exit: no hang, no SIGABRT after the work is done.

Each run is a small Trainer fit and test on 2 gloo ranks, started by `deepepochs.launch` or by `torchrun`,
in its own process group with a deadline (a run past it counts as a hang and is killed). Runs alternate
between a script that calls `trainer.close()` and one that leaves the release to the exit handler. With
`--load` a CPU-bound busy loop runs beside them for the whole stress (the deadlocks it hunts need a
loaded machine to show).

    python benchmarks/exit_stress.py --launcher launch --runs 200 --load     # writes results/exit_stress-launch.json
    python benchmarks/exit_stress.py --launcher torchrun --runs 20

Counts: clean (exit 0 and the marker each rank writes at the end of its work), hang, abort (SIGABRT or
"terminate called" in the output), other (the first such run's output tail is kept).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"

__all__ = ["rank_body"]


def rank_body() -> float:
    """One rank's work: a seeded DDP fit and test; close() unless EXIT_STRESS_NO_CLOSE is set. Writes a
    marker `rank-<RANK>` into EXIT_STRESS_DIR once done."""
    import torch  # noqa: PLC0415 (children import what they run)
    from torch.nn import functional as F  # noqa: PLC0415
    from torch.utils.data import DataLoader, TensorDataset  # noqa: PLC0415

    from deepepochs import Trainer  # noqa: PLC0415

    torch.manual_seed(0)
    features = torch.randn(96, 4)
    samples = TensorDataset(features, features.sum(1, keepdim=True))
    train, val = DataLoader(samples, batch_size=8, shuffle=True), DataLoader(samples, batch_size=16)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    trainer = Trainer(model, F.mse_loss, torch.optim.Adam(model.parameters(), lr=0.01), epochs=2, device="cpu",
                      log_batch=False, show_info=False)
    loss = trainer.fit(train, val)["train"]["loss"][-1]
    trainer.test(val)
    if not os.environ.get("EXIT_STRESS_NO_CLOSE"):
        trainer.close()
    open(os.path.join(os.environ["EXIT_STRESS_DIR"], f"rank-{os.environ['RANK']}"), "w").close()
    return loss


def _command(launcher: str) -> list[str]:
    if launcher == "launch":
        return [sys.executable, str(Path(__file__).resolve()), "--launch-once"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(Path(__file__).resolve()), "--rank-once"]


def _one_run(launcher: str, timeout: float, no_close: bool) -> tuple[str, str]:
    """(outcome, output tail) of one run."""
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "EXIT_STRESS_DIR": folder, "OMP_NUM_THREADS": "1"}
        env.pop("EXIT_STRESS_NO_CLOSE", None)
        if no_close:
            env["EXIT_STRESS_NO_CLOSE"] = "1"
        process = subprocess.Popen(_command(launcher), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   env=env, start_new_session=True, text=True)
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            return "hang", output[-3000:]
        markers = sorted(os.listdir(folder))
    if process.returncode in (-signal.SIGABRT, 128 + signal.SIGABRT) or "terminate called" in output \
            or "SIGABRT" in output:
        return "abort", output[-3000:]
    if process.returncode == 0 and markers == ["rank-0", "rank-1"]:
        return "clean", ""
    return "other", f"exit {process.returncode}, markers {markers}\n{output[-3000:]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launcher", choices=("launch", "torchrun"), default="launch")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds one run may take")
    parser.add_argument("--load", action="store_true", help="run a CPU-bound busy loop beside the runs")
    parser.add_argument("--launch-once", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank-once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_once:
        rank_body()
        return
    if args.launch_once:
        sys.path.insert(0, str(HERE))
        import exit_stress  # noqa: PLC0415 (by name, so that spawned children import it too)

        from deepepochs import launch  # noqa: PLC0415
        launch(exit_stress.rank_body, num_processes=2)
        return
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.load else None
    counts = {"clean": 0, "hang": 0, "abort": 0, "other": 0}
    first_failure, started = {}, time.monotonic()
    try:
        for run in range(args.runs):
            outcome, tail = _one_run(args.launcher, args.timeout, no_close=run % 2 == 1)
            counts[outcome] += 1
            if outcome != "clean":
                first_failure.setdefault(outcome, tail)
                print(tail, flush=True)
            print(f"run {run + 1}/{args.runs}: {outcome}  {counts}", flush=True)
    except KeyboardInterrupt:  # stopped early: the counts so far are written all the same
        pass
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
    result = {"launcher": args.launcher, "runs": sum(counts.values()), "load": args.load, "counts": counts,
              "seconds": round(time.monotonic() - started, 1), "first_failure": first_failure}
    RESULTS_DIR.mkdir(exist_ok=True)
    (RESULTS_DIR / f"exit_stress-{args.launcher}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "first_failure"}))


if __name__ == "__main__":
    main()
