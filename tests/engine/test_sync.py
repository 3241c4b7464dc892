"""DDP keeps replicas identical: synced gradients equal, local ones differ, and DDP equals one process."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ddp_helpers import TrainConfig, build_model, load_data, run_training
from ddp_helpers.data import shard_indices


def test_synced_gradients_bitwise_identical_every_step(small_run):
    assert small_run.n_steps == 8
    for step, cap in small_run.captured_grads.items():
        synced = cap["synced"]
        for r in range(1, synced.shape[0]):
            diff = np.abs(synced[r] - synced[0]).max()
            assert np.array_equal(synced[r], synced[0]), f"step {step}: rank {r} synced grad differs by {diff}"
    assert sorted(small_run.captured_grads) == list(range(8))
    assert small_run.synced_norms_agree()


def test_local_gradients_differ_between_ranks(small_run):
    for step, cap in small_run.captured_grads.items():
        local = cap["local"]
        assert not np.allclose(local[0], local[1]), f"step {step}: local gradients of rank 0 and 1 are equal"
    r0, r1 = small_run.ranks
    assert np.all(r0.local_grad_norm != r1.local_grad_norm)


def test_synced_gradient_is_mean_of_local_gradients(small_run):
    for step, cap in small_run.captured_grads.items():
        mean = cap["local"].mean(axis=0)
        np.testing.assert_allclose(cap["synced"][0], mean, rtol=1e-5, atol=1e-7,
                                   err_msg=f"step {step}: synced gradient is not the mean of the local ones")


def test_recorded_norms_match_captured_vectors(small_run):
    for r in small_run.ranks:
        for step, cap in small_run.captured_grads.items():
            assert r.local_grad_norm[step] == pytest.approx(np.linalg.norm(cap["local"][r.rank]), rel=1e-5)
            assert r.synced_grad_norm[step] == pytest.approx(np.linalg.norm(cap["synced"][r.rank]), rel=1e-5)


def test_local_gradient_is_this_ranks_own_batch_gradient(small_run, small_cfg):
    """The hook's 'before' is the gradient of the rank's own batch at step 0, computed here independently."""
    data = load_data(small_cfg)
    for rank in range(small_cfg.world_size):
        idx = shard_indices(len(data.train_labels), rank, small_cfg.world_size, small_cfg.seed, 0)[:64]
        assert np.array_equal(small_run.ranks[rank].sample_indices[0], idx.numpy())
        model = build_model(small_cfg.seed)
        F.cross_entropy(model(data.train_normalized()[idx]), data.train_labels[idx]).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()
        np.testing.assert_allclose(small_run.captured_grads[0]["local"][rank], grad, rtol=1e-5, atol=1e-7)


def test_parameters_identical_after_every_step(small_run):
    assert small_run.fingerprints_agree()
    fps = small_run.ranks[0].param_fingerprint
    assert len(set(fps)) == len(fps), "parameters should change at every step"


def test_same_seed_gives_identical_runs(small_run, small_cfg):
    again = run_training(small_cfg, progress=False, start_method="fork")
    for a, b in zip(small_run.ranks, again.ranks):
        assert a.param_fingerprint == b.param_fingerprint
        assert np.array_equal(a.loss, b.loss)
        assert a.samples_hash == b.samples_hash


def test_different_seed_gives_different_run(small_run, small_cfg):
    other = run_training(small_cfg.replace(seed=1, max_steps=2), progress=False, start_method="fork")
    assert other.ranks[0].param_fingerprint[0] != small_run.ranks[0].param_fingerprint[0]


def test_spawn_and_fork_give_the_same_result(small_run, small_cfg):
    """Ranks in fresh interpreters (torch.multiprocessing's spawn: each imports torch and unpickles its task)
    train bit for bit as ranks forked from this process: nothing a rank needs comes from the parent's memory."""
    spawned = run_training(small_cfg, progress=False, start_method="spawn")
    assert spawned.ranks[0].param_fingerprint == small_run.ranks[0].param_fingerprint
    assert spawned.test_accuracy == small_run.test_accuracy


def test_accumulation_with_no_sync_matches_bigger_batch():
    base = TrainConfig(dataset="mnist-5k", max_steps=3, threads_per_rank=1)
    acc = run_training(base.replace(accumulation_steps=4), progress=False, start_method="fork")
    big = run_training(base.replace(batch_size=256), progress=False, start_method="fork")
    # Same samples per step (DistributedSampler order), one all-reduce per step instead of four.
    assert acc.allreduce_calls == [3, 3]
    assert np.allclose(acc.final_params, big.final_params, rtol=1e-5, atol=1e-6)
    assert acc.fingerprints_agree()
