"""A failing torchrun rank writes the job's partial result only once its peers have recorded the steps they
finished together with it (under load a peer can still be writing the last one's row)."""
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

from ddp_helpers.cli.leaving import Leaver, wait_for_peer_rows
from ddp_helpers.ranks.reports import Report


class _Rows:
    """Two ranks' step counts: rank 1 (the failing one) has 40, rank 0 reaches 40 at its 5th read."""

    world_size = 2

    def __init__(self, behind: int = 39, catches_up: bool = True):
        self.counts, self.reads, self.catches_up = {0: behind, 1: 40}, 0, catches_up

    def count(self, rank: int) -> int:
        if rank == 0:
            self.reads += 1
            if self.reads == 5 and self.catches_up:
                self.counts[0] = 40  # rank 0 has written the row of step 39
        return self.counts[rank]

    def missing(self) -> List[int]:
        return []


class _Partial:
    def __init__(self, counts):
        self.counts, self.notes = counts, []

    def save(self, path: str) -> str:
        return path


class _Job:
    class cfg:
        world_size = 2

    def __init__(self, rows: _Rows):
        self.rows, self.partials = rows, []

    def result(self, complete: bool) -> _Partial:
        self.partials.append(_Partial(dict(self.rows.counts)))
        return self.partials[-1]


def test_the_partial_result_waits_for_the_peers_last_row(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    job = _Job(_Rows())
    Leaver(job, rank=1, out=str(tmp_path), run_dir=str(tmp_path)).leave(Report(False, text="fault at step 40"))
    (partial,) = job.partials
    assert partial.counts == {0: 40, 1: 40}  # rank 0's step 39 is in it


def test_a_peer_that_stopped_earlier_is_not_waited_for_forever():
    rows = _Rows(behind=30, catches_up=False)
    wait_for_peer_rows(rows, rank=1, stall_s=0.05)  # returns once no count has moved for stall_s
    assert rows.counts[0] == 30 and rows.reads > 1


def test_a_sigterm_while_the_partial_result_is_written_waits_for_it(tmp_path, monkeypatch):
    """torchrun's agent SIGTERMs the survivor while it writes: the file is finished first, then the rank dies of
    the signal (it used to die at once, and 8 of 21 jobs kept no partial result)."""
    import ddp_helpers.cli.leaving as T

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    died = []
    monkeypatch.setattr(T, "_die_of", died.append)
    job = _Job(_Rows())
    leaver = Leaver(job, rank=1, out=str(tmp_path), run_dir=str(tmp_path))
    real_wait = T.wait_for_peer_rows

    def agent_signals_meanwhile(rows, rank, **kw):
        leaver.on_sigterm(15, None)  # arrives in the middle of the leave
        assert not died, "died before the partial result was written"
        real_wait(rows, rank, **kw)
    monkeypatch.setattr(T, "wait_for_peer_rows", agent_signals_meanwhile)
    leaver.leave(Report(False, text="peer closed the connection", in_collective=True))
    assert len(job.partials) == 1 and died == [15]
    assert job.partials[0].counts == {0: 40, 1: 40}


TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable))
ENV = {**os.environ, "DDP_HELPERS_PROGRESS": "0"}


def _rank_process(agent: subprocess.Popen, rank: int) -> psutil.Process:
    """The process of `rank` among the agent's children, once it exists (an event: polled, no fixed sleep)."""
    while agent.poll() is None:
        for p in psutil.Process(agent.pid).children(recursive=True):
            try:
                if p.environ().get("RANK") == str(rank) and "ddp_helpers.train" in " ".join(p.cmdline()):
                    return p
            except psutil.Error:
                continue
        time.sleep(0.02)
    raise AssertionError(f"the job ended before rank {rank} started: {agent.stderr.read()[-3000:]}")


def _wait_for_rows(proc: psutil.Process, rank: int, tmpdir: str, at_least: int) -> None:
    """Until `rank` has recorded at_least steps in its rows file (the run folder is named as run_folder does)."""
    from ddp_helpers.engine.telemetry import RunRows

    env = proc.environ()
    key = "-".join(env.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"))
    folder = os.path.join(tmpdir, f"ddp_helpers-ranks-torchrun-{key}-a0")
    while proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
        if os.path.exists(os.path.join(folder, f"rank{rank}.rows")) and RunRows(folder, 2).count(rank) >= at_least:
            return
        time.sleep(0.01)
    raise AssertionError(f"rank {rank} ended before it recorded {at_least} steps")


def _job(tmp_path, *extra: str) -> subprocess.Popen:
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "ddp_helpers.train", "--dataset", "mnist-5k", "--threads-per-rank", "1",
                             "--no-plots", "--out", str(tmp_path / "out"), *extra], cwd=tmp_path,
                            env={**ENV, "TMPDIR": str(tmpdir)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def _check_partial(tmp_path, agent: subprocess.Popen, blame: str) -> List[int]:
    """Every rank's rows up to the failure, the dead rank blamed, nothing left in --out or the temp dir."""
    from ddp_helpers import TrainResult

    err = agent.communicate(timeout=240)[1]
    assert agent.returncode != 0
    out = tmp_path / "out"
    assert sorted(os.listdir(out)) == ["partial_result.json"], err[-3000:]  # no .tmp file left beside it
    partial = TrainResult.load(str(out / "partial_result.json"))
    counts = [len(r.step) for r in partial.ranks]
    assert all(list(r.step) == list(range(len(r.step))) for r in partial.ranks)
    assert max(counts) - min(counts) <= 1, counts  # a rank killed between the all-reduce and its row: one less
    assert any(f"failed: rank 1: {blame}" in n for n in partial.notes), (partial.notes, err[-3000:])
    left = [n for n in os.listdir(tmp_path / "tmp") if n.startswith("ddp_helpers-")]  # not torch's own folders
    assert left == [], "the failed job's run folder is left"  # B5
    return counts


@pytest.mark.skipif(TORCHRUN is None or not hasattr(signal, "SIGKILL"), reason="torchrun and POSIX signals")
@pytest.mark.slow
def test_a_rank_sigkilled_mid_run_loses_no_rows(tmp_path):
    agent = _job(tmp_path, "--max-steps", "100000", "--epochs", "1000")
    rank1 = _rank_process(agent, 1)
    _wait_for_rows(rank1, 1, str(tmp_path / "tmp"), at_least=3)
    rank1.send_signal(signal.SIGKILL)
    counts = _check_partial(tmp_path, agent, "reported nothing")
    assert min(counts) >= 3


@pytest.mark.skipif(TORCHRUN is None or not hasattr(signal, "SIGKILL"), reason="torchrun and POSIX signals")
@pytest.mark.slow
def test_a_rank_sigtermed_from_outside_is_blamed_and_no_row_is_lost(tmp_path):
    """Rank 1 waits at step 7 (fault 'hang'), with rank 0 in the step's all-reduce; then SIGTERM from outside."""
    agent = _job(tmp_path, "--max-steps", "12", "--fault-rank", "1", "--fault-step", "7", "--fault-kind", "hang")
    rank1 = _rank_process(agent, 1)
    _wait_for_rows(rank1, 1, str(tmp_path / "tmp"), at_least=7)
    rank1.send_signal(signal.SIGTERM)
    assert _check_partial(tmp_path, agent, "killed by SIGTERM from outside") == [7, 7]
