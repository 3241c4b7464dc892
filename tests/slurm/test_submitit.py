"""submitit submits a function from the caller (a notebook's kernel) to the test cluster as the tasks of an srun
step; each task is a rank (ddp_helpers.TrainTask -> run_from_env), and every rank's rows come back to the caller."""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

pytestmark = pytest.mark.slow
submitit = pytest.importorskip("submitit", reason="submitit is the slurm extra (pip install ddp_helpers[slurm])")


def test_submitit_brings_every_ranks_result_back(slurm, tmp_path, monkeypatch, small_cfg, small_run):
    from ddp_helpers import TrainTask

    monkeypatch.setenv("SLURM_CONF", slurm.conf)  # submitit's sbatch, and the tasks' scontrol, reach the cluster
    monkeypatch.chdir(tmp_path)
    executor = submitit.SlurmExecutor(folder=str(tmp_path / "submitit"), python=sys.executable)
    executor.update_parameters(nodes=2, ntasks_per_node=1, cpus_per_task=1, time=5)
    job = executor.submit(TrainTask(small_cfg, out=str(tmp_path / "out")))
    # This cluster keeps no accounting (sacct): submitit learns the end only from each task's result file, so a
    # task killed before writing one would keep results() waiting forever. The wait is bounded here.
    deadline = time.monotonic() + 60
    while not job.done():  # each task's result file, then sacct (absent here: it answers nothing)
        assert time.monotonic() < deadline and slurm.job_state(job.job_id) in ("PENDING", "RUNNING", "CONFIGURING",
                                                                                "COMPLETING", "COMPLETED"), \
            slurm.job_state(job.job_id)
        time.sleep(0.1)
    results = job.results()
    assert len(results) == 2 and results[1] is None  # rank 0 returns the whole job's result
    res = results[0]
    assert res.world_size == 2 and {p["host"] for p in res.provenance["ranks"]} == {"n1", "n2"}
    assert np.array_equal(res.final_params, small_run.final_params)
    for a, b in zip(res.ranks, small_run.ranks):
        assert a.param_fingerprint == b.param_fingerprint and np.array_equal(a.loss, b.loss)
