"""Behaviour of ``deepepochs.launch.launch``: spawning, results, failures, environment.

Launches that could hang if ``launch`` were broken (a rank blocked in a collective) run in a subprocess
with a timeout; the others run in this process with targets whose collectives have timeouts.
"""

import ast
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing
from torch.multiprocessing.spawn import ProcessRaisedException

from deepepochs.errors import ConfigError, DistributedError
from deepepochs.launch import launch

# Spawned children import the targets by module name; they inherit this sys.path from the parent.
TARGETS_DIR = Path(__file__).resolve().parent
if str(TARGETS_DIR) not in sys.path:
    sys.path.insert(0, str(TARGETS_DIR))

import launch_targets  # noqa: E402  (needs the sys.path entry above)

pytestmark = pytest.mark.distributed

# Runs one launch in a fresh interpreter and prints its outcome as JSON on the last stdout line.
_DRIVER = textwrap.dedent(
    """
    import json, sys, threading, time
    import launch_targets
    from deepepochs.launch import launch

    start = time.monotonic()
    try:
        outcome = {"result": launch(getattr(launch_targets, sys.argv[1]), num_processes=2)}
    except Exception as exc:
        outcome = {"error_type": type(exc).__name__, "message": str(exc)}
    outcome["elapsed"] = time.monotonic() - start
    # the thread that copies the children's stderr must have seen its end, not been given up on
    outcome["stderr_pump_alive"] = any(t.name == "deepepochs-launch-stderr" for t in threading.enumerate())
    print(json.dumps(outcome))
    """
)


def _subprocess_env() -> dict:
    """The current environment with the targets folder on PYTHONPATH and no torchrun variables."""
    env = {k: v for k, v in os.environ.items() if k not in launch_targets.TORCHRUN_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TARGETS_DIR), env.get("PYTHONPATH")]))
    return env


def _launch_in_subprocess(target_name: str, timeout_s: float = 60) -> dict:
    """Run ``launch(launch_targets.<target_name>, num_processes=2)`` in a fresh interpreter."""
    completed = subprocess.run(
        [sys.executable, "-c", _DRIVER, target_name],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=_subprocess_env(),
    )
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _caller_sigterm_handler(signum, frame):
    """A SIGTERM handler the 'caller' installs, so restoration is checked against a non-default one."""


@pytest.fixture
def no_torchrun_env(monkeypatch):
    """Remove torchrun's variables, in case the test run itself was started by a launcher."""
    for name in launch_targets.TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def spawning_fails(monkeypatch, no_torchrun_env):
    """Make any attempt to start processes fail the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("launch started processes although it should have stopped before")

    monkeypatch.setattr(torch.multiprocessing, "start_processes", refuse)


@pytest.fixture(scope="module")
def two_process_run():
    """One two-process launch, with the caller's environment and signal handlers recorded around it."""
    with pytest.MonkeyPatch.context() as patch:
        for name in (*launch_targets.TORCHRUN_VARIABLES, "OMP_NUM_THREADS"):
            patch.delenv(name, raising=False)
        previous_sigterm = signal.signal(signal.SIGTERM, _caller_sigterm_handler)
        try:
            env_before = dict(os.environ)
            handlers_before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
            result = launch(launch_targets.gather_environments_and_all_reduce, num_processes=2)
            env_after = dict(os.environ)
            handlers_after = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        finally:
            signal.signal(signal.SIGTERM, previous_sigterm)
    return types.SimpleNamespace(
        result=result,
        env_before=env_before,
        env_after=env_after,
        handlers_before=handlers_before,
        handlers_after=handlers_after,
    )


# --- several processes: results and environment --------------------------------------------------------


def test_launch_returns_the_result_of_rank_0(two_process_run):
    """With two processes, the caller receives the value rank 0's main() returned."""
    assert two_process_run.result["returned_by_rank"] == 0
    assert two_process_run.result["reports"][0]["pid"] != os.getpid()


def test_each_child_sees_its_rank_and_a_shared_rendezvous_in_its_environment(two_process_run):
    """Every child gets RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_WORLD_SIZE and the same MASTER_ADDR/PORT."""
    reports = two_process_run.result["reports"]
    assert len({report["pid"] for report in reports}) == 2
    ports = {report["env"]["MASTER_PORT"] for report in reports}
    assert len(ports) == 1 and ports.pop().isdigit()
    for rank, report in enumerate(reports):
        env = report["env"]
        assert (env["RANK"], env["LOCAL_RANK"]) == (str(rank), str(rank))
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("2", "2")
        assert env["MASTER_ADDR"] == "127.0.0.1"


def test_children_can_join_a_gloo_group_from_the_environment_and_all_reduce(two_process_run):
    """init_process_group('gloo') works from the environment alone, and all_reduce sums over both ranks."""
    assert two_process_run.result["sum"] == 1.0 + 2.0


