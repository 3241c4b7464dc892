"""A launched rank's stdout and stderr, Python's and C++'s alike: sent to its log file (which the launcher reads
and shows, ranks/echo.py), and capped, so a rank that prints without end can't fill the disk (8.86 GiB were
seen before the cap)."""
from __future__ import annotations

import os
import sys
import threading

LOG_CAP_BYTES = 4 * 2**20  # a log file this large is set aside (rank<r>.log.1) and a new one begun
CHECK_S = 0.2  # how often the size is looked at: what a rank can print past the cap in between is the overshoot


def _open(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


def _point_output_at(fd: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def capture_output(path: str, cap: int = LOG_CAP_BYTES) -> None:
    """Send this process's fds 1 and 2 to `path`; past `cap` bytes the file becomes path.1 (the previous .1 is
    dropped) and a new one begins: at most about twice the cap is kept, the newest output always."""
    _point_output_at(_open(path))
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    threading.Thread(target=_watch, args=(path, cap), name="ddp_helpers-log-cap", daemon=True).start()


def _watch(path: str, cap: int) -> None:
    stop = threading.Event()
    while not stop.wait(CHECK_S):
        try:
            if os.fstat(1).st_size > cap:
                os.replace(path, path + ".1")  # fd 1 still writes into it until the dup2 below
                _point_output_at(_open(path))
        except OSError:  # the run folder is being removed: the rank is ending
            return


def read_tail(path: str, n: int) -> str:
    """The last n characters written to a capped log (the end of path, after the end of path.1 if it is short)."""
    text = ""
    for part in (path, path + ".1"):
        try:
            with open(part, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 4 * n))  # utf-8: at most 4 bytes a character
                text = fh.read().decode("utf-8", errors="replace") + text
        except OSError:
            pass
        if len(text) >= n:
            break
    return text[-n:]
