"""Ctrl-C (SIGINT to the whole process group) while a stage's spawn DataLoader workers are still starting, in
every stage: the main process rolls the stage back, and the workers neither die of the signal nor of the
stage's end (tests/worker_sigint_target.py). Before, each printed a KeyboardInterrupt traceback from its
imports, or a FileNotFoundError when the stopped iterator's queues were collected before it had read them,
and torch's SIGCHLD handler raised "DataLoader worker ... killed by signal" inside the iterator's `__del__`."""

import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not hasattr(signal, "pthread_sigmask") or "spawn" not in multiprocessing.get_all_start_methods(),
    reason="needs POSIX signal masks and the spawn start method")

TARGET = Path(__file__).with_name("worker_sigint_target.py")


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent-workers"])
def test_a_ctrl_c_while_workers_start_rolls_every_stage_back_and_no_worker_dies_of_it(tmp_path, persistent):
    """Persistent workers: the failed stage shuts them down too, and the DataLoader kept starts new ones when
    the stage runs again."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), str(TARGET.parent)])}
    proc = subprocess.run([sys.executable, str(TARGET), *(["persistent"] if persistent else [])],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
                          start_new_session=True)  # the target signals its own process group
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = ("train", "test") if persistent else ("train", "val", "test", "predict", "lr_sweep")
    kept = " 2 True" if persistent else ""
    lines = [line for line in proc.stdout.split("\n") if line.split(" ")[0] in stages]
    assert lines == [f"{stage} 2 True{kept}" for stage in stages], proc.stdout
    assert "Traceback" not in proc.stderr and "DataLoader worker" not in proc.stderr, proc.stderr[-3000:]


FORKSERVER_WORKERS = """
import os, signal, sys, warnings
import torch
from multiprocessing import forkserver
from torch.utils.data import DataLoader, TensorDataset
from deepepochs.data import workers

def blocked(pid):
    with open(f"/proc/{pid}/status") as status:
        mask = next(line for line in status if line.startswith("SigBlk:")).split()[1]
    return bool(int(mask, 16) & (1 << (signal.SIGINT - 1)))

if sys.argv[1] == "started-before":
    forkserver.ensure_running()
data = DataLoader(TensorDataset(torch.zeros(8, 1)), batch_size=2, num_workers=2, multiprocessing_context="forkserver")
with warnings.catch_warnings(record=True) as caught, workers.stage():
    warnings.simplefilter("always")
    iterator = workers.start(data)
    next(iterator)
    print(*[blocked(w.pid) for w in iterator._workers], blocked(os.getpid()), len(caught))
    print(*[str(w.message) for w in caught])
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status")
                    or "forkserver" not in multiprocessing.get_all_start_methods(),
                    reason="reads signal masks from /proc; needs the forkserver start method")
@pytest.mark.parametrize("server", ["started-here", "started-before"])
def test_forkserver_workers_keep_sigint_blocked_and_a_server_started_before_is_warned_of(tmp_path, server):
    """The fork server deepepochs starts has SIGINT blocked, so every worker it forks keeps it blocked (a Ctrl-C
    stays pending there, as in fork and spawn workers); the main thread's mask comes back as it was. A server
    other code started before cannot be shielded: a warning says so, naming the way out."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.run([sys.executable, "-c", FORKSERVER_WORKERS, server], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    masks, message = proc.stdout.split("\n")[:2]
    if server == "started-here":
        assert masks == "True True False 0", proc.stdout
    else:
        assert masks == "False False False 1", proc.stdout
        assert "the fork server was started before deepepochs could start it with SIGINT blocked" in message
        assert "multiprocessing_context='fork' or 'spawn'" in message
