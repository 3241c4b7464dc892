"""Which GPU each rank takes, for every layout a cluster user asks for (ranks/env.py), with CUDA faked: CI has no GPU.

SLURM's per-task binding (--gpus-per-task=1) shows each task one GPU, cuda:0 inside it, while its local rank counts
0..n-1; --gpus-per-node shows every task the node's GPUs. torchrun's workers and launch()'s ranks share what their
starter sees. The device a rank drives (engine.worker.device_for) and the check made before init_process_group
(cli/torchrun.run_torchrun, ranks/checks.resolve_backend) follow the one rule.
"""
from __future__ import annotations

import os

import pytest
import torch

from ddp_helpers.common.errors import ConfigError
from ddp_helpers.engine.config import TrainConfig
from ddp_helpers.engine.worker import device_for
from ddp_helpers.ranks.checks import RankSizes, resolve_backend
from ddp_helpers.ranks.env import adopt_scheduler_env
from ddp_helpers.ranks.env import GpuLayout

RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "CUDA_VISIBLE_DEVICES")


@pytest.fixture
def gpus(monkeypatch):
    """CUDA faked with a settable count of visible GPUs; the GPUs set_device was given, in order."""
    chosen: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: chosen.append(int(index)))

    def see(count: int) -> list:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        return chosen
    return see


def _environment(monkeypatch, **variables: str) -> None:
    """Exactly these rank variables in os.environ, restored after the test (adopt_scheduler_env's too)."""
    for name in set(RANK_VARS) | {k for k in os.environ if k.startswith("SLURM_")} | set(variables):
        monkeypatch.setenv(name, "")  # recorded, so that whatever the test sets is undone
        monkeypatch.delenv(name)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)


def _srun_task(monkeypatch, localid: int, tasks_per_node: int = 4, **extra: str) -> None:
    """One task of `srun -N2 --ntasks-per-node=<tasks_per_node>` on node 1, read as torchrun's variables."""
    _environment(monkeypatch, SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_NODEID="1",
                 SLURM_PROCID=str(tasks_per_node + localid), SLURM_LOCALID=str(localid),
                 SLURM_STEP_NUM_TASKS=str(2 * tasks_per_node), SLURM_STEP_TASKS_PER_NODE=f"{tasks_per_node}(x2)",
                 SLURM_STEP_NODELIST="gpu[07-08]", **extra)
    assert adopt_scheduler_env()


def _torchrun_worker(monkeypatch, local_rank: int, local_world_size: int, **extra: str) -> None:
    """One worker of `torchrun --nnodes=2 --nproc-per-node=<local_world_size>` on node 1."""
    _environment(monkeypatch, RANK=str(local_world_size + local_rank), LOCAL_RANK=str(local_rank),
                 WORLD_SIZE=str(2 * local_world_size), LOCAL_WORLD_SIZE=str(local_world_size), GROUP_RANK="1",
                 MASTER_ADDR="gpu07", MASTER_PORT="29500", TORCHELASTIC_RUN_ID="job", **extra)


@pytest.mark.parametrize("visible, ranks, own, held, devices, local_rank, index", [
    (4, 4, False, None, None, 3, 3),  # every rank sees the node's GPUs (torchrun, launch())
    (4, 4, True, 4, "0,1,2,3", 3, 3),  # srun --gpus-per-node=4: each task sees the node's GPUs
    (8, 4, True, None, None, 2, 2),  # more GPUs than ranks: the first ones
    (1, 4, True, 4, "3", 3, 0),  # srun --gpus-per-task=1: each task's own GPU is its cuda:0
    (2, 4, True, 8, "6,7", 3, 0),  # srun --gpus-per-task=2: the first of its own two
    (1, 1, False, None, None, 0, 0),  # one rank, one GPU
])
def test_each_layout_gives_its_gpu(visible, ranks, own, held, devices, local_rank, index):
    layout = GpuLayout(visible, ranks, own, held, devices)
    assert layout.fits and layout.index(local_rank) == index


@pytest.mark.parametrize("visible, ranks, own, held, devices, said", [
    (2, 4, True, 4, "0,1", "share the 4 GPU(s) the step holds on it (SLURM_GPUS_ON_NODE=4), each seeing 2"),
    (3, 4, False, None, None, "share the 3 GPU(s) they all see"),
    (1, 2, False, None, None, "share the 1 GPU(s) they all see"),
    (0, 2, True, None, None, "none is visible"),
    (1, 2, True, 1, "0", "share the 1 GPU(s) the step holds on it"),  # srun -n2 --gres=gpu:1
    (1, 2, True, None, None, "that SLURM did not give the step (no SLURM_GPUS_ON_NODE)"),  # srun -n2, no gres
    (1, 2, True, 2, "MIG-a,MIG-b", "each see 1 of the 2 devices CUDA_VISIBLE_DEVICES lists"),  # MIG
])
def test_a_layout_leaving_a_rank_without_a_gpu_is_refused(visible, ranks, own, held, devices, said):
    layout = GpuLayout(visible, ranks, own, held, devices)
    assert not layout.fits
    with pytest.raises(ConfigError, match=r"TrainConfig\.backend='nccl' is not accepted: nccl needs") as refused:
        layout.index(0)
    assert said in str(refused.value)


def test_srun_gpus_per_task_rank_takes_cuda_0(monkeypatch, gpus):
    chosen = gpus(1)  # srun --gpus-per-task=1: CUDA_VISIBLE_DEVICES names one GPU in each task
    _srun_task(monkeypatch, localid=2, CUDA_VISIBLE_DEVICES="2", SLURM_GPUS_ON_NODE="4")
    assert device_for(6, "nccl") == torch.device("cuda", 0) and chosen == [0]  # not cuda:2: invalid ordinal
    sizes = RankSizes.checked(4, 1, owner="TrainConfig", room=False)
    assert sizes.place("nccl", None, layout=GpuLayout.of_rank()) == "nccl"  # not refused before the launch
    assert sizes.place("auto", None, layout=GpuLayout.of_rank()) == "nccl"  # nor taken for too few GPUs (gloo)


