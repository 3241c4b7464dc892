"""The examples' SLURM jobs on the test cluster: the sbatch template (one torchrun per node) and the srun-only form
(one task per rank, SLURM's variables read as a way into a rank) each train one 2-rank job across both nodes,
equal to the same settings run on one machine."""
from __future__ import annotations

import os
import pathlib
import sys

import numpy as np
import pytest

from ddp_helpers import TrainResult

pytestmark = pytest.mark.slow
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _flags(cfg) -> list:
    """small_cfg (tests/conftest.py) as the command line's flags."""
    return ["--dataset", cfg.dataset, "--backend", cfg.backend, "--max-steps", str(cfg.max_steps),
            "--threads-per-rank", str(cfg.threads_per_rank), "--seed", str(cfg.seed), "--no-plots",
            "--capture-grad-steps", *map(str, cfg.capture_grad_steps)]


def _submit(slurm, tmp_path, example: str, small_cfg) -> tuple:
    """Submit an example with small_cfg's settings, wait for it; (job id, its output, the result)."""
    root = str(EXAMPLES.parent)
    env = {**os.environ, "OUT": str(tmp_path / "out"),  # the job's tasks run this interpreter's torchrun and python
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
           "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    job = slurm.sbatch(str(EXAMPLES / example), "-o", str(tmp_path / "job.out"), f"--chdir={tmp_path}",
                       args=_flags(small_cfg), env=env)
    state = slurm.wait_job(job, timeout=150)  # a hung job's bound: a loaded machine stretches a run
    said = (tmp_path / "job.out").read_text()
    assert state == "COMPLETED", said[-3000:] + slurm.logs()
    return job, said, TrainResult.load(str(tmp_path / "out" / "result.json"))


def _same_as_one_machine(res: TrainResult, small_run: TrainResult) -> None:
    assert res.world_size == 2 and [len(r) for r in res.ranks] == [len(r) for r in small_run.ranks]
    assert np.array_equal(res.final_params, small_run.final_params)
    for a, b in zip(res.ranks, small_run.ranks):
        assert a.param_fingerprint == b.param_fingerprint and np.array_equal(a.loss, b.loss)


def _nothing_left(slurm, tmp_path) -> None:
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["result.json"]  # no partial result
    for node in ("n1", "n2"):  # every run folder removed from each node's TMPDIR
        assert not [p for p in os.listdir(slurm.node_tmpdir(node)) if p.startswith("ddp_helpers")], node


def _hosts_recorded(res: TrainResult, said: str) -> None:
    """result.json names each rank's node, address and interface and the true rendezvous address (not the
    127.0.0.1 a one-machine run has); the job's output has one line per node."""
    ranks = sorted(res.provenance["ranks"], key=lambda p: p["rank"])
    assert [p["rank"] for p in ranks] == [0, 1] and {p["host"] for p in ranks} == {"n1", "n2"}, ranks
    assert all(p["address"] and not p["address"].startswith("127.") and p["interface"] for p in ranks), ranks
    host = res.provenance["rendezvous"].rsplit(":", 1)[0]  # torchrun's c10d store may sit on either node
    assert host in {"n1", "n2"} | {p["address"] for p in ranks} and res.config["master_addr"] == host, res.provenance
    assert sorted(line.split(":")[0] for line in said.splitlines() if line.startswith("node n")) == ["node n1",
                                                                                                    "node n2"]


def _nodes(slurm, job: str) -> str:
    out = slurm.run(["scontrol", "-o", "show", "job", job]).stdout
    return next(f.split("=", 1)[1] for f in out.split() if f.startswith("NodeList="))


def test_the_sbatch_template_trains_one_job_across_two_nodes(slurm, tmp_path, small_cfg, small_run):
    job, said, res = _submit(slurm, tmp_path, "slurm_torchrun.sbatch", small_cfg)
    assert _nodes(slurm, job) == "n[1-2]"
    _same_as_one_machine(res, small_run)
    _hosts_recorded(res, said)
    _nothing_left(slurm, tmp_path)


def test_srun_alone_starts_one_job_of_one_rank_per_task(slurm, tmp_path, small_cfg, small_run):
    """Each task is a rank (SLURM_PROCID of SLURM_NTASKS), not the launcher of a job of its own: one job, whose
    rank 0 alone writes and reports (two tasks each launching ranks would each say so)."""
    job, said, res = _submit(slurm, tmp_path, "slurm_srun.sbatch", small_cfg)
    assert _nodes(slurm, job) == "n[1-2]"
    assert said.count("wrote ") == 1, said[-3000:]
    _same_as_one_machine(res, small_run)
    _hosts_recorded(res, said)
    _nothing_left(slurm, tmp_path)