def test_children_use_one_omp_thread_when_the_caller_did_not_set_it(two_process_run):
    """Without OMP_NUM_THREADS in the caller, each child runs with OMP_NUM_THREADS=1 and one torch thread."""
    for report in two_process_run.result["reports"]:
        assert report["env"]["OMP_NUM_THREADS"] == "1"
        assert report["torch_threads"] == 1


def test_caller_environment_is_unchanged_after_launch(two_process_run):
    """OMP_NUM_THREADS is absent again afterwards and no rendezvous variable is left behind."""
    assert two_process_run.env_after == two_process_run.env_before
    for name in (*launch_targets.TORCHRUN_VARIABLES, "OMP_NUM_THREADS"):
        assert name not in two_process_run.env_after


def test_launch_ends_when_the_children_do_without_waiting_for_their_stderr(no_torchrun_env):
    """A first launch in a fresh interpreter: the children's stderr pipe reaches its end when they exit
    (multiprocessing's resource tracker, started by the first spawn, used to keep it open, so every
    launch waited 2 s for it before returning)."""
    outcome = _launch_in_subprocess("report_process")
    assert outcome["result"]["env"]["RANK"] == "0"
    assert outcome["stderr_pump_alive"] is False


def test_caller_signal_handlers_are_unchanged_after_launch(two_process_run):
    """The SIGINT and SIGTERM handlers are the same objects before and after the launch."""
    assert two_process_run.handlers_before[signal.SIGTERM] is _caller_sigterm_handler
    assert two_process_run.handlers_after == two_process_run.handlers_before


def test_children_keep_an_omp_num_threads_the_caller_set(monkeypatch, no_torchrun_env):
    """A caller's own OMP_NUM_THREADS reaches the children unchanged and stays set in the caller."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    report = launch(launch_targets.report_process, num_processes=2)
    assert report["env"]["OMP_NUM_THREADS"] == "2"
    assert report["env"]["RANK"] == "0"
    assert os.environ["OMP_NUM_THREADS"] == "2"


# --- running in the calling process ---------------------------------------------------------------------


def test_one_process_runs_main_in_the_calling_process(no_torchrun_env):
    """num_processes=1 calls main() here: same pid, no torchrun variables set."""
    report = launch(launch_targets.report_process, num_processes=1)
    assert report["pid"] == os.getpid()
    assert all(report["env"][name] is None for name in launch_targets.TORCHRUN_VARIABLES)


def test_default_process_count_without_a_gpu_is_one_process_in_the_caller_and_says_how_to_run_more(
        monkeypatch, spawning_fails, capsys):
    """num_processes=None without CUDA devices runs main() in the calling process and says so on stderr,
    with the two ways to run several processes; num_processes=1, asked for, says nothing."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert launch(launch_targets.report_process)["pid"] == os.getpid()
    err = capsys.readouterr().err
    assert re.search(r"launch: no GPU here, so main\(\) runs in this one process.*"
                     r"launch\(main, num_processes=2\).*torchrun --nproc-per-node=2", err), err
    launch(launch_targets.report_process, num_processes=1)
    assert capsys.readouterr().err == ""


def test_default_process_count_with_one_gpu_runs_main_here_and_says_nothing_of_a_missing_gpu(
        monkeypatch, spawning_fails, capsys):
    """num_processes=None with one visible CUDA device is one process per GPU: main() runs in the caller and
    no line claims that there is no GPU (it did, seen on a one-GPU machine)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert launch(launch_targets.report_process)["pid"] == os.getpid()
    assert capsys.readouterr().err == ""


def test_torchrun_environment_runs_main_in_the_calling_process(monkeypatch, spawning_fails):
    """With RANK and WORLD_SIZE set (as under torchrun), launch calls main() here, ignoring num_processes."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    report = launch(launch_targets.report_process, num_processes=2)
    assert report["pid"] == os.getpid()
    assert report["env"]["RANK"] == "0"


def test_under_torchrun_only_rank_0_gets_the_result_and_every_rank_runs_main(monkeypatch, spawning_fails):
    """Under torchrun every rank runs main(); rank 0 gets its result, the others None (as a launch caller
    sees only rank 0's), so a script printing a non-None result prints it once."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    ran = []

    def main():  # under torchrun main runs in this process: no importability needed
        ran.append(os.environ["RANK"])
        return {"rank": os.environ["RANK"]}

    results = []
    for rank in ("0", "1"):
        monkeypatch.setenv("RANK", rank)
        results.append(launch(main, num_processes=2))
    assert ran == ["0", "1"] and results == [{"rank": "0"}, None]


def test_initialised_process_group_runs_main_in_the_calling_process(tmp_path, spawning_fails):
    """When the caller already initialised a process group, launch just calls main()."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert launch(launch_targets.report_process, num_processes=2)["pid"] == os.getpid()
    finally:
        dist.destroy_process_group()