@pytest.mark.parametrize("held", ["4", "8"])
def test_srun_tasks_each_on_a_gpu_of_their_own_take_cuda_0(monkeypatch, gpus, held):
    chosen = gpus(1)  # --gpus-per-task=1 on a node where the step holds a GPU per task (or more)
    _srun_task(monkeypatch, localid=3, CUDA_VISIBLE_DEVICES="3", SLURM_GPUS_ON_NODE=held)
    assert device_for(7, "nccl") == torch.device("cuda", 0) and chosen == [0]


def test_srun_tasks_sharing_one_gpu_are_refused(monkeypatch, gpus):
    gpus(1)  # srun -n2 --gres=gpu:1: the step holds one GPU on the node, and both tasks see it as GPU 0
    _srun_task(monkeypatch, localid=1, tasks_per_node=2, CUDA_VISIBLE_DEVICES="0", SLURM_GPUS_ON_NODE="1")
    with pytest.raises(ConfigError) as refused:
        device_for(3, "nccl")
    words = str(refused.value)
    assert "share the 1 GPU(s) the step holds on it (SLURM_GPUS_ON_NODE=1)" in words
    assert "--gpus-per-node=2" in words and "--gpus-per-task=1" in words
    assert resolve_backend("auto", 4, layout=GpuLayout.of_rank()) == "gloo"  # auto: CPU ranks, not a shared GPU


def test_srun_gpus_per_node_rank_takes_cuda_local_rank(monkeypatch, gpus):
    chosen = gpus(4)  # srun --gpus-per-node=4: every task sees the node's 4 GPUs
    _srun_task(monkeypatch, localid=2, CUDA_VISIBLE_DEVICES="0,1,2,3")
    assert device_for(6, "nccl") == torch.device("cuda", 2) and chosen == [2]


def test_torchrun_worker_takes_cuda_local_rank(monkeypatch, gpus):
    chosen = gpus(4)
    _torchrun_worker(monkeypatch, local_rank=3, local_world_size=4)
    assert device_for(7, "nccl") == torch.device("cuda", 3) and chosen == [3]


def test_srun_tasks_seeing_some_gpus_are_refused_with_both_fixes(monkeypatch, gpus):
    gpus(2)  # e.g. --gpus-per-task=2, or --gpu-bind=closest: 4 tasks each see 2 GPUs
    _srun_task(monkeypatch, localid=1, CUDA_VISIBLE_DEVICES="0,1")
    with pytest.raises(ConfigError) as refused:
        device_for(5, "nccl")
    words = str(refused.value)
    assert "TrainConfig.backend='nccl' is not accepted" in words and "LOCAL_WORLD_SIZE=4" in words
    assert "each see 2 GPU(s) (CUDA_VISIBLE_DEVICES='0,1') that SLURM did not give the step" in words
    assert "--gpus-per-node=4" in words and "--gpus-per-task=1" in words and "backend='gloo'" in words
    with pytest.raises(ConfigError, match="--gpus-per-node=4"):
        RankSizes.checked(4, 1, owner="TrainConfig", room=False).place("nccl", None, layout=GpuLayout.of_rank())


def test_torchrun_workers_sharing_one_gpu_are_refused(monkeypatch, gpus):
    """torchrun's workers all see what their task sees: one GPU is one GPU shared, whatever SLURM was asked."""
    gpus(1)
    _torchrun_worker(monkeypatch, local_rank=1, local_world_size=2, SLURM_JOB_ID="4242", SLURM_STEP_ID="0",
                     SLURM_PROCID="1", SLURM_LOCALID="0", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="1(x2)")
    with pytest.raises(ConfigError) as refused:
        device_for(3, "nccl")
    words = str(refused.value)
    assert "share the 1 GPU(s) they all see" in words and "--gpus-per-node=2" in words and "--nproc-per-node=1" in words
    assert resolve_backend("auto", 2, layout=GpuLayout.of_rank()) == "gloo"  # auto: CPU ranks, as before


def test_run_torchrun_refuses_the_layout_before_the_group_starts(monkeypatch, gpus, tmp_path):
    """The refusal comes before init_process_group (run_rank), and in the command line's words."""
    from ddp_helpers.cli import torchrun
    from ddp_helpers.cli.words import for_flags
    from ddp_helpers.ranks import rank

    gpus(2)
    _srun_task(monkeypatch, localid=0, CUDA_VISIBLE_DEVICES="0,1")
    started = []
    monkeypatch.setattr(rank, "run_rank", lambda *args, **kwargs: started.append(args))
    with pytest.raises(ConfigError) as refused:
        torchrun.run_torchrun(TrainConfig(backend="nccl", world_size=8), str(tmp_path / "out"), plots=False)
    assert started == [] and "--backend nccl is not accepted" in for_flags(refused.value)


def test_launched_ranks_share_this_process_gpus(gpus):
    """launch() and run_training start their ranks here: one GPU for two of them is refused, as before."""
    gpus(1)
    with pytest.raises(ConfigError, match=r"TrainConfig\.world_size=2 is not accepted with backend='nccl'"):
        resolve_backend("nccl", 2)
    assert resolve_backend("auto", 2) == "gloo"
    gpus(2)
    assert resolve_backend("nccl", 2) == resolve_backend("auto", 2) == "nccl"
