"""Multi-node DDP, as two `torchrun --nnodes=2` invocations on this machine (one process
per "node", c10d rendezvous on 127.0.0.1): the run equals one process with the global batch."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from deadline import teardown_abort  # noqa: E402

TARGET = Path(__file__).with_name("multinode_target.py")
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for(nodes, logs, seconds: float, grace: float = 20.0):
    """Each node's stderr (from its file in `logs`), and the ranks this stopped. torchrun's agent whose
    workers succeeded waits in its exit barrier (torch's default: 300 s) for every other agent; an agent
    whose worker ended with torch's known abort at interpreter exit never joins it. So once a node has
    ended that way, the others get `grace` seconds, then are stopped (their workers are done: training
    needed every rank), with SIGTERM and, when an agent does not end within 30 s, SIGKILL."""
    deadline = time.monotonic() + seconds
    aborted_at = None
    stopped = set()
    try:
        while any(node.poll() is None for node in nodes) and time.monotonic() < deadline:
            if aborted_at is None and any(node.poll() not in (None, 0) for node in nodes):
                aborted_at = time.monotonic()
            if aborted_at is not None and time.monotonic() > aborted_at + grace:
                stopped = {rank for rank, node in enumerate(nodes) if node.poll() is None}
                for rank in stopped:
                    nodes[rank].terminate()
                break
            time.sleep(0.5)
        for rank, node in enumerate(nodes):
            try:
                node.wait(timeout=30)
            except subprocess.TimeoutExpired:
                if rank not in stopped:
                    raise
                node.kill()  # an agent in its exit barrier may not answer SIGTERM: its workers are done
                node.wait(timeout=30)
        return [log.read_text() for log in logs], stopped
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()


@pytest.mark.distributed
def test_two_torchrun_nodes_train_as_one_process_with_the_global_batch(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    env["CUDA_VISIBLE_DEVICES"] = ""
    subprocess.run([sys.executable, str(TARGET), str(tmp_path / "one.pt")], env=env, check=True, timeout=120,
                   capture_output=True)
    port = _free_port()
    logs = [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    nodes = []
    for rank, log in enumerate(logs):
        with log.open("w") as stream:
            nodes.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={rank}",
                 "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                 "--rdzv-id=deepepochs-multinode", str(TARGET), str(tmp_path / "two.pt")],
                env=env, stdout=subprocess.DEVNULL, stderr=stream))
    outputs, stopped = _wait_for(nodes, logs, seconds=180)
    for rank, (node, stderr) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0 or teardown_abort(node.returncode, stderr) or rank in stopped, stderr[-3000:]
    one = torch.load(tmp_path / "one.pt", weights_only=True)
    two = torch.load(tmp_path / "two.pt", weights_only=True)
    assert two["world_size"] == 2 and one["world_size"] == 1
    for name, value in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], value, rtol=0, atol=1e-5)
    for stage, metrics in one["records"].items():
        for name, values in metrics.items():
            assert two["records"][stage][name] == pytest.approx(values, abs=1e-5), (stage, name)
