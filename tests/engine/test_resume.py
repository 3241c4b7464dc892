"""Exact resumes: a crashed run resumed from its latest checkpoint (resume_from="latest", what a torchrun restart
runs) ends bitwise as the run that never crashed, model, optimizer and every rank's random generators included;
faults that fire in a job's first attempt only; ranks that would resume from different steps refuse.

One uninterrupted run, one crashed run and its resume serve every comparison (module fixtures). The model draws
random numbers every step (dropout), so a resume that restored the weights but not the generators would drift.
"""
from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest
import torch
from torch import nn

from ddp_helpers import ConfigError, RankFailedError, TrainConfig, launch, run_training
from ddp_helpers.engine import worker
from ddp_helpers.engine.checkpoint import checkpoint_path, load_checkpoint, resolve_resume, save_checkpoint
from ddp_helpers.engine.faults import InjectedFault, inject_fault
from ddp_helpers.engine.model import build_model
from ddp_helpers.engine.rng import rank_seed, rng_state, set_rng_state

# 2 epochs of 32 steps (the sampler's reshuffle included); momentum: optimizer state that a resume must restore
CFG = TrainConfig(dataset="mnist-5k", backend="gloo", epochs=2, threads_per_rank=1, momentum=0.9)
EVERY, CRASH, LATEST = 8, 42, 40  # checkpoints every 8 steps; rank 1 fails at step 42: the latest is step 40


