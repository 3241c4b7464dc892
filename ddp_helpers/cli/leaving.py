"""How a torchrun or SLURM rank leaves: its report, then the job's partial result, whatever ends it (an error,
torchrun's agent, the scheduler), and the run folder removed by the last local rank out.

On a shared --out (a multi-node job) every node's failing ranks write the same partial result: each merges
what is there already with what it saw, under a lock on --out (engine/partials.py), so the file holds every
rank's rows any node saw and the best-founded blame instead of the last writer's.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import threading
import time
from typing import Any, Dict, List, Optional

try:
    import fcntl
except ImportError:  # Windows: no flock; a dead peer is not told from a live one
    fcntl = None  # type: ignore[assignment]

from .nodes import attempt_label, attempts_named, place_text, scheduler_stop
from .outputs import say

PARTIAL = "partial_result.json"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
MERGE_WAIT_S = 10.0  # at most this long for another node's writer to finish merging (then write unmerged)
LEAVING_IMPORTS = ("..engine.partials", "..engine.result", "..engine.telemetry", "..ranks.reports", "..ranks.starting",
                   "..ranks.folders")
STUCK_S = 0.5  # a SIGTERM the main thread hasn't begun handling after this long is handled by the watch thread


def partial_name() -> str:
    """partial_result.json; where this attempt may be followed or preceded by another (torchrun restarts, a SLURM
    requeue), partial_result.attempt<k>.json: a later attempt's result.json must not stand beside a file that
    reads as this job's partial result."""
    return f"partial_result.attempt{attempt_label()}.json" if attempts_named() else PARTIAL


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
    from ..ranks.folders import lock_free

    with lock_free(os.path.join(run_dir, f"rank{rank}.alive")) as gone:
        return gone


def remove_if_last(run_dir: str) -> None:
    """Remove the run folder once no local rank holds it (a failed job leaves nothing): this process's hold is
    dropped, and the folder goes only if an exclusive lock is then free, so a peer that still needs the rows in
    it keeps it, and the last rank out removes it. Called on every way out (twice is harmless)."""
    from ..ranks.folders import LOCK, lock_free, release

    release(run_dir)
    with lock_free(os.path.join(run_dir, LOCK)) as free:  # None on Windows: a later job's remove_stale takes it
        if free:
            shutil.rmtree(run_dir, ignore_errors=True)  # a peer that still holds it keeps it


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


def save_merged(partial: Any, out: str, name: str) -> str:
    """Save partial as out/name, merged with the same attempt's partial another node saved there (under an
    exclusive flock on --out itself, so no file is left beside the result; where --out can't be locked, e.g.
    some network file systems, the merge is done without it)."""
    from ..engine.partials import merge_partials, same_attempt
    from ..engine.result import TrainResult

    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    fd = _lock_folder(out)
    try:
        try:
            there = TrainResult.load(path)
        except (OSError, ValueError):
            there = None
        if there is not None and same_attempt(there, partial):
            partial = merge_partials(there, partial)
        return partial.save(path)
    finally:
        if fd is not None:
            os.close(fd)


def _lock_folder(folder: str) -> Optional[int]:
    """An exclusive flock on folder, waited for up to MERGE_WAIT_S; None where it can't be had."""
    if fcntl is None:
        return None
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return None
    deadline = time.monotonic() + MERGE_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        except OSError:
            break
    os.close(fd)
    return None


