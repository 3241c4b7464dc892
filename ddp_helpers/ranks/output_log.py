"""A launched rank's stdout and stderr, Python's and C++'s alike: sent to its log file (which the launcher reads
and shows, ranks/output_shown.py), and capped as it is written, so a rank that prints without end can't fill the disk
(8.86 GiB were seen before the cap) nor pass the cap between two looks at it (issue 61; docs/benchmarks.md).

On POSIX the rank's fds 1 and 2 are a pipe whose other end the launcher holds: one thread of the launch
(`LogKeeper`) drains every rank's pipe into its log, and the log is rotated at the exact byte where it would pass
the cap, however fast the rank writes (a full pipe makes the rank wait). The launcher, not the rank, reads the
pipe, so the last words of a rank that dies suddenly (os._exit, a signal) are still in the pipe and still logged:
a thread in the rank dies with it, holding what it had read. RLIMIT_FSIZE would cap the file too, but a rank
past it dies of SIGXFSZ without a word (or, with the signal ignored, every print raises), and it limits every
file the rank writes, checkpoints included. Where a pipe can't be handed to a rank (Windows' spawn), the rank
writes the file itself and a thread of its own looks at the size every CHECK_S.
"""
from __future__ import annotations

import os
import re
import selectors
import sys
import threading
from typing import Dict, List, Optional

LOG_CAP_BYTES = 4 * 2**20  # a log file this large is set aside (rank<r>.log.1) and a new one begun
CHECK_S = 0.2  # Windows only (no pipe): how often the rank looks at its log's size
CHUNK_BYTES = 64 * 1024  # what the keeper reads from a pipe at once (a pipe's default capacity on Linux)
LAST_READS = 16  # at the end, at most this many reads of a pipe: more than it holds, unless a writer lives on
# What a terminal or a notebook cell would act on rather than show: C0 controls but newline and tab, DEL, C1, and
# Unicode's line and paragraph separators (str.splitlines and some renderers break lines there).
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def printable(text: str) -> str:
    """text with every control character but newline and tab written as its escape (ESC as \\x1b): a rank's
    output can't move the cursor, clear a line, ring, retitle a terminal or forge another rank's prefix."""
    return _CONTROLS.sub(lambda m: ascii(m.group())[1:-1], text)


def _open(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0), 0o600)


