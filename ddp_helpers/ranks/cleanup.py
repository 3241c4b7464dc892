"""What a launch leaves behind, and removing it: its log folder, what a dead launch left, its signal handlers."""
from __future__ import annotations

import glob
import os
import shutil
import signal
import tempfile
import threading
from typing import Any

LOG_DIR_PREFIX = "ddp_helpers-ranks-"  # the ranks' log folders in the temp dir (their owner's pid inside)
MP_DIR_PREFIX = "ddp_helpers-mp-"  # a launching process's multiprocessing folder (the forkserver's socket)


def new_log_dir() -> str:
    """A private folder for the ranks' logs and reports, marked with its owner, after removing dead ones'."""
    remove_stale()
    return owned_dir(LOG_DIR_PREFIX)


def owned_dir(prefix: str) -> str:
    """A new folder in the temp dir with an owner file (pid, start time): remove_stale knows when it is garbage."""
    import psutil

    folder = tempfile.mkdtemp(prefix=prefix)
    with open(os.path.join(folder, "owner"), "w") as fh:
        fh.write(f"{os.getpid()} {psutil.Process().create_time()}")
    return folder


def remove_stale() -> None:
    """Remove the folders of launches whose process is gone (a kernel restart or SIGKILL skips their cleanup):
    the ranks' log folders, and the multiprocessing folder of each launching process (startmethod)."""
    import psutil

    for prefix in (LOG_DIR_PREFIX, MP_DIR_PREFIX):
        for folder in glob.glob(os.path.join(tempfile.gettempdir(), prefix + "*")):
            try:
                with open(os.path.join(folder, "owner")) as fh:
                    pid, started = fh.read().split()
                alive = psutil.pid_exists(int(pid)) and abs(psutil.Process(int(pid)).create_time() - float(started)) < 1e-3
            except (OSError, ValueError, psutil.Error):
                continue  # not ours (no owner file), or being written, or its owner just left: leave it
            if not alive:  # the pid is gone, or reused by a process that started later
                shutil.rmtree(folder, ignore_errors=True)


class Signalled(SystemExit):
    """SIGTERM or SIGHUP arrived while ranks ran: unwind (ending them), then die of that signal."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


class EndOnSignals:
    """While the ranks run, SIGTERM and SIGHUP end the launch as Ctrl-C does (the ranks stopped, the log folder
    removed); then the previous disposition is restored and the signal delivered again, so the process ends as
    it would have without us (a Jupyter kernel's shutdown relies on that). Only replaces the default action."""

    def __init__(self) -> None:
        self.saved: dict = {}

    def __enter__(self) -> "EndOnSignals":
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for name in ("SIGTERM", "SIGHUP"):
                sig = getattr(signal, name, None)  # Windows has no SIGHUP
                if sig is not None and signal.getsignal(sig) == signal.SIG_DFL:  # never replace someone's handler
                    self.saved[sig] = signal.signal(sig, self._raise)
        return self

    @staticmethod
    def _raise(signum: int, frame: Any) -> None:
        raise Signalled(signum)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)
        if isinstance(exc, Signalled) and exc.signum in self.saved:
            signal.raise_signal(exc.signum)  # the default action: this process ends, killed by that signal
