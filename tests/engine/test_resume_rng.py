"""Exact resumes with random draws after the sampler: every rank's generator states travel in the checkpoint."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from ddp_helpers import RankFailedError, TrainConfig, latest_checkpoint, run_training
from ddp_helpers.engine import worker
from ddp_helpers.engine.checkpoint import load_checkpoint
from ddp_helpers.engine.rng import rank_seed, rng_state, set_rng_state

CFG = TrainConfig(dataset="mnist-5k", backend="gloo", max_steps=12, threads_per_rank=1, momentum=0.9)


def _draws() -> tuple:
    """One draw from each global generator a training loop might use."""
    return torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)]


def test_restored_states_repeat_the_same_draws_after_a_weights_only_round_trip(tmp_path):
    torch.manual_seed(3), np.random.seed(3), random.seed(3)
    np.random.randn()  # leaves a cached Gaussian in NumPy's state: it must survive too
    path = tmp_path / "rng.pt"
    torch.save(rng_state(), path)
    first = _draws()
    set_rng_state(torch.load(path, weights_only=True))
    again = _draws()
    assert torch.equal(first[0], again[0]) and np.array_equal(first[1], again[1]) and first[2] == again[2]
    assert not torch.equal(first[0], _draws()[0])  # the streams move on, so the equality above is not trivial


def test_rank_seeds_differ_between_ranks_and_seeds_and_repeat():
    seeds = {(s, r): rank_seed(s, r) for s in range(3) for r in range(4)}
    assert len(set(seeds.values())) == len(seeds)  # (0, 1) and (1, 0) too
    assert rank_seed(0, 1) == seeds[(0, 1)]


def _dropout_model(seed: int) -> nn.Module:
    """The package's model behind input dropout: same parameter names and shapes, random draws every step."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Sequential(nn.Dropout(0.3), nn.Flatten()), nn.Linear(28 * 28, 10))


@pytest.fixture
def dropout_runs(tmp_path, monkeypatch):
    """(uninterrupted run, checkpoint folder of the same run crashed at step 9 with checkpoints every 4 steps)."""
    monkeypatch.setattr(worker, "build_model", _dropout_model)  # forked ranks inherit the patched worker
    full = run_training(CFG, progress=False, start_method="fork")
    ck = tmp_path / "ck"
    with pytest.raises(RankFailedError):
        run_training(CFG.replace(checkpoint_dir=str(ck), checkpoint_every=4, fault_rank=1, fault_step=9),
                     progress=False, start_method="fork")
    return full, ck


@pytest.mark.slow
def test_a_crashed_dropout_run_resumes_bitwise_exactly(dropout_runs):
    full, ck = dropout_runs
    latest = latest_checkpoint(str(ck))
    assert latest.endswith("ckpt-0000008.pt")
    states = load_checkpoint(latest)["rng"]
    assert len(states) == 2 and not torch.equal(states[0]["torch"], states[1]["torch"])  # one per rank, different
    resumed = run_training(CFG.replace(resume_from=latest), progress=False, start_method="fork")
    assert resumed.ranks[0].step[0] == 8
    assert resumed.ranks[0].param_fingerprint == full.ranks[0].param_fingerprint[8:]
    assert np.array_equal(resumed.final_params, full.final_params)


@pytest.mark.slow
def test_without_the_saved_states_the_dropout_resume_drifts(dropout_runs, tmp_path):
    full, ck = dropout_runs
    ckpt = load_checkpoint(latest_checkpoint(str(ck)))
    del ckpt["rng"]  # what a checkpoint of format /1 holds: still accepted, but the masks start over
    old = tmp_path / "ckpt-0000008.pt"
    torch.save(ckpt, old)
    resumed = run_training(CFG.replace(resume_from=str(old)), progress=False, start_method="fork")
    assert resumed.ranks[0].step[0] == 8
    assert not np.array_equal(resumed.final_params, full.final_params)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cuda_generator_is_captured_and_restored_on_a_gpu():
    device = torch.device("cuda", 0)
    state = rng_state(device)
    assert state["cuda"] is not None and rng_state()["cuda"] is None  # CPU ranks save no CUDA state
    first = torch.rand(4, device=device)
    set_rng_state(state, device)
    assert torch.equal(first, torch.rand(4, device=device))
