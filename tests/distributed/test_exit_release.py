"""The process group deepepochs created is released at exit after the user's own exit handlers, in an order
that cannot deadlock, and within a bound: a release torch blocks in ends the process with a message and the
run's exit status instead of hanging."""

import subprocess
import sys
import textwrap

import pytest
import torch.distributed as dist

from deepepochs.parallel import exit_watchdog

pytestmark = pytest.mark.skipif(not dist.is_available() or sys.platform == "win32", reason="needs torch.distributed")

# A clean 2-rank Trainer fit that never calls close(): the exit handler releases the group. Each rank first
# registers its own exit handler (after importing deepepochs, before the Trainer), which records whether the
# group is still there when it runs.
_NO_CLOSE_SCRIPT = textwrap.dedent(
    """
    import atexit, os, sys
    import torch
    import torch.distributed as dist
    from torch.nn import functional as F
    from deepepochs import Trainer

    out, rank = sys.argv[1], os.environ["RANK"]

    def record():
        group = dist.is_initialized() and dist.get_world_size() == 2
        with open(os.path.join(out, f"rank-{rank}"), "w") as fh:
            fh.write(f"group={group}")

    atexit.register(record)
    torch.manual_seed(0)
    x = torch.randn(32, 4)
    data = [(x[i:i + 8], x[i:i + 8].sum(1, keepdim=True)) for i in range(0, 32, 8)]
    model = torch.nn.Linear(4, 1)
    trainer = Trainer(model, F.mse_loss, torch.optim.SGD(model.parameters(), lr=0.05), epochs=1,
                      device="cpu", log_batch=False, show_info=False)
    trainer.fit(data, data[:2])
    """
)


def _torchrun_no_close(tmp_path, run: int) -> subprocess.CompletedProcess:
    from test_ddp import _script_env, _torchrun  # the bounded torchrun command of the DDP tests

    script = tmp_path / "no_close.py"
    script.write_text(_NO_CLOSE_SCRIPT)
    out = tmp_path / f"run-{run}"
    out.mkdir()
    return subprocess.run(_torchrun(script, out), capture_output=True, text=True, timeout=240, env=_script_env())


@pytest.mark.distributed
def test_a_user_exit_handler_registered_before_the_trainer_still_finds_the_process_group(tmp_path):
    """Under torchrun, without close(): each rank's own exit handler runs while the group exists, and the
    run ends with status 0 (the group was released after it)."""
    completed = _torchrun_no_close(tmp_path, 0)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert [(tmp_path / "run-0" / f"rank-{r}").read_text() for r in range(2)] == ["group=True"] * 2


@pytest.mark.distributed
@pytest.mark.slow
def test_three_clean_torchrun_runs_in_a_row_all_exit_with_status_0(tmp_path):
    """Exit repeated: no run hangs (each is bounded) or aborts at exit. The 200-run stress is
    benchmarks/exit_stress.py."""
    for run in range(3):
        completed = _torchrun_no_close(tmp_path, run)
        assert completed.returncode == 0 and "terminate called" not in completed.stderr, completed.stderr[-3000:]


def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60)


def test_a_release_that_torch_blocks_in_ends_the_process_with_a_message_and_the_given_status():
    """A step that waits with the GIL released (as a destructor joining gloo's threads does) past its
    bound: the Python watchman writes what was blocked and ends the process with the status."""
    completed = _run_python(
        """
        import time
        from deepepochs.parallel.exit_watchdog import bounded
        with bounded("releasing a test group", 0.5, status=7):
            time.sleep(30)
        print("not reached")
        """
    )
    assert completed.returncode == 7
    assert "releasing a test group did not finish within 0.5 s" in completed.stderr
    assert "not reached" not in completed.stdout


def test_a_release_blocked_while_holding_the_gil_is_ended_by_the_c_watchdog():
    """A step that blocks holding the GIL (no Python thread can run): faulthandler's watchdog prints the
    threads' tracebacks and ends the process with status 1."""
    completed = _run_python(
        """
        import ctypes
        from deepepochs.parallel import exit_watchdog
        exit_watchdog._C_WATCHMAN_DELAY_S = 0.5
        with exit_watchdog.bounded("a GIL-holding wait", 0.5, status=0):
            ctypes.PyDLL(None).sleep(30)  # a PyDLL call keeps the GIL
        print("not reached")
        """
    )
    assert completed.returncode == 1
    assert "Timeout" in completed.stderr and "not reached" not in completed.stdout


def test_a_bounded_step_that_finishes_in_time_leaves_the_process_running():
    """Within the bound nothing happens: the block's result stands and the watchmen stop."""
    with exit_watchdog.bounded("a quick step", 30):
        value = 1 + 1
    assert value == 2


@pytest.mark.parametrize(("last_value", "status"), [
    (None, 0), (SystemExit(143), 143), (SystemExit(None), 0), (SystemExit("message"), 1), (ValueError("x"), 1),
])
def test_the_exit_status_is_what_the_interpreter_ends_with(monkeypatch, last_value, status):
    """An uncaught SystemExit's code (Preempted's status), 1 after another uncaught exception, else 0."""
    if last_value is None:
        monkeypatch.delattr(sys, "last_value", raising=False)
    else:
        monkeypatch.setattr(sys, "last_value", last_value, raising=False)
    assert exit_watchdog.exit_status() == status
