"""One rank of a torchrun job (`torchrun ... -m ddp_helpers.train`): entered as every rank is (ranks.rank.run_rank),
and leaving its outcome and its rows the way a launched rank does, in a run folder (ranks/outbox.py).

The run folder is on the rank's machine, in the temp dir, shared by the job's ranks there. Rank 0 reads the rows
of the ranks it can see there; only the others' travel over the process group. A rank that fails, or that
torchrun's agent stops (SIGTERM, when a peer failed), first writes the job's partial result from every rank's
rows it can see: the rows are in their files already, so none recorded before the failure is lost.
"""
from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from typing import Any, List, Optional

from ..engine.config import ConfigError, TrainConfig
from .outputs import say, write_outputs

PARTIAL = "partial_result.json"


def _attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def partial_name() -> str:
    """partial_result.json; with restarts allowed, partial_result.attempt<k>.json (a later attempt may succeed,
    and its result.json must not stand beside a file that reads as this job's partial result)."""
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) > 0:
        return f"partial_result.attempt{_attempt()}.json"
    return PARTIAL


def run_folder() -> str:
    """This machine's run folder for this attempt of the job, held by every local rank while it runs.

    Named by torchrun's run id, the rendezvous endpoint and the attempt: --rdzv-id defaults to "none", and two
    jobs on one machine never share an endpoint at the same time.
    """
    from ..ranks.cleanup import RUN_DIR_PREFIX, hold

    key = "-".join(os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"))
    safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in key)
    path = os.path.join(tempfile.gettempdir(), f"{RUN_DIR_PREFIX}torchrun-{safe}-a{_attempt()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    hold(path)  # a folder some local rank holds is never taken for a dead launch's (cleanup.remove_stale)
    return path


def wait_for_peer_rows(rows: Any, rank: int, stall_s: float = 2.0, limit_s: float = 10.0) -> None:
    """Wait until every rank whose rows this process sees has recorded the steps this rank recorded.

    The ranks finished those steps together (each ends in an all-reduce), but a peer may still be writing the
    last one's row when this rank fails: under load, a partial result written at once lost rank 0's last step.
    Stops when no count has moved for stall_s (a peer that died earlier never catches up), or after limit_s.
    """
    target = rows.count(rank)
    hidden = rows.missing()  # their files are on other machines: nothing to wait for here
    visible = [r for r in range(rows.world_size) if r not in hidden]
    start = moved = time.monotonic()
    last: Optional[List[int]] = None
    while True:
        counts = [rows.count(r) for r in visible]
        if all(c >= target for c in counts):
            return
        now = time.monotonic()
        if counts != last:
            last, moved = counts, now
        if now - moved > stall_s or now - start > limit_s:
            return
        time.sleep(0.01)


class Leaver:
    """What a failing rank leaves: its report, then the job's partial result, once, whoever calls first (the
    rank's own exception path, or the SIGTERM torchrun's agent sends when a peer failed)."""

    def __init__(self, job: Any, rank: int, out: str, run_dir: str):
        self.job, self.rank, self.out, self.run_dir = job, rank, out, run_dir
        self.lock = threading.Lock()
        self.leaving = False

    def leave(self, report: Any) -> None:
        """Write this rank's report and the partial result (a second call does nothing)."""
        from ..ranks.outbox import read_reports, write_report
        from ..ranks.report import diagnose

        with self.lock:
            if self.leaving:
                return
            self.leaving = True
        world = self.job.cfg.world_size
        try:
            write_report(self.run_dir, self.rank, report)
            failure = diagnose(read_reports(self.run_dir, world), self.run_dir, world)
            wait_for_peer_rows(self.job.rows, self.rank)
            partial = self.job.result(complete=False)
            partial.notes.append(f"attempt {_attempt()} failed: rank {failure.rank}: {failure.message}")
            hidden = self.job.rows.missing()
            if hidden:
                partial.notes.append(f"ranks {hidden} kept their rows on their own machines' run folders")
            path = partial.save(os.path.join(self.out, partial_name()))
            say(f"rank {self.rank}: metrics every rank recorded before the failure: {path}")
        except Exception as e:  # noqa: BLE001 - never hide the failure itself
            say(f"rank {self.rank}: could not save the partial metrics: {type(e).__name__}: {e}")

    def on_sigterm(self, signum: int, frame: Any) -> None:
        """torchrun's agent stops the ranks when one failed: leave the partial result, then die of the signal."""
        from ..ranks.report import Report

        if not self.leaving:
            self.leave(Report(False, text="stopped by torchrun's agent (SIGTERM) after a peer's failure",
                              in_collective=True))  # not this rank's own error: diagnose blames the peer
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _load_on_node(cfg: TrainConfig, rank: int, local_rank: int) -> Any:
    """One process per node reads (or downloads) the data first; the others then read the files it wrote.

    What went wrong on any node reaches every rank (all_gather_object is also the barrier), so all of them stop
    with the same DataError instead of the peers dying of a closed connection.
    """
    import torch.distributed as dist

    from ..data import DataError, load_data

    data, error = None, None
    if local_rank == 0:
        try:
            data = load_data(cfg, quiet=rank != 0)
        except DataError as e:
            error = str(e)
    errors: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise DataError(first)
    return data if local_rank == 0 else load_data(cfg, quiet=True)


def _check_same_start(start_step: int) -> None:
    """Refuse, on every rank, a job whose ranks would resume from different steps.

    Each rank resolves --resume-from latest itself: a node that can't see rank 0's checkpoint folder (not on a
    shared file system) would start over while the others resume, and their collectives would no longer pair up.
    """
    import torch.distributed as dist

    steps: List[Optional[int]] = [None] * dist.get_world_size()
    dist.all_gather_object(steps, start_step)
    if len(set(steps)) > 1:
        raise ConfigError(f"TrainConfig.resume_from is not accepted: the ranks would resume from different steps "
                          f"({', '.join(f'rank {r}: {s}' for r, s in enumerate(steps))}); put checkpoint_dir on a "
                          "file system that every node reads, or give every node the same checkpoint file")


def _gather_rows(job: Any, rank: int) -> List[int]:
    """Give rank 0 every rank's rows: from the files it can see, over the group only for the others; returns
    the ranks whose rows travelled. Every rank has finished writing when the first collective returns."""
    import torch.distributed as dist

    world = job.cfg.world_size
    counts: List[Optional[int]] = [None] * world
    dist.all_gather_object(counts, job.rows.count(rank))
    seen = job.rows.counts() if rank == 0 else []
    far = [[r for r in range(world) if seen[r] != counts[r]] if rank == 0 else None]
    dist.broadcast_object_list(far, src=0)  # the ranks whose file rank 0 can't see (another machine)
    sent: List[Any] = [None] * world
    dist.all_gather_object(sent, job.rows.tables(rank) if rank in far[0] else None)
    if rank == 0:
        for r in far[0]:
            job.rows.give(r, sent[r])
    return far[0]


def _torchrun_rank(rank: int, world_size: int, cfg: TrainConfig, backend: str, start_step: int, out: str,
                   plots: bool, t_launch: float, run_dir: str) -> Optional[object]:
    """A torchrun rank's work inside its group: this node's data, the loop, the result on rank 0."""
    import shutil

    from ..engine import worker
    from ..engine.job import Job
    from ..ranks.env import RankEnv
    from ..ranks.report import error_report

    _check_same_start(start_step)
    local_rank = RankEnv.from_environ().local_rank
    job = Job.create(cfg, backend, _load_on_node(cfg, rank, local_rank), run_dir, start_step)
    job.t_launch = t_launch
    leaver = Leaver(job, rank, out, run_dir)
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, leaver.on_sigterm)
    try:
        summary = worker.train(rank, world_size, cfg, backend, job.data, run_dir)
    except BaseException as e:
        leaver.leave(error_report(e))
        raise
    far = _gather_rows(job, rank)
    if rank != 0:
        if rank in far and local_rank == 0:
            shutil.rmtree(run_dir, ignore_errors=True)  # its machine's rows went over the group: not needed here
        return None
    result = job.result(final_params=summary["final_params"])
    job.rows.close()
    write_outputs(result, out, plots)
    shutil.rmtree(run_dir, ignore_errors=True)
    if summary.get("checkpoint_error"):  # the training finished and its result is written: say what is missing
        from ..engine.checkpoint import CheckpointError

        raise CheckpointError(f"{summary['checkpoint_error']}; the training finished, and "
                              f"{os.path.join(out, 'result.json')} holds its result", result)
    return result


def run_torchrun(cfg: TrainConfig, out: str, plots: bool) -> Optional[object]:
    """One rank of a torchrun job, entered the way every rank is (ranks.rank.run_rank); rank 0 returns the result."""
    from ..engine.checkpoint import resolve_resume
    from ..engine.job import check_job
    from ..ranks.env import RankEnv
    from ..ranks.placement import default_threads
    from ..ranks.rank import run_rank

    env = RankEnv.from_environ()
    # torchrun's --nproc-per-node x --nnodes decides the world size; it owns the port (master_port=0: not ours).
    cfg = cfg.replace(world_size=env.world_size, master_port=0)
    cfg = resolve_resume(cfg)  # --resume-from latest: each attempt of a restarted job continues from the last one
    backend, start_step = check_job(cfg, local_world_size=env.local_world_size, check_port=False)
    threads = cfg.threads_per_rank or default_threads(env.local_world_size)  # this node's ranks share its cores
    args = (cfg, backend, start_step, out, plots, time.monotonic(), run_folder())
    return run_rank(_torchrun_rank, args, backend, cfg.timeout_s, threads, cfg.bind_cores)
