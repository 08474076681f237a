"""SLURM as an environment: a task of `srun --ntasks=N` gets its rank, world size and rendezvous from SLURM's
variables; the batch script itself and torchrun inside a job are left alone; missing variables are named;
requeue=True outside a SLURM job is refused. (Real jobs: tests/slurm/.)"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

import deepepochs as de
from deepepochs.errors import ConfigError
from deepepochs.parallel import slurm

TASK = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
        "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "8", "SLURM_STEP_NODELIST": "gpu[07-08],cpu1",
        "SLURM_JOB_NODELIST": "gpu[01-09]"}


def test_a_task_of_a_multi_task_step_gets_torchrun_variables_from_slurm():
    """Rank from SLURM_PROCID, world size from the step's tasks, the first host of the step, a port from
    the job id."""
    assert slurm.torch_environment(TASK) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                             "MASTER_ADDR": "gpu07", "MASTER_PORT": str(20000 + 4242 % 20000)}


#: Host lists in the forms SLURM documents and writes, with the first host `scontrol show hostnames` prints.
HOST_LISTS = [("vm", "vm"), ("node[3-5,9]", "node3"), ("a1,b2", "a1"), ("rack2-n[010-012]", "rack2-n010"),
              ("x[4]", "x4"), ("rack[1-2]-node[01-02]", "rack1-node01"), ("a[1-3,5],b7", "a1"),
              ("node[003-005,9]", "node003"), ("a-b-c", "a-b-c"), ("n[1-2,4-5]-x[7,9]", "n1-x7"),
              ("a[1-2][3-4]", "a13"), ("n[5,1-3]", "n5"), ("b,a", "b"), ("n[01-2]", "n01"), ("n[1-02]", "n1"),
              ("a[9-11]", "a9"), ("n[099-101]", "n099"), ("[01]", "01"), ("node-[1-2]", "node-1"),
              ("h.example.com", "h.example.com"), ("a.b[1-2]", "a.b1"), (",a", "a"), ("a b", "a"),
              ("n[1-2]\tm", "n1"), ("n[1-2],,m", "n1"), ("ab[1-2]cd-e[3]", "ab1cd-e3"),
              ("a[1-2],b[3-4]-c[5-6]", "a1"), ("n[12345678901-12345678902]", "n12345678901"), ("n[0-0]", "n0")]
#: Host lists SLURM refuses ("Invalid hostlist"): text after a bracket group, a range running backwards, an
#: empty or non-numeric range, nested or unbalanced brackets (anywhere in the list).
BAD_HOST_LISTS = ["n[01-02]x,plain", "a[1]b", "node[1-2]-gpu", "n[1-2].example.com", "rack[2-1]", "n[a-c]",
                  "n[]", "n[-2]", "n[1--2]", "n[1,]", "n[,1]", "n[[1]]", "n[1]]", "bgl[123x456]",
                  "n[1-2],m[3-4]x", "", " , "]


@pytest.mark.parametrize("nodelist, first", HOST_LISTS)
def test_the_first_host_of_a_slurm_host_list_is_the_one_slurm_lists_first(nodelist, first):
    """Ranges, zero padding, several bracket groups, comma and blank separated lists, dashes in names."""
    assert slurm.first_host(nodelist) == first


@pytest.mark.parametrize("nodelist", BAD_HOST_LISTS)
def test_a_host_list_slurm_refuses_is_refused_naming_it(nodelist):
    """What SLURM calls an invalid host list is a ConfigError quoting it, never a guessed host."""
    with pytest.raises(ConfigError, match=re.escape(f"SLURM host list {nodelist!r}")):
        slurm.first_host(nodelist)


def _scontrol_answers() -> bool:
    if shutil.which("scontrol") is None:
        return False
    try:
        return subprocess.run(["scontrol", "ping"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _scontrol_answers(), reason="needs a running SLURM (scontrol ping answers): .ci/start-slurm")
def test_the_first_host_agrees_with_scontrol_show_hostnames():
    """Against the real SLURM: every valid list's first host is the first line `scontrol show hostnames`
    prints, and every list this module refuses, SLURM refuses too."""
    for nodelist, _ in HOST_LISTS:
        shown = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                               timeout=20)
        assert shown.returncode == 0 and shown.stdout.split("\n")[0] == slurm.first_host(nodelist), nodelist
    for nodelist in BAD_HOST_LISTS:
        shown = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                               timeout=20)
        assert shown.returncode != 0 or not shown.stdout.strip(), (nodelist, shown.stdout)


@pytest.mark.parametrize("tasks", [{"SLURM_STEP_NUM_TASKS": "4"}, {"SLURM_STEP_NUM_TASKS": None, "SLURM_NTASKS": "4"}])
@pytest.mark.parametrize("procid", ["4", "9"])
def test_a_rank_not_below_the_task_count_is_refused_naming_both_variables(tasks, procid):
    """SLURM_PROCID must be below the task count it is taken with; the message names both variables."""
    env = dict(TASK, SLURM_PROCID=procid, **{k: v for k, v in tasks.items() if v is not None})
    for name in [k for k, v in tasks.items() if v is None]:
        del env[name]
    source = "SLURM_STEP_NUM_TASKS" if tasks.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    with pytest.raises(ConfigError, match=re.escape(f"SLURM_PROCID={procid} is not below the task count"
                                                    f" {source}=4")):
        slurm.torch_environment(env)


def test_a_trainer_whose_slurm_rank_is_out_of_range_fails_at_once():
    """Trainer(...) in such a step raises the ConfigError within seconds (before, it waited forever for ranks
    that do not exist); run in a child process, bounded in time."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                   "MASTER_"))}
    env.update(TASK, SLURM_PROCID="2", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="localhost",
               MASTER_PORT="29581")
    code = ("import torch, deepepochs as de\nm = torch.nn.Linear(2, 1)\n"
            "de.Trainer(m, torch.nn.functional.mse_loss, torch.optim.SGD(m.parameters(), lr=0.1))")
    try:
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("Trainer(...) did not return within 120 s")
    assert done.returncode == 1
    assert ("ConfigError: SLURM_PROCID=2 is not below the task count SLURM_STEP_NUM_TASKS=2"
            in done.stderr.strip().splitlines()[-1]), done.stderr[-2000:]


