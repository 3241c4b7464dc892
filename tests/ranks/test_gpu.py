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
