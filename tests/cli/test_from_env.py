"""run_from_env and TrainTask without a cluster: no rank in the environment is named, submitit's requeue resumes
from the newest checkpoint, and a SIGTERM handler already installed (submitit's) is chained, not kept out."""
from __future__ import annotations

import signal

import pytest

from ddp_helpers import ConfigError, TrainConfig, TrainTask, run_from_env


def test_a_process_that_is_no_rank_is_told_so(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_ID",
              "SLURM_JOB_ID"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ConfigError, match="no rank in this process's environment"):
        run_from_env(TrainConfig(dataset="mnist-5k"))


def test_submitits_requeue_resubmits_the_task_resuming_from_the_latest_checkpoint(tmp_path):
    pytest.importorskip("submitit")
    task = TrainTask(TrainConfig(dataset="mnist-5k", checkpoint_dir=str(tmp_path)), out=str(tmp_path / "out"))
    again = task.checkpoint()
    assert again.function.cfg.resume_from == "latest" and again.function.out == task.out
    assert TrainTask(TrainConfig(dataset="mnist-5k")).checkpoint() is None  # nothing to resume from: no requeue


def test_a_sigterm_handler_already_there_is_called_after_the_partial_result(tmp_path, monkeypatch):
    """submitit installs its own SIGTERM handler before the function runs; ours used to be installed only over
    SIG_DFL, so a submitit task wrote no partial result. Now ours leaves first, then calls theirs."""
    import ddp_helpers.cli.leaving as L

    calls = []
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(("submitit's", signum)))
    monkeypatch.setattr(L, "_die_of", lambda signum: calls.append(("died", signum)))
    monkeypatch.setattr(L, "scheduler_stop", lambda: None)
    try:
        leaver = L.Leaver(None, 0, str(tmp_path / "out"), str(tmp_path), cfg=TrainConfig(dataset="mnist-5k"))
        monkeypatch.setattr(leaver, "_write_partial", lambda report: calls.append(("partial", report.text)))
        leaver.install()
        assert signal.getsignal(signal.SIGTERM) == leaver.on_sigterm
        leaver.on_sigterm(signal.SIGTERM, None)
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.set_wakeup_fd(-1)
    assert [c[0] for c in calls] == ["partial", "submitit's", "died"]
