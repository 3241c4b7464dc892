"""The nccl path: runs only where CUDA GPUs are present, skipped cleanly elsewhere (CI has no GPU)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ddp_helpers import TrainConfig, run_training, train_single_process

N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(N_GPUS == 0, reason="no CUDA GPU on this machine")


@needs_gpu
@pytest.mark.slow
def test_auto_backend_uses_nccl_on_gpus():
    world = min(2, N_GPUS)
    res = run_training(TrainConfig(dataset="mnist-5k", world_size=world, max_steps=8), progress=False)
    assert res.backend == "nccl"
    assert res.fingerprints_agree() and res.synced_norms_agree()
    assert len(res.peak_cuda_mb) == world and all(m > 0 for m in res.peak_cuda_mb)  # each rank's own GPU
    ref = train_single_process(TrainConfig(dataset="mnist-5k", world_size=world, max_steps=8))
    assert np.allclose(res.final_params, ref.final_params, rtol=1e-4, atol=1e-5)


@needs_gpu
@pytest.mark.slow
def test_more_ranks_than_gpus_fall_back_to_gloo_with_auto():
    res = run_training(TrainConfig(dataset="mnist-5k", world_size=N_GPUS + 1, max_steps=2, threads_per_rank=1),
                       progress=False)
    assert res.backend == "gloo" and res.fingerprints_agree()


@needs_gpu
def test_an_srun_task_shown_one_gpu_of_its_own_allocates_on_cuda_0():
    # task 1 of an srun step with --gpus-per-task=1 on a node it shares with task 0: SLURM shows it one GPU, cuda:0
    # inside it, while its local rank is 1 (cuda:1 would be an invalid device ordinal)
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0], SLURM_JOB_ID="7",
               SLURM_STEP_ID="0", SLURM_PROCID="1", SLURM_LOCALID="1", SLURM_NODEID="0", SLURM_STEP_NUM_TASKS="2",
               SLURM_STEP_TASKS_PER_NODE="2", SLURM_STEP_NODELIST="localhost", SLURM_GPUS_ON_NODE="2")
    code = ("from ddp_helpers.ranks.env import adopt_scheduler_env; adopt_scheduler_env(); import torch; "
            "from ddp_helpers.engine.worker import device_for; print(torch.ones(1, device=device_for(1, 'nccl')).device)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["cuda:0"], out.stderr[-2000:]