def _dropout_model(seed: int) -> nn.Module:
    """The package's model behind input dropout: same parameter names and shapes, random draws every step."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Sequential(nn.Dropout(0.3), nn.Flatten()), nn.Linear(28 * 28, 10))


@contextlib.contextmanager
def _dropout():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(worker, "build_model", _dropout_model)  # forked ranks inherit the patched worker
        yield


def _train(cfg: TrainConfig):
    with _dropout():
        return run_training(cfg, progress=False, start_method="fork")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """(the run that never crashed, its folder with the last checkpoint)."""
    ck = tmp_path_factory.mktemp("uninterrupted")
    return _train(CFG.replace(checkpoint_dir=str(ck))), ck


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """The checkpoint folder of the same run, checkpointing every EVERY steps, crashed by rank 1 at step CRASH."""
    ck = tmp_path_factory.mktemp("crashed")
    with pytest.raises(RankFailedError):
        _train(CFG.replace(checkpoint_dir=str(ck), checkpoint_every=EVERY, fault_rank=1, fault_step=CRASH))
    return ck


@pytest.fixture(scope="module")
def resumed(crashed):
    """The same command again, as torchrun runs it after a crash (the fault fires no more: no fault_* here)."""
    return _train(CFG.replace(checkpoint_dir=str(crashed), checkpoint_every=EVERY, resume_from="latest"))


def test_a_crashed_run_resumed_from_latest_ends_like_the_uninterrupted_one(uninterrupted, crashed, resumed):
    full, _ = uninterrupted
    assert resumed.config["resume_from"] == checkpoint_path(str(crashed), LATEST)
    for mine, theirs in zip(resumed.ranks, full.ranks):
        assert mine.step[0] == LATEST and mine.step[-1] == theirs.step[-1]
        assert mine.param_fingerprint == theirs.param_fingerprint[LATEST:]  # every step after the resume
    assert np.array_equal(resumed.final_params, full.final_params)


def test_the_resumed_runs_last_checkpoint_is_the_uninterrupted_runs(uninterrupted, crashed, resumed):
    """Model and optimizer state (momentum buffers) bit for bit, as the next resume would read them."""
    full, full_dir = uninterrupted
    end = int(full.ranks[0].step[-1]) + 1  # the checkpoint written at the end of both runs
    a = torch.load(checkpoint_path(str(full_dir), end), weights_only=True)
    b = torch.load(checkpoint_path(str(crashed), end), weights_only=True)
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for i, st in a["optimizer"]["state"].items():
        assert torch.equal(st["momentum_buffer"], b["optimizer"]["state"][i]["momentum_buffer"])


def test_a_checkpoint_holds_every_ranks_generator_states(crashed):
    states = load_checkpoint(checkpoint_path(str(crashed), LATEST))["rng"]
    assert len(states) == 2 and not torch.equal(states[0]["torch"], states[1]["torch"])  # one per rank, different


@pytest.mark.slow
def test_without_the_saved_states_the_dropout_resume_drifts(uninterrupted, crashed, tmp_path):
    """What makes the comparisons above worth making: with the generators starting over, the run differs."""
    full, _ = uninterrupted
    ckpt = load_checkpoint(checkpoint_path(str(crashed), LATEST))
    del ckpt["rng"]  # a /2 file without the states (save_checkpoint(rng=None)): accepted, the masks start over
    old = tmp_path / f"ckpt-{LATEST:07d}.pt"
    torch.save(ckpt, old)
    drifted = _train(CFG.replace(resume_from=str(old)))
    assert drifted.ranks[0].step[0] == LATEST
    assert not np.array_equal(drifted.final_params, full.final_params)


# ------------------------------------------------------------------ resume_from="latest"
def _save(folder, step: int) -> str:
    model = build_model(0)
    return save_checkpoint(str(folder), step, model.state_dict(), {"state": {}, "param_groups": []}, CFG.to_dict())


def test_latest_is_the_newest_checkpoint_in_the_folder_or_none(tmp_path):
    cfg = CFG.replace(checkpoint_dir=str(tmp_path / "ck"), resume_from="latest")
    assert resolve_resume(cfg).resume_from is None  # no folder yet: the first attempt starts at step 0
    for step in (4, 12, 8):
        _save(tmp_path / "ck", step)
    assert resolve_resume(cfg).resume_from == checkpoint_path(str(tmp_path / "ck"), 12)
    other = CFG.replace(resume_from=checkpoint_path(str(tmp_path / "ck"), 4))
    assert resolve_resume(other) is other  # a file name is left as it is


def test_latest_without_a_checkpoint_dir_is_refused_before_any_rank(monkeypatch):
    from ddp_helpers.ranks import launcher as L

    started = []
    monkeypatch.setattr(L, "start_ranks", lambda *a, **k: started.append(1))
    with pytest.raises(ConfigError) as e:
        run_training(CFG.replace(resume_from="latest"), progress=False)
    assert str(e.value).startswith("TrainConfig.resume_from='latest' is not accepted") and "checkpoint_dir" in str(e.value)
    assert not started


def test_an_injected_fault_fires_in_the_first_attempt_only(monkeypatch):
    cfg = CFG.replace(fault_rank=1, fault_step=3)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    with pytest.raises(InjectedFault):
        inject_fault(cfg, 1, 3)  # outside torchrun
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    with pytest.raises(InjectedFault):
        inject_fault(cfg, 1, 3)  # torchrun's first attempt
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    inject_fault(cfg, 1, 3)  # a restarted attempt: the one-off failure is over
    inject_fault(cfg, 0, 3)  # and never on another rank


def _start_steps(rank, world_size, steps):
    from ddp_helpers.cli.torchrun import _check_same_start

    _check_same_start(steps[rank])
    return "agreed"


def test_ranks_that_would_resume_from_different_steps_all_refuse():
    assert launch(_start_steps, 2, args=([8, 8],), threads_per_rank=1) == ["agreed", "agreed"]
    with pytest.raises(RankFailedError) as e:
        launch(_start_steps, 2, args=([8, 0],), threads_per_rank=1)
    texts = [e.value.message, *e.value.others]
    assert all("rank 0: 8, rank 1: 0" in t for t in texts) and len(e.value.others) == 2


# ------------------------------------------------------------------ the generators themselves
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_cuda_generator_is_captured_and_restored_on_a_gpu():
    device = torch.device("cuda", 0)
    state = rng_state(device)
    assert state["cuda"] is not None and rng_state()["cuda"] is None  # CPU ranks save no CUDA state
    first = torch.rand(4, device=device)
    set_rng_state(state, device)
    assert torch.equal(first, torch.rand(4, device=device))
