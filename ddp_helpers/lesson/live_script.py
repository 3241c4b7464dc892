"""Run a program from a notebook cell and show its output as it comes, with a line that counts the seconds.

A script that starts ranks can take a minute before its first line (each process imports torch). Captured and
printed at the end, the cell says nothing all that time. Here each line the program prints appears when it is
printed, and the command line above it shows how long the program has been running.

What a stored notebook keeps must not depend on the clock. The command line is one display output: the
seconds are updates of it (update_display_data), and the last update puts back the bare command. A notebook
saved afterwards (nbclient applies the updates) and a fresh run compared by nbval (it keeps the first display
and ignores updates) both hold the same text: the command, then the program's own lines.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Callable, List, Optional, Sequence

from ..common.extras import install_hint

TICK_S = 1.0  # how often the running line is updated


class _CommandLine:
    """The '$ command' line: in Jupyter a display that the seconds update, elsewhere printed once."""

    def __init__(self, text: str):
        self.text = text
        self.handle = None
        ipython = sys.modules.get("IPython")
        if ipython is not None and ipython.get_ipython() is not None:
            from IPython.display import display

            self.handle = display({"text/plain": text}, raw=True, display_id=True)
        else:
            print(text, flush=True)

    def running(self, seconds: float, started: bool) -> None:
        if self.handle is not None:
            what = "running" if started else "starting (nothing printed yet)"
            self.handle.update({"text/plain": f"{self.text}    [{what}: {seconds:.0f} s]"}, raw=True)

    def done(self) -> None:
        if self.handle is not None:
            self.handle.update({"text/plain": self.text}, raw=True)  # what the first display said


def _pump(stream: IO[str], name: str, lines: "queue.Queue") -> None:
    for line in stream:
        lines.put((name, line))
    lines.put((name, None))


def _stop(proc: subprocess.Popen) -> None:
    """End the program and what it started (its own process group), then reap it; on POSIX, return once the
    group is gone (its ranks outlived the program by a moment under load: the cell ended with them running)."""
    if proc.poll() is None:
        try:
            if os.name == "posix":
                os.killpg(proc.pid, signal.SIGTERM)  # its ranks too: they are in its group
            else:
                proc.terminate()
            proc.wait(5)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            if os.name == "posix":
                _kill_group(proc.pid, signal.SIGKILL)
            proc.kill()
    proc.wait()
    if os.name == "posix" and not _group_gone(proc.pid, 5.0):
        _kill_group(proc.pid, signal.SIGKILL)  # a member that ignored SIGTERM
        _group_gone(proc.pid, 5.0)


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_gone(pgid: int, wait_s: float) -> bool:
    """Wait (bounded) until no live process of the group pgid is left (a zombie waiting for an init that doesn't
    reap counts as gone); True if none is."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return True
        if not _live_members(pgid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


def _live_members(pgid: int) -> List[int]:
    import psutil

    live = []
    for p in psutil.process_iter(["status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and os.getpgid(p.pid) == pgid:
                live.append(p.pid)
        except OSError:  # gone meanwhile
            pass
    return live


def _raise_for_missing_extra(stderr: str, shown_as: str) -> None:
    """A program that failed for want of an optional module: one line naming the extra, not its traceback."""
    hint = install_hint(stderr, shown_as.split(" --", 1)[0])  # the program, without its options
    if hint is not None:
        error = ModuleNotFoundError(hint)
        error.stderr = stderr  # type: ignore[attr-defined]  # the program's own traceback, kept for a reader
        raise error


def run_script(argv: Sequence[str], shown_as: str, timeout_s: float = 600.0,
               on_line: Optional[Callable[[str], None]] = None) -> subprocess.CompletedProcess:
    """Run argv, printing '$ shown_as' and then each line of its stdout as it arrives; its stderr is printed
    if it fails. Returns what subprocess.run(..., capture_output=True, text=True) would. A program that fails for
    want of an extra's module (torchvision) raises ModuleNotFoundError, whose one line names what to install."""
    show = on_line or (lambda line: print(line, end="", flush=True))
    command = _CommandLine(f"$ {shown_as}")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # a pipe is block-buffered: lines would come at the end
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=(os.name == "posix"))
    lines: "queue.Queue" = queue.Queue()
    for stream, name in ((proc.stdout, "out"), (proc.stderr, "err")):
        threading.Thread(target=_pump, args=(stream, name, lines), daemon=True).start()
    out: List[str] = []
    err: List[str] = []
    open_streams, t0 = 2, time.monotonic()
    next_tick = t0 + TICK_S
    try:
        while open_streams:
            now = time.monotonic()
            if now - t0 > timeout_s:
                raise subprocess.TimeoutExpired(list(argv), timeout_s, "".join(out), "".join(err))
            if now >= next_tick:
                command.running(now - t0, bool(out))
                next_tick = now + TICK_S
            try:
                name, line = lines.get(timeout=max(0.0, next_tick - now))
            except queue.Empty:
                continue
            if line is None:
                open_streams -= 1
            elif name == "out":
                out.append(line)
                show(line)  # printed by the cell itself: in order, from this process
            else:
                err.append(line)
        proc.wait()
    finally:
        _stop(proc)  # interrupted or timed out: nothing outlives the cell
        command.done()
    if proc.returncode != 0 and err:
        _raise_for_missing_extra("".join(err), shown_as)
        print("".join(err).rstrip(), file=sys.stderr)
    return subprocess.CompletedProcess(list(argv), proc.returncode, "".join(out), "".join(err))
