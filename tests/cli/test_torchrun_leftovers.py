"""What a torchrun job leaves (issue 61): every failed attempt keeps its partial result, the last local rank out
removes the run folder on every path (a SIGTERM during start-up too), and a folder that a SIGKILLed job left is
removed by the next job on that machine."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from typing import List

import psutil
import pytest

from ddp_helpers import TrainResult

TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable))
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(TORCHRUN is None or not hasattr(signal, "SIGKILL"), reason="torchrun, POSIX signals")]


def _job(tmp_path, *extra: str) -> subprocess.Popen:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             *[a for a in extra if a.startswith("--max-restarts")],
                             "-m", "ddp_helpers.train", "--dataset", "mnist-5k", "--threads-per-rank", "1",
                             "--no-plots", "--out", str(tmp_path / "out"),
                             *[a for a in extra if not a.startswith("--max-restarts")]],
                            cwd=tmp_path, env={**os.environ, "DDP_HELPERS_PROGRESS": "0", "TMPDIR": str(tmpdir)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _ranks(agent: subprocess.Popen) -> List[psutil.Process]:
    out = []
    for p in psutil.Process(agent.pid).children(recursive=True):
        try:
            if "ddp_helpers.train" in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


def _run_folders(tmp_path) -> List[str]:
    return sorted(n for n in os.listdir(tmp_path / "tmp") if n.startswith("ddp_helpers-ranks-"))


def _wait_for(tmp_path, agent: subprocess.Popen, attempt: int, files: List[str]) -> str:
    """Attempt `attempt`'s run folder once it holds `files` (an event, polled)."""
    while agent.poll() is None:
        for name in _run_folders(tmp_path):
            folder = tmp_path / "tmp" / name
            if name.endswith(f"-a{attempt}") and all((folder / f).exists() for f in files):
                return str(folder)
        time.sleep(0.005)
    raise AssertionError(f"the job ended first: {agent.stderr.read()[-3000:]}")


def _rank_process(agent: subprocess.Popen, rank: int, attempt: int) -> psutil.Process:
    while agent.poll() is None:
        for p in _ranks(agent):
            try:
                env = p.environ()
            except psutil.Error:
                continue
            if env.get("RANK") == str(rank) and env.get("TORCHELASTIC_RESTART_COUNT") == str(attempt):
                return p
        time.sleep(0.005)
    raise AssertionError(f"the job ended before rank {rank} of attempt {attempt} started")


def test_every_failed_attempt_keeps_its_partial_and_no_folder_is_left(tmp_path):
    """Two restarts: rank 1 killed mid-run in attempt 0, and during start-up in attempt 1 (before any row: the
    survivor's SIGTERM from the agent came before it handled one, and that attempt kept no partial)."""
    agent = _job(tmp_path, "--max-restarts=2", "--max-steps", "30")
    _wait_for(tmp_path, agent, 0, ["rank0.rows", "rank1.rows"])
    _rank_process(agent, 1, 0).send_signal(signal.SIGKILL)
    _wait_for(tmp_path, agent, 1, ["rank0.alive", "rank1.alive"])
    _rank_process(agent, 1, 1).send_signal(signal.SIGKILL)
    err = agent.communicate(timeout=240)[1]
    assert agent.returncode == 0, err[-3000:]
    out = sorted(os.listdir(tmp_path / "out"))
    assert out == ["partial_result.attempt0.json", "partial_result.attempt1.json", "result.json"], (out, err[-3000:])
    for k in (0, 1):
        partial = TrainResult.load(str(tmp_path / "out" / f"partial_result.attempt{k}.json"))
        assert not partial.complete and partial.world_size == 2
        assert any(n.startswith(f"attempt {k} failed: rank 1") for n in partial.notes), partial.notes
    assert _run_folders(tmp_path) == [], "a run folder is left"


def test_a_sigterm_during_start_up_leaves_a_partial_and_no_folder(tmp_path):
    """SIGTERM to the agent (as a scheduler sends one) while the ranks still meet: each rank used to die of it
    at once, keeping no partial result and leaving the run folder."""
    agent = _job(tmp_path, "--max-steps", "30")
    _wait_for(tmp_path, agent, 0, ["rank0.alive", "rank1.alive"])
    agent.send_signal(signal.SIGTERM)
    err = agent.communicate(timeout=240)[1]
    assert agent.returncode != 0
    assert os.listdir(tmp_path / "out") == ["partial_result.json"], err[-3000:]
    partial = TrainResult.load(str(tmp_path / "out" / "partial_result.json"))
    assert any("SIGTERM" in n for n in partial.notes), partial.notes
    assert _run_folders(tmp_path) == [], "a run folder is left"


_HOLDER = """
import sys, time
from ddp_helpers.cli.leaving import hold_alive
from ddp_helpers.cli.torchrun import run_folder
folder = run_folder("127.0.0.1", int(sys.argv[1]))  # as a rank of a job at that endpoint
hold_alive(folder, 0)
print(folder, flush=True)
time.sleep(600)
"""


def _holder(tmpdir: str, port: int) -> tuple:
    """A process holding a torchrun run folder as a rank does; (the process, its folder)."""
    env = {**os.environ, "TMPDIR": tmpdir, "TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "0"}
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(port)], env=env, stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_a_folder_a_sigkilled_job_left_is_removed_by_the_next_job(tmp_path, monkeypatch):
    """A job whose ranks were all SIGKILLed ran no code of its own: the next job's rank on that machine removes
    its folder (nothing else did: stale folders were cleared only on launch()'s path); a live job's is kept."""
    import tempfile

    from ddp_helpers.cli.leaving import remove_if_last
    from ddp_helpers.cli.torchrun import run_folder

    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    dead, left = _holder(str(tmpdir), 1001)
    live, kept = _holder(str(tmpdir), 1002)
    try:
        dead.kill()
        dead.wait()
        assert os.path.isdir(left) and os.path.isdir(kept)
        monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
        mine = run_folder("127.0.0.1", 1003)  # the next job's rank on this machine
        assert not os.path.exists(left), "the SIGKILLed job's run folder is still there"
        assert os.path.isdir(kept) and os.path.isdir(mine)
        remove_if_last(mine)
        assert not os.path.exists(mine)
    finally:
        live.kill()
        live.wait()
