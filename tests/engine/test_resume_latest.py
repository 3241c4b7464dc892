"""resume_from="latest" (what a torchrun restart needs) and faults that fire in a job's first attempt only."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from ddp_helpers import ConfigError, RankFailedError, TrainConfig, TrainResult, launch, run_training
from ddp_helpers.engine.checkpoint import checkpoint_path, resolve_resume, save_checkpoint
from ddp_helpers.engine.faults import InjectedFault, inject_fault
from ddp_helpers.engine.model import build_model

CFG = TrainConfig(dataset="mnist-5k", backend="gloo", max_steps=12, threads_per_rank=1, momentum=0.9)
ENV = {**os.environ, "DDP_HELPERS_PROGRESS": "0"}


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
    monkeypatch.setattr(L, "_start_ranks", lambda *a, **k: started.append(1))
    with pytest.raises(ConfigError) as e:
        run_training(CFG.replace(resume_from="latest"), progress=False)
    assert str(e.value).startswith("TrainConfig.resume_from='latest' is not accepted") and "checkpoint_dir" in str(e.value)
    assert not started


def test_a_crashed_run_resumed_from_latest_ends_like_the_uninterrupted_one(tmp_path):
    ck = str(tmp_path / "ck")
    job = CFG.replace(checkpoint_dir=ck, checkpoint_every=4, resume_from="latest")
    full = run_training(CFG, progress=False, start_method="fork")
    with pytest.raises(RankFailedError):
        run_training(job.replace(fault_rank=1, fault_step=6), progress=False, start_method="fork")
    resumed = run_training(job, progress=False, start_method="fork")  # the same command again, as torchrun does
    assert resumed.ranks[0].step[0] == 4 and resumed.config["resume_from"] == checkpoint_path(ck, 4)
    assert np.array_equal(resumed.final_params, full.final_params)


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


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                    reason="torchrun not installed next to this Python")
def test_torchrun_restarts_a_crashed_job_that_resumes_from_latest(tmp_path, small_run):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
           "1", "-m", "ddp_helpers.train", "--dataset", "mnist-5k", "--max-steps", "8", "--threads-per-rank", "1",
           "--no-plots", "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "4", "--resume-from",
           "latest", "--fault-rank", "1", "--fault-step", "6", "--out", str(tmp_path / "out")]
    # torchrun's defaults: one agent store shared by both attempts, whose first-attempt keys the restarted ranks
    # must not read (ranks/rank.attempt_store; without it gloo connected to the dead rank and the job ended)
    env = {**ENV, "LOGLEVEL": "INFO"}
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "will restart worker group" in p.stderr and "InjectedFault" in p.stderr
    res = TrainResult.load(str(tmp_path / "out" / "result.json"))
    assert res.ranks[0].step[0] == 4 and np.array_equal(res.final_params, small_run.final_params)
    # The failed attempt's records: every rank's rows up to the crash, under a name that says which attempt.
    failed = TrainResult.load(str(tmp_path / "out" / "partial_result.attempt0.json"))
    assert [list(r.step) for r in failed.ranks] == [list(range(6))] * 2 and not failed.complete
    assert any("attempt 0 failed: rank 1: InjectedFault" in n for n in failed.notes), failed.notes
    assert not (tmp_path / "out" / "partial_result.json").exists()  # nothing reads as this job's partial result