# --- rejected before anything is spawned ----------------------------------------------------------------


def test_lambda_is_rejected_before_spawning(spawning_fails):
    """A lambda cannot be imported by the children: ConfigError with the fix."""
    with pytest.raises(ConfigError, match=r"main is a lambda.*at the top level of an importable \.py file"):
        launch(lambda: 1, num_processes=2)


def test_local_function_is_rejected_before_spawning(spawning_fails):
    """A function defined inside another function is rejected with its qualified name."""

    def local_main():
        return 1

    with pytest.raises(ConfigError, match=r"local_main'\) is defined inside another function"):
        launch(local_main, num_processes=2)


def test_function_from_an_interactive_session_is_rejected_before_spawning(monkeypatch, spawning_fails):
    """A function defined in a file-less __main__ (REPL, notebook) is rejected."""
    interactive_main = types.ModuleType("__main__")
    exec("def main():\n    return 1\n", interactive_main.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", interactive_main)
    with pytest.raises(ConfigError, match=r"'main'\) is defined in an interactive session or notebook"):
        launch(interactive_main.main, num_processes=2)


def test_unpicklable_callable_is_rejected_before_spawning(spawning_fails):
    """A callable that fails a pickle round trip is rejected with pickle's reason."""
    with pytest.raises(ConfigError, match=r"cannot be pickled for the child processes \(TypeError: .*lock"):
        launch(launch_targets.CallableHoldingALock(), num_processes=2)


def test_non_callable_main_is_rejected(spawning_fails):
    """Passing main's result instead of main is a ConfigError that says so."""
    expected = r"main must be a callable .*\(got 42 of type int\).*launch\(main\)"
    with pytest.raises(ConfigError, match=expected):
        launch(42, num_processes=2)


@pytest.mark.parametrize(
    ("num_processes", "received"),
    [(0, "0 of type int"), (-1, "-1 of type int"), ("two", "'two' of type str"), (True, "True of type bool")],
)
def test_invalid_num_processes_is_rejected(num_processes, received, spawning_fails):
    """num_processes must be None or a positive int; the message shows what was received."""
    expected = (
        f"num_processes must be a positive int, or None for one process per visible GPU (got {received})"
    )
    with pytest.raises(ConfigError, match=re.escape(expected)):
        launch(launch_targets.report_process, num_processes=num_processes)


# --- failures -------------------------------------------------------------------------------------------


def test_rank_raising_makes_launch_raise_distributed_error_with_its_traceback(no_torchrun_env):
    """An exception on rank 1 stops the stuck rank 0 and reaches the caller within seconds, with traceback."""
    start = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 1 of 2 raised an exception") as caught:
        launch(launch_targets.raise_on_rank_1_while_rank_0_is_stuck, num_processes=2)
    assert time.monotonic() - start < 30  # rank 0 alone would sleep for 60 s
    message = str(caught.value)
    assert "ValueError: rank 1 failed on purpose" in message
    assert "in raise_on_rank_1_while_rank_0_is_stuck" in message  # the traceback, not only the message
    assert isinstance(caught.value.__cause__, ProcessRaisedException)
    assert multiprocessing.active_children() == []


def test_rank_raising_while_another_waits_in_a_barrier_does_not_hang():
    """Rank 0 blocked in a barrier is stopped when rank 1 raises; the caller gets the error promptly."""
    outcome = _launch_in_subprocess("raise_on_rank_1_while_rank_0_waits_in_a_barrier")
    assert outcome.get("error_type") == "DistributedError", outcome
    assert "ValueError: rank 1 failed while rank 0 waits in a barrier" in outcome["message"]
    assert outcome["message"].startswith("launch: rank 1 of 2 raised an exception")
    assert outcome["elapsed"] < 30


def test_rank_dying_without_traceback_raises_distributed_error_with_its_exit_code(no_torchrun_env):
    """A rank that exits abnormally (os._exit(3)) is reported with its exit code."""
    expected = r"rank 1 of 2 died with exit code 3 without a Python traceback"
    with pytest.raises(DistributedError, match=expected):
        launch(launch_targets.exit_without_traceback_on_rank_1, num_processes=2)


def test_unpicklable_rank_0_result_raises_distributed_error_with_a_hint(no_torchrun_env):
    """A result that cannot travel back by pickle is an error that says to return plain Python objects."""
    expected = r"cannot be sent back to the caller.*\.item\(\) or \.tolist\(\)"
    with pytest.raises(DistributedError, match=expected):
        launch(launch_targets.return_unpicklable_on_rank_0, num_processes=2)


# --- the way users run it -------------------------------------------------------------------------------

_USER_SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist

    from deepepochs.launch import launch


    def main():
        dist.init_process_group("gloo")
        try:
            value = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(value)
            return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "sum": value.item()}
        finally:
            dist.destroy_process_group()


    if __name__ == "__main__":
        print(launch(main, num_processes=2))
    """
)


def test_script_with_a_top_level_main_runs_with_plain_python(tmp_path):
    """`python script.py` with main at the top level and a __main__ guard prints rank 0's result."""
    script = tmp_path / "train.py"
    script.write_text(_USER_SCRIPT)
    completed = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        env=_subprocess_env(),
        cwd=tmp_path,
    )
    assert completed.returncode == 0, completed.stderr
    result = ast.literal_eval(completed.stdout.strip().splitlines()[-1])
    assert result == {"rank": 0, "world_size": 2, "sum": 3.0}


