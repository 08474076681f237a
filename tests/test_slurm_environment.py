"""SLURM as an environment: a task of `srun --ntasks=N` gets its rank, world size and rendezvous from SLURM's
variables; the batch script itself and torchrun inside a job are left alone; missing variables are named;
requeue=True outside a SLURM job is refused. (Real jobs: tests/slurm/.)"""

from __future__ import annotations

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


@pytest.mark.parametrize("nodelist, first", [("vm", "vm"), ("node[3-5,9]", "node3"), ("a1,b2", "a1"),
                                             ("rack2-n[010-012]", "rack2-n010"), ("x[4]", "x4")])
def test_the_first_host_of_a_slurm_host_list(nodelist, first):
    assert slurm.first_host(nodelist) == first


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
