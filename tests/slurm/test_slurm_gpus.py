"""What SLURM shows each task of a GPU step, read by the package's rule (ranks/env.py), on the test cluster.

The cluster's nodes have two fake GPUs each (tools/slurm_cluster.py), so SLURM sets each task's CUDA_VISIBLE_DEVICES
as on a GPU cluster; CUDA is faked in the task as seeing exactly those devices (no GPU here), so what is checked is
SLURM's environment (its task variables and CUDA_VISIBLE_DEVICES) feeding the rule, not CUDA itself.
"""
from __future__ import annotations

import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
TASK = r"""
import os, sys, types
seen = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
cuda = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: len(seen))
sys.modules["torch"] = types.SimpleNamespace(cuda=cuda)  # CUDA as CUDA_VISIBLE_DEVICES shows it
from ddp_helpers.ranks.env import adopt_scheduler_env
from ddp_helpers.ranks.env import GpuLayout, rank_gpu
adopt_scheduler_env()
layout = GpuLayout.of_rank()
try:
    said = f"cuda:{rank_gpu(int(os.environ['RANK']))}"
except ValueError as e:
    said = f"refused: {e}"
print(os.environ["SLURM_LOCALID"], ",".join(seen), layout.local_world_size, layout.own_views, said, sep="|")
"""


def _tasks(slurm, *flags: str) -> list:
    """Each task's (CUDA_VISIBLE_DEVICES, ranks on its node, own view, device or refusal), by local id."""
    if "gpu" not in slurm.run(["sinfo", "-h", "-o", "%G"]).stdout:  # a cluster kept up from before the fake GPUs
        pytest.skip("the running test cluster has no GPUs: restart it (python tools/slurm_cluster.py stop, then start)")
    env = slurm.env({**os.environ, "PYTHONPATH": str(ROOT)})
    out = slurm.run(["srun", "-N1", *flags, sys.executable, "-c", TASK], env=env, timeout=60)
    rows = sorted(line.split("|") for line in out.stdout.splitlines() if line.count("|") == 4)
    return [tuple(row[1:]) for row in rows]


@pytest.mark.parametrize("flags", [("-n2", "--gpus-per-task=1"), ("-n2", "--gres=gpu:2", "--gpu-bind=single:1")])
def test_gpus_per_task_gives_each_task_its_own_gpu_as_cuda_0(slurm, flags):
    tasks = _tasks(slurm, *flags)
    assert [t[1:] for t in tasks] == [("2", "True", "cuda:0")] * 2  # LOCAL_WORLD_SIZE 2, each on its own cuda:0
    assert len({t[0] for t in tasks}) == 2 and all("," not in t[0] for t in tasks)  # two different single GPUs


def test_gpus_per_node_gives_every_task_the_nodes_gpus(slurm):
    assert _tasks(slurm, "-n2", "--gpus-per-node=2") == [("0,1", "2", "True", "cuda:0"), ("0,1", "2", "True", "cuda:1")]


def test_too_few_gpus_for_the_tasks_are_refused_with_the_flags(slurm):
    tasks = _tasks(slurm, "-n3", "--gpus-per-node=2")  # three tasks, each seeing the node's two GPUs
    assert len(tasks) == 3
    for seen, ranks, own, said in tasks:
        assert (seen, ranks, own) == ("0,1", "3", "True")
        assert said.startswith("refused: ") and "--gpus-per-node=3" in said and "--gpus-per-task=1" in said


def test_tasks_sharing_the_steps_one_gpu_are_refused(slurm):
    tasks = _tasks(slurm, "-n2", "--gres=gpu:1")  # the step holds one GPU on the node: both tasks see it as 0
    assert [t[:3] for t in tasks] == [("0", "2", "True")] * 2
    assert all(t[3].startswith("refused: ") and "SLURM_GPUS_ON_NODE=1" in t[3] for t in tasks)