@pytest.mark.distributed
@pytest.mark.slow
def test_ten_clean_two_process_launches_all_return_their_result(tmp_path, no_torchrun_env, monkeypatch):
    """A Trainer fit and test under launch(num_processes=2), ten times: every run returns rank 0's result,
    and each rank's atexit handlers ran although children now skip the interpreter teardown (which aborted
    with SIGABRT after main() returned in some runs and lost the result: this test failed that way with the
    teardown left in)."""
    results = []
    for run in range(10):
        folder = tmp_path / f"run-{run}"
        folder.mkdir()
        monkeypatch.setenv("DEEPEPOCHS_TEST_ATEXIT_DIR", str(folder))
        results.append(launch(launch_targets.train_with_a_trainer, num_processes=2))
        assert sorted(p.name for p in folder.iterdir()) == ["rank-0", "rank-1"], run
    assert len(results) == 10 and all(isinstance(r, float) for r in results)
    assert len(set(results)) == 1  # the same seeded run each time


# ---- scripts whose children cannot run main ----------------------------------------------------------------
_GUARDED_MAIN_SCRIPT = textwrap.dedent(
    """
    import time
    from deepepochs.launch import launch

    if __name__ == "__main__":
        def main():
            return 1

        started = time.monotonic()
        try:
            launch(main, num_processes=2)
        except Exception as exc:
            print(type(exc).__name__, "|", exc)
        print("seconds", time.monotonic() - started)
    """
)

_CHILD_IMPORT_FAILS_SCRIPT = textwrap.dedent(
    """
    from deepepochs.launch import launch


    def main():
        return 1


    if __name__ != "__main__":  # runs only when a child imports this script
        raise RuntimeError("this script cannot be imported by a child")

    if __name__ == "__main__":
        try:
            launch(main, num_processes=2)
        except Exception as exc:
            print(type(exc).__name__, "|", exc)
    """
)


def _run_script(tmp_path, text: str) -> str:
    script = tmp_path / "train.py"
    script.write_text(text)
    completed = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90,
                               env=_subprocess_env(), cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr
    return completed.stdout


def test_main_defined_under_the_main_guard_is_refused_before_spawning(tmp_path):
    """The children import the script without running its `if __name__ == '__main__':` block: a ConfigError
    naming the line, raised up front (no process is started, so it comes back at once)."""
    out = _run_script(tmp_path, _GUARDED_MAIN_SCRIPT)
    assert "ConfigError | main ('main') is defined under `if __name__ == '__main__':` (line 6 of" in out
    assert float(out.strip().splitlines()[-1].split()[-1]) < 5


@pytest.mark.distributed
def test_a_child_that_fails_importing_the_script_carries_its_traceback(tmp_path):
    """A child that dies before main runs leaves no traceback file; the DistributedError carries the
    traceback it printed (it said "without a Python traceback" before)."""
    out = _run_script(tmp_path, _CHILD_IMPORT_FAILS_SCRIPT)
    assert out.startswith("DistributedError |"), out
    assert "without a Python traceback" not in out
    assert "Traceback (most recent call last)" in out
    assert "RuntimeError: this script cannot be imported by a child" in out


@pytest.mark.distributed
def test_a_rank_ending_badly_after_every_main_returned_still_returns_the_result(tmp_path, no_torchrun_env,
                                                                                monkeypatch):
    """Rank 1 exits with code 3 in an atexit handler after both main()s returned: launch returns rank 0's
    result and warns about the exit code (it raised DistributedError and dropped the result before)."""
    from deepepochs.errors import DeepEpochsWarning

    monkeypatch.setenv("DEEPEPOCHS_TEST_DONE_DIR", str(tmp_path))
    with pytest.warns(DeepEpochsWarning, match=r"rank 1 of 2 ended with exit code 3 after main\(\) had returned"):
        result = launch(launch_targets.rank_1_exits_badly_after_main_returned, num_processes=2)
    assert result == {"rank": 0}
