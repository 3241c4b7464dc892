"""The rank processes of one launch, joined as torch's `ProcessContext.join` joins them; ended by ending.py.

Kept beside torch's because torch's needs torch imported and unpickles a failed rank's error file; ours doesn't.
A launcher that has not imported torch (a script whose ranks come from the forkserver, which preloads it) keeps
it unimported (what that saves a program: docs/benchmarks.md, issue 52's kill tests), and the ranks report
through the run folder (ranks/reports.py), never by a pickle another process could write.
"""
from __future__ import annotations

import multiprocessing.connection
from typing import Any, Callable, Dict, List, Optional

from .ending import join_all, stop_processes


class RankExited(Exception):
    """A rank's process exited with a code other than 0; the others have been ended. index: which rank."""

    def __init__(self, index: int, exitcode: Optional[int]):
        super().__init__(f"rank {index} exited with code {exitcode}")
        self.index, self.exitcode = index, exitcode


class RankProcesses:
    """One launch's rank processes (multiprocessing.Process, started), watched until all exit or one fails."""

    def __init__(self, processes: List[Any], forkserver_pid: Optional[int] = None):
        self.processes = processes
        self.forkserver_pid = forkserver_pid  # the server that forked them, whose death reads as their exit 255
        self._running: Dict[Any, int] = {p.sentinel: rank for rank, p in enumerate(processes)}

    def join(self, timeout: float, grace_s: float) -> bool:
        """Wait up to timeout s: True once every rank has exited with 0, False while some still run. The first
        to exit otherwise raises RankExited, after the others had grace_s to end by themselves (to report their
        side), then SIGTERM and grace_s more, then SIGKILL."""
        if not self._running:
            return True
        for sentinel in multiprocessing.connection.wait(list(self._running), timeout=timeout):
            rank = self._running.pop(sentinel)
            process = self.processes[rank]
            process.join()
            if process.exitcode != 0:
                self._end_all(grace_s)
                raise RankExited(rank, process.exitcode)
        return not self._running

    def watch(self, pollers: List[Callable[[], None]], poll_s: float, grace_s: float) -> Optional[int]:
        """Until every rank has exited (None) or one failed (its index: join has ended the others), each poller
        called after each wait of poll_s (what the ranks did meanwhile)."""
        while True:
            try:
                # join waits only on ranks still running; on a failure it gives the others grace_s to report their
                # side, then terminates them.
                if self.join(timeout=poll_s, grace_s=grace_s):
                    return None
            except RankExited as e:
                return e.index
            for poll in pollers:
                poll()

    def _end_all(self, grace_s: float) -> None:
        """The others get grace_s to end by themselves, then SIGTERM, grace_s more, SIGKILL (stop_processes)."""
        join_all(self.processes, grace_s)
        stop_processes(self.processes, grace_s)
