"""A launched rank's output shown by the launching process as it comes (in a notebook: in the cell), each line
prefixed "[rank r] ", as Lightning's ddp_notebook and accelerate's notebook_launcher show theirs.

The rank writes to its log (ranks/ranklog.py); the launcher's watch loop reads each log from where it last
stopped and prints the new complete lines: a rank's output reaches the cell only through its parent. stdout and
stderr share the log, so a rank's lines keep the order it wrote them in; both are shown on the parent's stdout.
Capped per rank and launch, as the log itself is: a print loop can't flood the notebook. Standard library only.
"""
from __future__ import annotations

import os
import re
import sys
from typing import List, Optional

from .cells import name_cells
from .outbox import log_path

ECHO_LINES = 200  # a rank's lines shown per launch; past them, one line says so, and the count comes at the end
ECHO_LINE_CHARS = 2000  # a longer line is cut here (a tensor printed whole, output without a newline)
# Lines not shown, only logged. gloo of some torch releases prints one per rank as its group connects
# ("[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"): noise the
# learner didn't write, and the cells' stored outputs would differ between torch versions (which ones:
# docs/maintainers.md, "Version notes").
NOISE = (re.compile(r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks"),)


class RankEcho:
    """One rank's log, read from where the last look stopped; its new lines printed with the rank's prefix."""

    def __init__(self, path: str, rank: int):
        self.path, self.rank = path, rank
        self.fh = None  # opened once the rank has created its log
        self.pending = b""  # the start of a line not yet ended
        self.shown = self.held_back = 0
        self.cutting = False  # inside a line already shown cut: the rest of it is dropped

    @property
    def shown_all(self) -> bool:
        """True while every line the rank wrote has been shown (none held back by the cap)."""
        return self.held_back == 0

    def poll(self) -> None:
        """Print the lines completed since the last look."""
        self._take(self._read())

    def finish(self) -> None:
        """Print what is left (a last line without its newline too), and how many lines the cap held back."""
        self._take(self._read())
        if self.pending and not self.cutting:
            self._line(self.pending)
        self.pending = b""
        if self.held_back:
            _say(f"[rank {self.rank}] ... {self.held_back:,} more lines not shown\n")

    def _read(self) -> bytes:
        if self.fh is None:
            try:
                self.fh = open(self.path, "rb")  # noqa: SIM115 - kept open between looks
            except OSError:  # not created yet (or the run folder is gone)
                return b""
        data = self.fh.read()
        try:
            rotated = os.stat(self.path).st_ino != os.fstat(self.fh.fileno()).st_ino
        except OSError:  # between the log's rotation and its new file: next time
            rotated = False
        if rotated:  # the rank set this file aside (ranklog's cap): its last bytes, then the new file
            data += self.fh.read()
            self.fh.close()
            self.fh = None
            data += self._read()
        return data

    def _take(self, data: bytes) -> None:
        lines = (self.pending + data).split(b"\n")
        self.pending = lines.pop()
        for line in lines:
            if self.cutting:
                self.cutting = False  # the end of the line that was cut
            else:
                self._line(line)
        if len(self.pending) > 4 * ECHO_LINE_CHARS and not self.cutting:  # no newline in sight: show it cut
            self._line(self.pending)
            self.pending, self.cutting = b"", True
        elif self.cutting:
            self.pending = b""

    def _line(self, raw: bytes) -> None:
        text = raw.decode("utf-8", errors="replace").rstrip("\r").rsplit("\r", 1)[-1]  # a progress bar's last
        if any(p.search(text) for p in NOISE):
            return
        if self.shown >= ECHO_LINES:
            self.held_back += 1
            return
        if len(text) > ECHO_LINE_CHARS:
            text = text[:ECHO_LINE_CHARS] + " [... cut]"
        self.shown += 1
        _say(f"[rank {self.rank}] {name_cells(text)}\n")
        if self.shown == ECHO_LINES:
            _say(f"[rank {self.rank}] ... further lines not shown (ECHO_LINES = {ECHO_LINES} per rank and launch, "
                 "in ddp_helpers/ranks/echo.py; launch(quiet=True) shows none)\n")

    def close(self) -> None:
        """Let go of the log (Windows can't remove an open file)."""
        if self.fh is not None:
            self.fh.close()
            self.fh = None


def _say(text: str) -> None:
    out = sys.stdout  # looked up each time: in a notebook, the stream of the cell running now
    out.write(text)
    out.flush()


class LaunchEcho:
    """Every rank's echo for one launch."""

    def __init__(self, run_dir: str, world_size: int):
        self.ranks: List[RankEcho] = [RankEcho(log_path(run_dir, r), r) for r in range(world_size)]

    def poll(self) -> None:
        """Print each rank's new lines."""
        for r in self.ranks:
            r.poll()

    def finish(self) -> None:
        """Print what remains of every rank's output, then let the logs go."""
        for r in self.ranks:
            try:
                r.finish()
            finally:
                r.close()

    def shown_all(self, rank: int) -> bool:
        """True if every line of this rank's output has been printed (a failure then needn't repeat its tail)."""
        return 0 <= rank < len(self.ranks) and self.ranks[rank].shown_all


def echo_for(run_dir: str, world_size: int, quiet: bool) -> Optional[LaunchEcho]:
    """The launch's echo, or None when quiet."""
    return None if quiet else LaunchEcho(run_dir, world_size)
