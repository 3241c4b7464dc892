"""Ending a launch: every rank reaped or stopped, everything its ranks started ended (wherever it went), and an
interrupt during that can't cut it short."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any, FrozenSet, Iterator, List, Optional

from .lifetime import kill_group
from .cores import note_ended

GRACE_S = 2.0  # after SIGTERM, this long before SIGKILL
LAUNCH_MARK = "DDP_HELPERS_LAUNCH"  # in every rank's environment, so in everything a rank starts
# A launch shorter than this looks for its marked processes only among those that appeared since it began. A pid
# that existed then can name a new process only once the kernel's pid counter has gone round (pid_max: 32768 to
# 4194304 allocations): over 500 new processes a second for a minute on the smallest. Longer launches scan all.
NEW_PIDS_FOR_S = 60.0


def join_all(procs: List[Any], timeout_s: float) -> None:
    """Join every process within one shared timeout."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))


def stop_processes(procs: List[Any], grace_s: float = GRACE_S) -> None:
    """SIGTERM every live process, SIGKILL those still alive after grace_s, then reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    join_all(procs, grace_s)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()


class PidsBefore:
    """The processes that existed before a launch started its ranks: none of them is one a rank started."""

    def __init__(self) -> None:
        import psutil

        self.pids: FrozenSet[int] = frozenset(psutil.pids())  # one listing of /proc: under a millisecond
        self.at = time.monotonic()

    def new_processes(self) -> Optional[List[Any]]:
        """The processes that appeared since (None once the launch has run NEW_PIDS_FOR_S: look at all)."""
        import psutil

        if time.monotonic() - self.at > NEW_PIDS_FOR_S:
            return None
        found = []
        for pid in psutil.pids():
            if pid not in self.pids:
                try:
                    found.append(psutil.Process(pid))
                except psutil.Error:  # gone meanwhile
                    continue
        return found


def kill_marked(mark: str, before: Optional[PidsBefore] = None) -> List[int]:
    """SIGKILL every process of this user whose environment carries this launch's mark: what a rank started,
    even in a session of its own (start_new_session=True) or as a daemon that left its parent, and after the
    rank itself was killed. Where a process's environment can't be read, it is passed over.

    before: the processes there before the launch, passed over. Reading every process's environment grows with
    their number (a desktop's hundreds made most of what issue 51 saw added to each launch: docs/benchmarks.md);
    the processes a short launch adds are a handful.
    """
    import psutil

    uid = os.getuid() if hasattr(os, "getuid") else None
    killed = []
    new = before.new_processes() if before is not None else None
    for p in psutil.process_iter() if new is None else new:
        try:
            if p.pid == os.getpid() or (uid is not None and p.uids().real != uid):
                continue
            if p.environ().get(LAUNCH_MARK) == mark:
                p.kill()
                killed.append(p.pid)
        except (psutil.Error, OSError):
            continue
    return killed


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[List[int]]:
    """Ctrl-C can't stop the block: it is noted in the list yielded, for the caller to act on once the block is
    done. A second interrupt during a launch's ending (its SIGTERM grace) left ranks running beside an idle
    notebook."""
    pending: List[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield pending
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield pending
    finally:
        signal.signal(signal.SIGINT, previous)


def end_launch(procs: List[Any], mark: str, wait_s: float, before: Optional[PidsBefore] = None) -> bool:
    """Reap or stop every rank, then end whatever they started: nothing of the launch outlives it. True if
    Ctrl-C came meanwhile (it waited). before: the processes there before the ranks started (kill_marked)."""
    with interrupts_deferred() as pending:
        join_all(procs, wait_s)  # a rank that reported its value exits at once; one that doesn't ...
        stop_processes(procs)  # ... is ended here
        for p in procs:
            if p.pid is not None:
                kill_group(p.pid)  # each rank leads a process group: whatever it started is still in it
        kill_marked(mark, before)  # and whatever left the group
        note_ended([p.pid for p in procs if p.pid is not None])  # the next launch's room check waits for them
        for p in procs:
            _close(p)
    return bool(pending)


def _close(p: Any) -> None:
    """Let go of a reaped rank's fds now (its sentinel, a pipe): the launch's frames that hold its Process live on
    in a notebook's last traceback (sys.last_value) until the next error, and over 20 interrupts a kernel kept
    4 more fds. Its Popen is closed, not the Process: p.exitcode, p.join() and p.is_alive() still answer (from
    the exit code already collected), where Process.close() would make them raise."""
    popen = getattr(p, "_popen", None)
    if popen is not None and getattr(popen, "returncode", None) is not None:  # reaped: nothing more to wait on
        popen.close()
