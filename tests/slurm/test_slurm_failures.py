"""A 2-node job's results whole and true when SLURM stops it (issue 57 point 3): scancel leaves one partial result
on the shared --out holding both ranks' rows and naming the scheduler, and no run folder on either node; a
requeued job resumes from its checkpoint and names the failed attempt's partial result."""
from __future__ import annotations

import os
import pathlib
import sys
import time

import pytest

from ddp_helpers import TrainResult

pytestmark = pytest.mark.slow
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
NODES = ("n1", "n2")


def _env(tmp_path) -> dict:
    root = str(EXAMPLES.parent)
    return {**os.environ, "OUT": str(tmp_path / "out"),
            "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
            "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}


def _run_folders(slurm) -> dict:
    return {n: [p for p in os.listdir(slurm.node_tmpdir(n)) if p.startswith("ddp_helpers-ranks-")] for n in NODES}


def _wait_for_rows(slurm, job: str, at_least: int, timeout: float = 40) -> None:
    """Until a rank on each node has recorded at_least steps in its rows file (an event, polled)."""
    from ddp_helpers.engine.telemetry import RunRows

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = []
        for node, rank in zip(NODES, (0, 1)):
            folders = _run_folders(slurm)[node]
            path = os.path.join(slurm.node_tmpdir(node), folders[0]) if folders else None
            ok = path and os.path.exists(os.path.join(path, f"rank{rank}.rows"))
            counts.append(RunRows(path, 2).count(rank) if ok else 0)
        if min(counts) >= at_least:
            return
        if slurm.job_state(job) not in ("PENDING", "RUNNING", "CONFIGURING"):
            break
        time.sleep(0.05)
    raise AssertionError(f"job {job} ({slurm.job_state(job)}) recorded no {at_least} steps on both nodes")


def test_scancel_leaves_one_partial_with_both_ranks_naming_the_scheduler(slurm, tmp_path):
    job = slurm.sbatch(str(EXAMPLES / "slurm_srun.sbatch"), "-o", str(tmp_path / "job.out"), f"--chdir={tmp_path}",
                       args=["--dataset", "mnist-5k", "--max-steps", "100000", "--epochs", "1000", "--no-plots"],
                       env=_env(tmp_path))
    _wait_for_rows(slurm, job, at_least=2)
    slurm.run(["scancel", job])
    assert slurm.wait_job(job, timeout=30) == "CANCELLED"
    said = (tmp_path / "job.out").read_text()
    assert os.listdir(tmp_path / "out") == ["partial_result.json"], said[-3000:]
    partial = TrainResult.load(str(tmp_path / "out" / "partial_result.json"))
    assert [r.rank for r in partial.ranks] == [0, 1] and min(len(r) for r in partial.ranks) >= 2, said[-3000:]
    assert any("the scheduler stopped the job" in n and job in n for n in partial.notes), partial.notes
    assert sorted(partial.provenance["writers"]) == [0, 1]  # each node's rank merged its rows in
    assert {p["host"] for p in partial.provenance["ranks"]} == set(NODES)
    assert _run_folders(slurm) == {n: [] for n in NODES}


def test_a_requeued_job_resumes_and_names_the_failed_attempts_partial(slurm, tmp_path):
    """scontrol requeue of a running job (a preemption's requeue): SLURM stops it (SIGTERM) and runs it again with
    SLURM_RESTART_COUNT=1; with --resume-from latest the second attempt continues from the checkpoint. A rank
    left on a node by the first attempt (SIGKILLed after KillWait) is removed by the second."""
    ckpt = tmp_path / "ckpt"
    job = slurm.sbatch(str(EXAMPLES / "slurm_srun.sbatch"), "--requeue", "-o", str(tmp_path / "job.out"),
                       "--open-mode=append", f"--chdir={tmp_path}",
                       args=["--dataset", "mnist-5k", "--max-steps", "10", "--no-plots", "--checkpoint-dir", str(ckpt),
                             "--checkpoint-every", "2", "--resume-from", "latest",
                             # rank 1 hangs at step 5 in the first attempt only (not after a requeue)
                             "--fault-rank", "1", "--fault-step", "5", "--fault-kind", "hang"], env=_env(tmp_path))
    deadline = time.monotonic() + 40
    while not (ckpt.exists() and any(p.name.startswith("ckpt-") for p in ckpt.iterdir())):
        assert time.monotonic() < deadline and slurm.job_state(job) in ("PENDING", "RUNNING", "CONFIGURING"), \
            (tmp_path / "job.out").read_text()[-3000:]
        time.sleep(0.05)
    slurm.run(["scontrol", "requeue", job])
    deadline = time.monotonic() + 20
    while slurm.job_state(job) != "PENDING":  # held until the old attempt's steps are gone
        assert time.monotonic() < deadline, slurm.job_state(job)
        time.sleep(0.05)
    # SLURM holds a requeued job back for cred_expire + 1 s (121 s by default): start it now
    slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
    state = slurm.wait_job(job, timeout=60)
    said = (tmp_path / "job.out").read_text()
    assert state == "COMPLETED", said[-3000:] + slurm.logs()
    out = sorted(os.listdir(tmp_path / "out"))
    assert out == ["partial_result.attempt0.json", "result.json"], (out, said[-3000:])
    res = TrainResult.load(str(tmp_path / "out" / "result.json"))
    first = TrainResult.load(str(tmp_path / "out" / "partial_result.attempt0.json"))
    steps = res.ranks[0].step
    assert 0 < steps[0] <= len(first.ranks[0]) and steps[0] % 2 == 0  # resumed at a checkpoint, not started over
    assert list(steps) == list(range(steps[0], steps[0] + len(steps)))
    assert res.provenance["slurm"]["restart_count"] == "1" and res.provenance["attempt"] == "1"
    assert _run_folders(slurm) == {n: [] for n in NODES}
