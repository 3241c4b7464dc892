"""A launched rank's output shown by the launching process as it comes (in a notebook: in the cell), each line
prefixed "[rank r] ", as Lightning's ddp_notebook and accelerate's notebook_launcher show theirs, and a notebook
cell named as IPython names it in what a rank printed or raised.

Kept beside torch elastic's TailLog, which copies every whole line unbounded: here a flood stays capped and escaped.
The rank writes to its log (ranks/output_log.py); the launcher's watch loop reads each log from where it last
stopped and prints the new complete lines: a rank's output reaches the cell only through its parent. stdout and
stderr share the log, so a rank's lines keep the order it wrote them in; both are shown on the parent's stdout.
Capped per rank and launch, as the log itself is: a print loop can't flood the notebook. Bounded per poll: at most
ECHO_READ_BYTES of a log is read at a time, and a line longer than ECHO_LINE_CHARS is shown cut and the rest of it
counted, never held (issue 61: a flood without newlines grew the launcher as much as it wrote). Control
characters are escaped (output_log.printable): a rank can't forge another's prefix. Standard library only.
"""
from __future__ import annotations

import linecache
import os
import re
import sys
from typing import List, Optional

from .folders import log_path
from .output_log import LOG_CAP_BYTES, printable

ECHO_LINES = 200  # a rank's lines shown per launch; past them, one line says so, and the count comes at the end
ECHO_LINE_CHARS = 2000  # a longer line is cut here (a tensor printed whole, output without a newline)
ECHO_READ_BYTES = 2**20  # read from a rank's log per poll, at most: the launcher's memory stays flat in a flood
LONG_LINE_BYTES = 4 * ECHO_LINE_CHARS  # an unended line this long is shown cut at once (utf-8: <= 4 bytes a char)
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
        self.pending = b""  # the start of a line not yet ended (at most LONG_LINE_BYTES + a read)
        self.shown = self.held_back = 0
        self.cutting = False  # inside a line too long to hold: the rest of it is dropped (counted if shown)
        self.counting = False  # ... and it was shown cut: its dropped bytes count in cut_bytes
        self.cut_lines = self.cut_bytes = 0  # lines shown cut, and the bytes of them not shown
        self.lost = False  # the log dropped a file before it was read (the rank wrote faster than polls read)

    @property
    def shown_all(self) -> bool:
        """True while every line the rank wrote has been shown (none held back by the cap)."""
        return self.held_back == 0 and not self.lost

    def poll(self) -> None:
        """Print the lines completed since the last look (from at most ECHO_READ_BYTES of the log)."""
        self._take(self._read())

    def finish(self) -> None:
        """Print what is left (a last line without its newline too), and what the caps held back."""
        data = self._read()
        while data:  # the rank has ended: its log no longer grows (at most twice output_log's cap is left)
            self._take(data)
            data = self._read()
        if self.pending and not self.cutting:
            self._line(self.pending)
        self.pending = b""
        if self.cut_lines:
            _say(f"[rank {self.rank}] ... {self.cut_lines:,} line{'s' * (self.cut_lines > 1)} cut at "
                 f"ECHO_LINE_CHARS: {self.cut_bytes:,} bytes not shown\n")
        if self.held_back:
            _say(f"[rank {self.rank}] ... {self.held_back:,} more lines not shown\n")
        if self.lost:
            _say(f"[rank {self.rank}] ... and output its log dropped before it was read, not counted (a log keeps "
                 f"its newest {2 * LOG_CAP_BYTES // 2**20} MiB: output_log.LOG_CAP_BYTES, twice)\n")

    def _read(self) -> bytes:
        """At most ECHO_READ_BYTES of the log, from where the last read stopped; across its rotation, the rest
        of the file set aside first, then the new one."""
        if self.fh is None:
            try:
                self.fh = open(self.path, "rb")  # noqa: SIM115 - kept open between looks
            except OSError:  # not created yet (or the run folder is gone)
                return b""
        data = self.fh.read(ECHO_READ_BYTES)
        if len(data) == ECHO_READ_BYTES or not self._set_aside():
            return data
        data += self.fh.read(ECHO_READ_BYTES - len(data))  # set aside, it no longer grows: its last bytes
        if len(data) < ECHO_READ_BYTES:  # its end: the new file from now on
            self.lost |= os.fstat(self.fh.fileno()).st_nlink == 0  # dropped as well: a whole file went unread
            self.close()
            if not data:
                return self._read()
        return data

    def _set_aside(self) -> bool:
        """True when the log file we read is no longer the rank's log (output_log rotated it)."""
        try:
            return os.stat(self.path).st_ino != os.fstat(self.fh.fileno()).st_ino
        except OSError:  # between the log's rotation and its new file: next time
            return False

    def _take(self, data: bytes) -> None:
        lines = (self.pending + data).split(b"\n")
        self.pending = lines.pop()
        for line in lines:
            if self.cutting:
                self.cutting = False  # the end of the line that was cut
                self.cut_bytes += len(line) * self.counting
            else:
                self._line(line)
        if self.cutting:
            self.cut_bytes += len(self.pending) * self.counting
            self.pending = b""
        elif len(self.pending) > LONG_LINE_BYTES:  # no newline in sight: show it cut now, count the rest
            self.counting = self._line(self.pending, unended=True)
            self.pending, self.cutting = b"", True

    def _line(self, raw: bytes, unended: bool = False) -> bool:
        """Show one line (True if it was shown cut)."""
        last = raw.rstrip(b"\r").rsplit(b"\r", 1)[-1]  # a progress bar's last state
        text = last[:LONG_LINE_BYTES].decode("utf-8", errors="replace")
        if any(p.search(text) for p in NOISE):
            return False
        if self.shown >= ECHO_LINES:
            self.held_back += 1
            return False
        cut = unended or len(text) > ECHO_LINE_CHARS
        if cut:
            self.cut_lines += 1
            self.cut_bytes += len(last) - len(text[:ECHO_LINE_CHARS].encode("utf-8", errors="replace"))
            text = text[:ECHO_LINE_CHARS] + " [... cut]"
        self.shown += 1
        _say(f"[rank {self.rank}] {name_cells(printable(text))}\n")
        if self.shown == ECHO_LINES:
            _say(f"[rank {self.rank}] ... further lines not shown (ECHO_LINES = {ECHO_LINES} per rank and launch, "
                 "in ddp_helpers/ranks/output_shown.py; launch(quiet=True) shows none)\n")
        return cut

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


