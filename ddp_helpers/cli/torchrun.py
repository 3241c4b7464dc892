"""One rank of a torchrun job (`torchrun ... -m ddp_helpers.train`): entered as every rank is (ranks.rank.run_rank),
and leaving its outcome and its rows the way a launched rank does, in a run folder (ranks/outbox.py).

The run folder is on the rank's machine, in the temp dir, shared by the job's ranks there. Rank 0 reads the rows
of the ranks it can see there; only the others' travel over the process group. A rank that fails, or that
torchrun's agent stops (SIGTERM, when a peer failed), first writes the job's partial result from every rank's
rows it can see: the rows are in their files already, so none recorded before the failure is lost.
"""
from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from typing import Any, List, Optional

try:
    import fcntl
except ImportError:  # Windows: no flock; a dead peer is not told from a live one
    fcntl = None  # type: ignore[assignment]

from ..common.errors import setting
from ..engine.config import ConfigError, TrainConfig
from .outputs import say, write_outputs

PARTIAL = "partial_result.json"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


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
    jobs on one machine never share an endpoint at the same time. The name is predictable (the job's ranks find
    it independently), so another user could make it first: it is created with mode 0700, or an existing one
    accepted only if it is a real folder of this user's with mode 0700 (common.files.make_private_dir), before
    anything in it is read or written. In the temp dir's sticky folder nobody else can then rename or replace it.
    """
    from ..common.files import make_private_dir
    from ..ranks.cleanup import RUN_DIR_PREFIX, hold

    key = "-".join(os.environ.get(k, "") for k in ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"))
    safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in key)
    path = os.path.join(tempfile.gettempdir(), f"{RUN_DIR_PREFIX}torchrun-{safe}-a{_attempt()}")
    make_private_dir(path, "the torchrun run folder", "Remove it (as its owner or root), or give this job another "
                     "--rdzv-id or --rdzv-endpoint port, or point TMPDIR at a folder only this user can write")
    hold(path)  # a folder some local rank holds is never taken for a dead launch's (cleanup.remove_stale)
    return path


_ALIVE: dict = {}  # rank -> the descriptor holding its alive lock in this process


def hold_alive(run_dir: str, rank: int) -> None:
    """Hold rank<r>.alive locked (flock, exclusive) for the rest of this process's life: the kernel releases it
    when the process ends, however it ends, so a peer on this machine can tell a dead rank from a live one."""
    if fcntl is None or rank in _ALIVE:
        return
    fd = os.open(os.path.join(run_dir, f"rank{rank}.alive"), os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _ALIVE[rank] = fd


def rank_gone(run_dir: str, rank: int) -> Optional[bool]:
    """True when rank's process on this machine has ended, False while it runs, None when unknown (its file is
    elsewhere or not made yet, or no flock)."""
    if fcntl is None:
        return None
    try:
        fd = os.open(os.path.join(run_dir, f"rank{rank}.alive"), os.O_RDONLY | _NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def remove_if_last(run_dir: str) -> None:
    """Remove the run folder once no local rank holds it (B5: a failed job leaves nothing): this process's hold
    is dropped, and the folder goes only if an exclusive lock is then free, so a peer that still needs the
    rows in it keeps it, and the last rank out removes it."""
    from ..ranks.cleanup import LOCK, release

    release(run_dir)
    if fcntl is None:
        return  # Windows: a later launch's remove_stale takes it
    try:
        fd = os.open(os.path.join(run_dir, LOCK), os.O_RDONLY | _NOFOLLOW)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        shutil.rmtree(run_dir, ignore_errors=True)
    except OSError:
        pass  # a peer still holds it
    finally:
        os.close(fd)


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
    rank's own exception path, or the SIGTERM torchrun's agent sends when a peer failed).

    A SIGTERM that arrives while the partial result is being written waits for it: the agent sends SIGTERM,
    then SIGKILL only after its shutdown timeout (torch.distributed.elastic.multiprocessing.api
    SubprocessContext._close; 30 s by default, TORCH_ELASTIC_SHUTDOWN_TIMEOUT), longer than the writer needs
    (wait_for_peer_rows gives up within 10 s). Re-raising at once lost partial results (docs/benchmarks.md).
    """

    def __init__(self, job: Any, rank: int, out: str, run_dir: str):
        self.job, self.rank, self.out, self.run_dir = job, rank, out, run_dir
        self.lock = threading.Lock()
        self.leaving = self.done = False
        self.pending: Optional[int] = None  # a signal that arrived while leaving, delivered once the file is written

    def leave(self, report: Any) -> None:
        """Write this rank's report and the partial result (a second call does nothing); then remove the run
        folder if no other rank here still holds it."""
        with self.lock:
            if self.leaving:
                return
            self.leaving = True
        try:
            self._write_partial(report)
        except Exception as e:  # noqa: BLE001 - never hide the failure itself
            say(f"rank {self.rank}: could not save the partial metrics: {type(e).__name__}: {e}")
        finally:
            remove_if_last(self.run_dir)
            self.done = True  # only now may a SIGTERM end this process: the folder's removal is part of leaving
        if self.pending is not None:
            _die_of(self.pending)

    def _write_partial(self, report: Any) -> None:
        from ..ranks.outbox import read_report_data, write_report_data
        from ..ranks.report import diagnose, report_data, report_from_data

        world = self.job.cfg.world_size
        write_report_data(self.run_dir, self.rank, report_data(report))  # data, never a pickle (outbox.py)
        reports = {r: report_from_data(d) for r, d in read_report_data(self.run_dir, world).items()}
        failure = diagnose(reports, self.run_dir, world)
        wait_for_peer_rows(self.job.rows, self.rank)
        partial = self.job.result(complete=False)
        partial.notes.append(f"attempt {_attempt()} failed: rank {failure.rank}: {failure.message}")
        hidden = self.job.rows.missing()
        if hidden:
            partial.notes.append(f"ranks {hidden} kept their rows on their own machines' run folders")
        path = partial.save(os.path.join(self.out, partial_name()))
        say(f"rank {self.rank}: metrics every rank recorded before the failure: {path}")

    def stopped_report(self) -> Any:
        """This rank's report on a SIGTERM: torchrun's agent sends one only after a peer failed, so a SIGTERM
        while every peer on this machine still runs and none has reported came from outside, and this rank is
        the one that failed. Where some peers are on other machines, it can't be told: the agent is assumed."""
        from ..ranks.outbox import read_report_data
        from ..ranks.report import Report

        world = self.job.cfg.world_size
        peers = [r for r in range(world) if r != self.rank]
        gone = [rank_gone(self.run_dir, r) for r in peers]
        if not self.job.rows.missing() and all(g is False for g in gone) \
                and not read_report_data(self.run_dir, world):
            return Report(False, text="killed by SIGTERM from outside while every peer still ran (sent to this "
                                      "rank, or to torchrun's agent, which passes it on; the agent itself stops "
                                      "ranks only after one failed)")
        return Report(False, text="stopped by torchrun's agent (SIGTERM) after a peer's failure",
                      in_collective=True)  # not this rank's own error: diagnose blames the peer

    def on_sigterm(self, signum: int, frame: Any) -> None:
        """torchrun's agent stops the ranks when one failed: leave the partial result, then die of the signal."""
        if self.leaving and not self.done:
            self.pending = signum  # this thread is writing the partial result: finish it, then die (leave)
            return
        if not self.leaving:
            self.leave(self.stopped_report())
        _die_of(signum)


def _die_of(signum: int) -> None:
    """End this process by signal signum, its default action (as if no handler had been installed)."""
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
            error = e.marked  # its settings still marked: the command line names them as flags
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
        raise ConfigError(f"{setting('resume_from', owner='TrainConfig')} is not accepted: the ranks would resume "
                          f"from different steps ({', '.join(f'rank {r}: {s}' for r, s in enumerate(steps))}); put "
                          f"{setting('checkpoint_dir')} on a file system that every node reads, or give every node "
                          "the same checkpoint file")


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

        raise CheckpointError(summary["checkpoint_error"], result, holder=os.path.join(out, "result.json"))
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
    try:
        run_dir = run_folder()
    except PermissionError as e:  # another user's folder, or a link: named, and nothing in it read
        raise ConfigError(str(e)) from None
    hold_alive(run_dir, env.rank)  # from the start: a SIGTERM's sender is judged by which peers still run
    args = (cfg, backend, start_step, out, plots, time.monotonic(), run_dir)
    return run_rank(_torchrun_rank, args, backend, cfg.timeout_s, threads, cfg.bind_cores)
