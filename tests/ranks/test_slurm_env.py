"""SLURM's variables as a way into a rank (ranks/env.py): host lists and tasks per node expanded as SLURM writes
them, torchrun's variables winning where both are set, and no rank where srun didn't start several tasks."""
from __future__ import annotations

import pathlib

import pytest

from ddp_helpers.ranks.env import RankEnv, adopt_scheduler_env, scheduler_env
from ddp_helpers.ranks.env import (PORT_BASE, PORT_SPAN, SlurmJob, SlurmTask, expand_hostlist,
                                     expand_tasks_per_node, rendezvous_port)

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("text, hosts", [
    ("n1", ["n1"]),
    ("node[1-3,5]", ["node1", "node2", "node3", "node5"]),
    ("a[01-02],b3", ["a01", "a02", "b3"]),
    ("gpu[008-010]", ["gpu008", "gpu009", "gpu010"]),
    ("n[9-10]", ["n9", "n10"]),
    ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
    ("x[1]y,z", ["x1y", "z"]),
    ("login-1.cluster,node[2]", ["login-1.cluster", "node2"]),
])
def test_host_lists_expand_as_slurm_writes_them(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[1-", "node]1[", "node[a-b]", "node[3-1]", "", "n[[1]]"])
def test_a_host_list_that_cannot_be_read_is_named(text):
    with pytest.raises(ValueError, match="SLURM host list"):
        expand_hostlist(text)


@pytest.mark.parametrize("text, counts", [("1", [1]), ("2(x3)", [2, 2, 2]), ("2(x3),1", [2, 2, 2, 1]),
                                          ("4,1(x2)", [4, 1, 1])])
def test_tasks_per_node_expand(text, counts):
    assert expand_tasks_per_node(text) == counts


def test_unreadable_tasks_per_node_are_named():
    with pytest.raises(ValueError, match=r"N\(xK\)"):
        expand_tasks_per_node("2(3)")


def _srun_task(procid: int, nodeid: int, localid: int, **extra) -> dict:
    """What srun -N2 --ntasks-per-node=2 sets for one task (as the test cluster shows it)."""
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid), "SLURM_NODEID": str(nodeid),
            "SLURM_LOCALID": str(localid), "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4",
            "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_NODELIST": "gpu[07-08]",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NTASKS_PER_NODE": "2",
            **extra}


def test_an_srun_task_becomes_torchrun_variables():
    env = scheduler_env(_srun_task(3, 1, 1))
    assert env == {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
                   "MASTER_ADDR": "gpu07", "MASTER_PORT": str(rendezvous_port("4242"))}
    assert RankEnv.from_environ(_srun_task(3, 1, 1)) == RankEnv(3, 1, 4, 2, "gpu07", rendezvous_port("4242"))


def test_uneven_tasks_per_node_give_each_node_its_own_count():
    task = {**_srun_task(4, 1, 0), "SLURM_STEP_TASKS_PER_NODE": "4,1", "SLURM_STEP_NUM_TASKS": "5"}
    assert scheduler_env(task)["LOCAL_WORLD_SIZE"] == "1" and scheduler_env(task)["WORLD_SIZE"] == "5"


def test_the_port_comes_from_the_job_id_and_a_set_address_or_port_is_kept():
    ports = [rendezvous_port(str(j)) for j in range(PORT_SPAN)]
    assert len(set(ports)) == PORT_SPAN and 1024 < min(ports) and max(ports) < 32768  # below the ephemeral range
    template = (EXAMPLES / "slurm_torchrun.sbatch").read_text()  # the sbatch template derives the same port
    assert f"PORT=$(( {PORT_BASE} + SLURM_JOB_ID % {PORT_SPAN} ))" in template
    env = scheduler_env(_srun_task(0, 0, 0, MASTER_ADDR="10.0.0.9", MASTER_PORT="29400"))
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.9", "29400")


def test_torchrun_inside_an_allocation_wins():
    torchrun = {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    environ = {**_srun_task(3, 1, 1), **torchrun}
    assert adopt_scheduler_env(environ) is False
    assert {k: environ[k] for k in torchrun} == torchrun
    assert RankEnv.from_environ(environ) == RankEnv(1, 0, 2, 1, "127.0.0.1", 29500)


def test_adopting_sets_the_variables_once():
    environ = _srun_task(2, 1, 0)
    assert adopt_scheduler_env(environ) is True
    assert (environ["RANK"], environ["WORLD_SIZE"], environ["MASTER_ADDR"]) == ("2", "4", "gpu07")
    assert adopt_scheduler_env(environ) is False  # now torchrun's variables are there


@pytest.mark.parametrize("case", ["batch script", "one task", "no slurm"])
def test_no_rank_where_srun_did_not_start_several_tasks(case):
    environ = {"batch script": {k: v for k, v in _srun_task(0, 0, 0).items() if k != "SLURM_STEP_ID"},
               "one task": _srun_task(0, 0, 0, SLURM_STEP_NUM_TASKS="1", SLURM_NTASKS="1"),
               "no slurm": {"PATH": "/usr/bin"}}[case]
    assert scheduler_env(environ) == {}
    assert adopt_scheduler_env(environ) is False and "RANK" not in environ
    with pytest.raises(RuntimeError, match="srun"):
        RankEnv.from_environ(environ)


def test_bad_slurm_variables_are_named():
    with pytest.raises(ValueError, match="SLURM_PROCID='x'"):
        scheduler_env(_srun_task(0, 0, 0, SLURM_PROCID="x"))
    with pytest.raises(ValueError, match="SLURM host list"):
        scheduler_env(_srun_task(0, 0, 0, SLURM_STEP_NODELIST="gpu[07-"))


def test_the_job_its_step_and_its_requeues_are_read():
    assert SlurmJob.from_environ({"PATH": "/usr/bin"}) is None
    assert SlurmJob.from_environ({"SLURM_JOB_ID": "7"}) == SlurmJob("7", None, 0)
    assert SlurmJob.from_environ({"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "2", "SLURM_RESTART_COUNT": "1"}) == \
        SlurmJob("7", "2", 1)
    task = SlurmTask.from_environ(_srun_task(1, 0, 1))
    assert task.hosts == ("gpu07", "gpu08") and task.tasks_per_node == (2, 2) and task.job.step_id == "0"