# --- a notebook cell named as IPython names it ("Cell In[3], line 5"), in what a rank printed or raised ---
# A function defined in a cell reaches a rank with its code's file name, the one the kernel gave the cell
# (ipykernel: /tmp/ipykernel_<pid>/<hash>.py; see starting.dumps). Only the kernel knows which cell that is
# (IPython.core.compilerop.CachingCompiler.format_code_name) and holds its source (linecache): the ranks, started
# from a clean server, have neither. So the launching process rewrites what a rank said.

_FRAME = re.compile(r'^(?P<indent>\s*)File "(?P<file>[^"]+)", line (?P<line>\d+)(?P<rest>.*)$')
_WARNING = re.compile(r'^(?P<file>(?:[A-Za-z]:)?[^:]+\.py):(?P<line>\d+): ')  # warnings.formatwarning's first line


def cell_label(filename: str) -> Optional[str]:
    """'Cell In[3]' for a file name this IPython kernel gave one of its cells; else None."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    name = getattr(getattr(shell, "compile", None), "format_code_name", None)
    if name is None:
        return None
    try:
        found = name(filename)
    except Exception:  # noqa: BLE001 - an IPython whose compiler differs: the file name stays
        return None
    return f"{found[0]} {found[1]}" if found else None


def name_cells(text: str) -> str:
    """text (a traceback, or a line a rank printed) with each cell's file name given as IPython gives it, and
    each traceback frame in a cell followed by the cell's line, read from this kernel."""
    if "/" not in text and "\\" not in text and "<" not in text:
        return text  # no file name in it (most printed lines)
    out: List[str] = []
    lines = text.split("\n")
    for i, line in enumerate(lines):
        frame = _FRAME.match(line)
        label = cell_label(frame["file"]) if frame else None
        if frame and label:
            out.append(f"{frame['indent']}{label}, line {frame['line']}{frame['rest']}")
            source = linecache.getline(frame["file"], int(frame["line"])).strip()
            following = lines[i + 1] if i + 1 < len(lines) else ""
            if source and following.strip() != source:  # a rank without the cell's source printed none
                out.append(f"{frame['indent']}  {source}")
            continue
        warning = _WARNING.match(line)
        label = cell_label(warning["file"]) if warning else None
        out.append(f"{label}, line {warning['line']}: {line[warning.end():]}" if label else line)
    return "\n".join(out)