def test_a_bad_host_list_in_a_slurm_step_names_its_variable():
    with pytest.raises(ConfigError, match=re.escape("SLURM host list 'n[2-1]' (from SLURM_STEP_NODELIST) has an item"
                                                    " SLURM refuses, 'n[2-1]'")):
        slurm.torch_environment(dict(TASK, SLURM_STEP_NODELIST="n[2-1]"))


def test_the_job_nodelist_and_ntasks_stand_in_for_the_step_ones_and_set_variables_stay():
    env = {k: v for k, v in TASK.items() if k not in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST")}
    env["MASTER_PORT"] = "29999"
    values = slurm.torch_environment(env)
    assert values["WORLD_SIZE"] == "8" and values["MASTER_ADDR"] == "gpu01" and values["MASTER_PORT"] == "29999"


@pytest.mark.parametrize("change", [{"SLURM_STEP_ID": None}, {"RANK": "0"}, {"SLURM_STEP_NUM_TASKS": "1"}])
def test_the_batch_script_a_torchrun_job_and_a_one_task_step_are_not_taken_over(change):
    """No SLURM_STEP_ID (the batch script), torchrun's RANK already set, or a one-task step: nothing to do."""
    env = dict(TASK, **{k: v for k, v in change.items() if v is not None})
    for name in [k for k, v in change.items() if v is None]:
        del env[name]
    assert slurm.torch_environment(env) is None


def test_a_slurm_step_missing_variables_names_them():
    env = {k: v for k, v in TASK.items() if k not in ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")}
    with pytest.raises(ConfigError, match=r"lacks SLURM_PROCID, SLURM_STEP_NUM_TASKS \(or SLURM_NTASKS\)"):
        slurm.torch_environment(env)


def test_a_malformed_slurm_variable_is_named():
    with pytest.raises(ConfigError, match=r"SLURM_PROCID must be a non-negative integer \(got 'x'\)"):
        slurm.torch_environment(dict(TASK, SLURM_PROCID="x"))


@pytest.mark.parametrize("name", ["SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_ID", "SLURM_STEP_NUM_TASKS"])
@pytest.mark.parametrize("value", ["\u00b2", "\u0663", "1_0", "+1"])
def test_a_slurm_variable_in_other_digits_is_named(name, value):
    """A superscript, another script's digit, an underscore or a sign: a `ConfigError` naming the variable,
    never a bare `ValueError` nor a rank `int()` read in another script's digits."""
    with pytest.raises(ConfigError, match=rf"SLURM variable {name} must be a non-negative integer \(got "):
        slurm.torch_environment(dict(TASK, **{name: value}))


@pytest.mark.parametrize("name", ["RANK", "WORLD_SIZE", "LOCAL_RANK"])
def test_a_torchrun_variable_in_other_digits_is_named(monkeypatch, name):
    """RANK, WORLD_SIZE and LOCAL_RANK as torchrun sets them are read by one rule, which names the variable."""
    from deepepochs.parallel.process_group import env_int
    monkeypatch.setenv(name, "\u00b2")
    with pytest.raises(ConfigError, match=rf"environment variable {name} must be a non-negative integer"):
        env_int(name)
    monkeypatch.setenv(name, " 7 ")
    assert env_int(name) == 7


def test_a_trainer_under_a_malformed_world_size_names_it(monkeypatch):
    """The Trainer reads WORLD_SIZE to pick its strategy: a superscript there is named, not a bare ValueError."""
    import torch
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "\u00b2")
    with pytest.raises(ConfigError, match=r"WORLD_SIZE must be a non-negative integer \(got '\u00b2'\)"):
        de.Trainer(torch.nn.Linear(2, 1), torch.nn.functional.mse_loss,
                   lambda p: torch.optim.SGD(p, lr=0.1))


def test_requeue_outside_a_slurm_job_is_refused(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(ConfigError, match=r"requeue=True requeues a SLURM job, but this process runs outside one"):
        de.SnapshotCallback(requeue=True)
    with pytest.raises(ConfigError, match="requeue needs a SLURM job: SLURM_JOB_ID is not set"):
        slurm.requeue()


def test_requeue_must_be_a_bool(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    with pytest.raises(ConfigError, match=r"requeue must be True or False \(got 'yes'\)"):
        de.SnapshotCallback(requeue="yes")
    assert de.SnapshotCallback(requeue=True).requeue is True


def test_a_trainer_in_a_slurm_step_with_missing_variables_fails_naming_them(monkeypatch):
    """The check runs when the trainer picks its distributed policy, before anything trains."""
    import torch

    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "vm")
    model = torch.nn.Linear(2, 1)
    with pytest.raises(ConfigError, match="lacks SLURM_PROCID"):
        de.Trainer(model, torch.nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1))