class Leaver:
    """What a failing rank leaves: its report, then the job's partial result, once, whoever calls first (the
    rank's own exception path, or a SIGTERM: torchrun's agent when a peer failed, or the scheduler).

    Made as soon as the run folder exists, before the group and the data: a SIGTERM during start-up leaves a
    partial result too (with no rows yet), so every failed attempt keeps one. A SIGTERM that arrives while the
    partial result is being written waits for it: the agent sends SIGTERM, then SIGKILL only after its shutdown
    timeout (torch.distributed.elastic.multiprocessing.api SubprocessContext._close; 30 s by default,
    TORCH_ELASTIC_SHUTDOWN_TIMEOUT), and SLURM after KillWait; wait_for_peer_rows gives up within 10 s.
    """

    def __init__(self, job: Any, rank: int, out: str, run_dir: str, cfg: Any = None, backend: str = "",
                 t_launch: Optional[float] = None):
        self.job, self.rank, self.out, self.run_dir = job, rank, out, run_dir
        self.cfg, self.backend = (cfg if cfg is not None else job.cfg), backend
        self.t_launch = time.monotonic() if t_launch is None else t_launch
        self.provenance: Dict[str, Any] = {}  # where the ranks run (cli/nodes.py), once they have met
        self.lock = threading.Lock()
        self.leaving = self.done = False
        self.pending: Optional[int] = None  # a signal that arrived while leaving, delivered once the file is written
        self.previous: Any = None  # a handler that was there before ours (submitit's): called after leaving
        self.scheduler: Optional[str] = None  # why the scheduler stopped the job, when it did
        self.handling = threading.Event()  # the main thread has begun handling a SIGTERM

    def install(self) -> None:
        """Handle SIGTERM from now on, unless it is ignored; a handler already there (submitit's) is chained."""
        # What leaving imports, imported now: a SIGTERM handled while the main thread is halfway through importing
        # one of them (the rank's start-up imports the engine) would find it partly initialized and lose the partial.
        import importlib

        for name in LEAVING_IMPORTS:
            importlib.import_module(name, __package__)
        try:
            current = signal.getsignal(signal.SIGTERM)
            if current != signal.SIG_IGN:
                signal.signal(signal.SIGTERM, self.on_sigterm)
                self.previous = current if callable(current) else None
                self._watch_stuck()
        except ValueError:  # not the main thread: signals can't be handled here
            pass

    def _watch_stuck(self) -> None:
        """Python runs a signal handler in the main thread between bytecodes: a main thread stuck in C (a store's
        wait, gloo connecting to a peer that died) never runs it, and the rank was SIGKILLed 30 s later with no
        partial result. Python's C-level handler also writes the signal's number to a wakeup fd: a thread reads
        it and, if the main thread hasn't begun within STUCK_S, leaves in its place (POSIX; where no other code
        holds the wakeup fd)."""
        if os.name != "posix":
            return
        r, w = os.pipe()
        os.set_blocking(w, False)
        if signal.set_wakeup_fd(w, warn_on_full_buffer=False) != -1:  # someone's (asyncio's): theirs, not ours
            signal.set_wakeup_fd(-1)
            os.close(r)
            os.close(w)
            return
        threading.Thread(target=self._watch, args=(r,), name="ddp_helpers-sigterm-watch", daemon=True).start()

    def _watch(self, fd: int) -> None:
        while signal.SIGTERM not in os.read(fd, 64):
            pass
        if self.handling.wait(STUCK_S):
            return  # the main thread handles it
        with self.lock:
            stuck = not self.leaving
        if stuck:
            self.leave(self.stopped_report())
            _die_from_thread(signal.SIGTERM)

    def finish(self) -> None:
        """The rank succeeded (its part is written): a later SIGTERM ends it without a partial result."""
        with self.lock:
            self.leaving = self.done = True

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
            from ..ranks.reports import error_text

            say(f"rank {self.rank}: could not save the partial metrics: {error_text(e)}")
        finally:
            remove_if_last(self.run_dir)
            self.done = True  # only now may a SIGTERM end this process: the folder's removal is part of leaving
        if self.pending is not None:
            self._end(self.pending)

    def _failure(self, report: Any) -> Dict[str, Any]:
        """Who failed, as far as this node can tell, and how well it knows (engine/partials.py's weights)."""
        from ..engine.partials import INFERRED, OWN, SCHEDULER
        from ..ranks.reports import read_report_data, write_report_data
        from ..ranks.reports import diagnose, report_data, report_from_data

        world = self.cfg.world_size
        label = attempt_label()
        write_report_data(self.run_dir, self.rank, report_data(report))  # data, never a pickle (reports.py)
        if self.scheduler:
            return {"rank": None, "message": self.scheduler, "weight": SCHEDULER,
                    "note": f"attempt {label} failed: {self.scheduler}"}
        reports = {r: report_from_data(d) for r, d in read_report_data(self.run_dir, world).items()}
        failure = diagnose(reports, self.run_dir, world)
        blamed = reports.get(failure.rank)
        own = blamed is not None and not blamed.ok and not blamed.in_collective
        places = self.provenance.get("ranks") or []
        far = failure.rank < len(places) and places[failure.rank].get("host") != socket.gethostname()
        place = place_text(places[failure.rank]) if far else ""  # a peer on another machine: a failed node named
        return {"rank": failure.rank, "message": failure.message, "weight": OWN if own else INFERRED,
                "note": f"attempt {label} failed: rank {failure.rank}{place}: {failure.message}"}

    def _result(self) -> Any:
        """Everything recorded so far: the job's rows, or (before the job was made) a result with no rows."""
        if self.job is not None:
            wait_for_peer_rows(self.job.rows, self.rank)
            return self.job.result(complete=False), self.job.rows.missing()
        from ..engine.result import collect_result
        from ..engine.telemetry import RunRows
        from ..ranks.starting import peak_rss_bytes

        rows = RunRows(self.run_dir, self.cfg.world_size)
        partial = collect_result(rows.all_tables(), self.cfg.to_dict(), self.backend, self.cfg.dataset, "",
                                 self.t_launch, time.monotonic(), (), None, peak_rss_bytes(children=False) / 2**20,
                                 complete=False)
        return partial, rows.missing()

    def _write_partial(self, report: Any) -> None:
        from ..engine.partials import FAILURE_NOTE, unseen_note

        failure = self._failure(report)
        partial, hidden = self._result()
        partial.notes.append(failure["note"])
        if hidden:
            partial.notes.append(unseen_note(hidden))
        partial.provenance = dict(self.provenance, failure=failure, writers=[self.rank],
                                  seen=[r for r in range(self.cfg.world_size) if r not in hidden],
                                  **{FAILURE_NOTE: failure["note"], "unseen_note": unseen_note(hidden)})
        partial.provenance.setdefault("job", self.provenance.get("job", ""))
        partial.provenance.setdefault("attempt", attempt_label())
        path = save_merged(partial, self.out, partial_name())
        say(f"rank {self.rank}: metrics every rank recorded before the failure: {path}")

    def stopped_report(self) -> Any:
        """This rank's report on a SIGTERM. The scheduler's, where SLURM says it stopped the job. Else torchrun's
        agent sends one only after a peer failed, so a SIGTERM while every peer on this machine still runs and
        none has reported came from outside, and this rank is the one that failed. Where some peers are on other
        machines, it can't be told: the agent is assumed."""
        from ..ranks.reports import read_report_data
        from ..ranks.reports import Report

        self.scheduler = scheduler_stop()
        if self.scheduler:
            return Report(False, text=self.scheduler)
        world = self.cfg.world_size
        peers = [r for r in range(world) if r != self.rank]
        gone = [rank_gone(self.run_dir, r) for r in peers]
        hidden = self.job.rows.missing() if self.job is not None else []
        if not hidden and all(g is False for g in gone) and not read_report_data(self.run_dir, world):
            return Report(False, text="killed by SIGTERM from outside while every peer still ran (sent to this "
                                      "rank, or to torchrun's agent, which passes it on; the agent itself stops "
                                      "ranks only after one failed)")
        return Report(False, text="stopped by torchrun's agent (SIGTERM) after a peer's failure",
                      in_collective=True)  # not this rank's own error: diagnose blames the peer

    def on_sigterm(self, signum: int, frame: Any) -> None:
        """SIGTERM (torchrun's agent after a peer failed, or the scheduler): leave the partial result, then hand
        the signal to the handler that was there before (submitit's), else die of it."""
        self.handling.set()
        if self.leaving and not self.done:
            self.pending = signum  # this thread is writing the partial result: finish it, then die (leave)
            return
        if not self.leaving:
            self.leave(self.stopped_report())
        self._end(signum, frame)

    def _end(self, signum: int, frame: Any = None) -> None:
        """After leaving: the previous handler's turn (it may exit or requeue), then the signal's default."""
        if self.previous is not None:
            self.previous(signum, frame)
        _die_of(signum)


def _die_from_thread(signum: int) -> None:
    """End this process by signal signum from a thread other than the main one (signal.signal is the main
    thread's only): the default action set at the C level, then the signal sent again."""
    try:
        import ctypes

        ctypes.CDLL(None).signal(signum, 0)  # SIG_DFL
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
        os.kill(os.getpid(), signum)
    finally:
        os._exit(128 + signum)  # where that did not end it


def _die_of(signum: int) -> None:
    """End this process by signal signum, its default action (as if no handler had been installed)."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