class CappedLog:
    """One rank's log file, written by the launcher: set aside as path.1 (the previous .1 dropped) at exactly
    `cap` bytes, and a new one begun; at most twice the cap is kept, the newest output always."""

    def __init__(self, path: str, cap: int = LOG_CAP_BYTES):
        self.path, self.cap = path, cap
        self.fd: Optional[int] = None  # opened at the first byte: a rank that prints nothing leaves no log
        self.size = 0
        self.failed = False  # the run folder is gone (or the disk full): the rest is drained, not kept

    def write(self, data: bytes) -> None:
        """Append data, rotating at the cap."""
        view = memoryview(data)
        while view and not self.failed:
            try:
                if self.fd is None:
                    self.fd = _open(self.path)
                    self.size = os.fstat(self.fd).st_size
                if self.size >= self.cap:
                    self._rotate()
                    continue
                n = os.write(self.fd, view[:self.cap - self.size])
            except OSError:
                self.failed = True
                return
            self.size += n
            view = view[n:]

    def _rotate(self) -> None:
        os.replace(self.path, self.path + ".1")
        self.close()
        self.fd, self.size = _open(self.path), 0

    def close(self) -> None:
        """Let go of the file."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


class LogKeeper:
    """The launch's end of each rank's stdout/stderr pipe, drained by one thread into that rank's CappedLog.

    pipe_for(rank) makes a rank's pipe before it starts and gives the end to hand it; sent(rank) closes the
    launcher's copy of that end once the rank has it; start() starts the thread once every rank has started (a
    forked rank must not inherit a running thread); close() stops it, drains what the pipes still hold (a dead
    rank's last words) and closes everything, on every path of the launch.
    """

    def __init__(self, log_paths: List[str]):
        self.paths = log_paths
        self.reads: Dict[int, CappedLog] = {}  # the launcher's read end -> the log it fills
        self.writes: Dict[int, object] = {}  # rank -> the write end to hand it (a Connection), until sent
        self.wake_r = self.wake_w = -1
        self.thread: Optional[threading.Thread] = None

    def pipe_for(self, rank: int):
        """A new pipe for this rank's fds 1 and 2: the end to pass to it (picklable for spawn and forkserver)."""
        from multiprocessing.connection import Connection

        r, w = os.pipe()
        self.reads[r] = CappedLog(self.paths[rank])
        self.writes[rank] = end = Connection(w, readable=False)
        return end

    def sent(self, rank: int) -> None:
        """The rank has its end: close the launcher's (the pipe then ends when the rank and its children do)."""
        end = self.writes.pop(rank, None)
        if end is not None:
            end.close()

    def start(self) -> None:
        """Drain the pipes in a thread of this process until close()."""
        self.wake_r, self.wake_w = os.pipe()
        thread = threading.Thread(target=self._drain, name="ddp_helpers-rank-logs", daemon=True)
        thread.start()
        self.thread = thread  # only once started (a thread that didn't start can't be joined)

    def _drain(self) -> None:
        with selectors.DefaultSelector() as sel:
            for fd in [self.wake_r, *self.reads]:
                sel.register(fd, selectors.EVENT_READ)
            while len(sel.get_map()) > 1:
                for key, _ in sel.select():
                    if key.fd == self.wake_r:
                        return
                    if not self._pour(key.fd):
                        sel.unregister(key.fd)

    def _pour(self, fd: int) -> bool:
        """One read from a pipe into its log; False at its end (every writer gone)."""
        data = os.read(fd, CHUNK_BYTES)
        if data:
            self.reads[fd].write(data)
        return bool(data)

    def close(self) -> None:
        """Stop the thread, log what the pipes still hold, close every pipe and log."""
        if self.thread is not None:
            os.write(self.wake_w, b"x")
            self.thread.join()
            self.thread = None
        for rank in list(self.writes):
            self.sent(rank)
        while self.reads:
            fd, log = self.reads.popitem()
            try:
                os.set_blocking(fd, False)
                for _ in range(LAST_READS):  # bounded: a child of the rank may still be writing
                    if not self._pour_one(fd, log):
                        break
            finally:
                os.close(fd)
                log.close()
        for fd in (self.wake_r, self.wake_w):
            if fd >= 0:
                os.close(fd)
        self.wake_r = self.wake_w = -1

    @staticmethod
    def _pour_one(fd: int, log: CappedLog) -> bool:
        try:
            data = os.read(fd, CHUNK_BYTES)
        except BlockingIOError:  # empty: a child of the rank may still hold its end, writing nothing now
            return False
        log.write(data)
        return bool(data)


def keeper_for(log_paths: List[str]) -> Optional[LogKeeper]:
    """The launch's LogKeeper where a pipe can be handed to a rank (POSIX), else None (the rank writes its log)."""
    return LogKeeper(log_paths) if os.name == "posix" else None


def _point_output_at(fd: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _line_buffered() -> None:
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


def output_to_pipe(end, path: str) -> None:
    """In a rank: send fds 1 and 2 to the launcher's pipe (LogKeeper.pipe_for), line-buffered. The log is created
    first, empty: that the rank got this far (reports.py tells a rank that died starting by its missing log), and
    an OSError if the run folder is gone (the launch has ended)."""
    os.close(_open(path))
    _point_output_at(os.dup(end.fileno()))
    end.close()
    _line_buffered()


def capture_output(path: str, cap: int = LOG_CAP_BYTES) -> None:
    """In a rank with no pipe (Windows): send fds 1 and 2 to `path`; past `cap` bytes, looked at every CHECK_S,
    the file becomes path.1 (the previous .1 is dropped) and a new one begins."""
    _point_output_at(_open(path))
    _line_buffered()
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
    """The last n characters written to a capped log (the end of path, after the end of path.1 if it is short),
    control characters escaped (printable)."""
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
    return printable(text[-n:])
