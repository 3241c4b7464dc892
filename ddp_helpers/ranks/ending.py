"""Ending a launch: every rank reaped or stopped, everything its ranks started ended (wherever it went), and an
interrupt during that can't cut it short."""
from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any, Iterator, List

from .procs import kill_group

GRACE_S = 2.0  # after SIGTERM, this long before SIGKILL
LAUNCH_MARK = "DDP_HELPERS_LAUNCH"  # in every rank's environment, so in everything a rank starts


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


def kill_marked(mark: str) -> List[int]:
    """SIGKILL every process of this user whose environment carries this launch's mark: what a rank started,
    even in a session of its own (start_new_session=True) or as a daemon that left its parent, and after the
    rank itself was killed. Where a process's environment can't be read, it is passed over."""
    import psutil

    uid = os.getuid() if hasattr(os, "getuid") else None
    killed = []
    for p in psutil.process_iter(["uids"]):
        try:
            if p.pid == os.getpid() or (uid is not None and p.info["uids"] and p.info["uids"].real != uid):
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


def end_launch(procs: List[Any], mark: str, wait_s: float) -> bool:
    """Reap or stop every rank, then end whatever they started: nothing of the launch outlives it. True if
    Ctrl-C came meanwhile (it waited)."""
    with interrupts_deferred() as pending:
        join_all(procs, wait_s)  # a rank that reported its value exits at once; one that doesn't ...
        stop_processes(procs)  # ... is ended here
        for p in procs:
            if p.pid is not None:
                kill_group(p.pid)  # each rank leads a process group: whatever it started is still in it
        kill_marked(mark)  # and whatever left the group
    return bool(pending)
