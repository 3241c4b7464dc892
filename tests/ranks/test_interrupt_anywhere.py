"""Ctrl-C at any moment of a run, start-up included, leaves no folder and no fd, and gives the package's own
interruption (issue 61, N8 and N9).

Over 20 interrupts a kernel's fds went from 72 to 76, and an interrupt 0.00 s into run_training gave a bare
KeyboardInterrupt and left a ddp_helpers-ranks-* folder holding only its owner file (and a ddp_helpers-mp-*
folder). The interrupt is placed by an event, not a clock: a trace function counts the package's executed lines
and sends SIGINT at the k-th, so the KeyboardInterrupt is raised there, at every k of a short function (each
window of the folders' making) and at random k of a whole run.
"""
from __future__ import annotations

import glob
import inspect
import multiprocessing.process
import os
import random
import signal
import sys
import tempfile

import pytest

import ddp_helpers
from ddp_helpers import run_training
from ddp_helpers.engine import runner
from ddp_helpers.ranks import ending, folders, joining, launcher, starting, startmethod
from ddp_helpers.ranks.launcher import LaunchInterrupted

PACKAGE = os.path.dirname(os.path.abspath(ddp_helpers.__file__))
SKIPPED = {runner.run_training.__code__}  # its `try:` line: a signal there is raised before run_training began


class InterruptAt:
    """A trace function that sends SIGINT at the k-th line the package executes (None: counts them)."""

    def __init__(self, k=None):
        self.k, self.lines = k, 0

    def __enter__(self):
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)

    def _call(self, frame, event, arg):
        code = frame.f_code
        return self._line if code.co_filename.startswith(PACKAGE) and code not in SKIPPED else None

    def _line(self, frame, event, arg):
        if event == "line":
            if self.lines == self.k:
                sys.settrace(None)
                frame.f_trace = None
                os.kill(os.getpid(), signal.SIGINT)  # raised here, at this line, as Ctrl-C would be
            self.lines += 1
        return self._line


def _fds() -> set:
    return {(fd, os.readlink(f"/proc/self/fd/{fd}")) for fd in map(int, os.listdir("/proc/self/fd"))
            if _alive(fd)}


def _alive(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:  # the listing's own descriptor, closed already
        return False


def _left(where: str, prefix: str) -> list:
    return glob.glob(os.path.join(where, prefix + "*"))


def _interrupt_every_line_of(make, tmp_path, prefix: str, kept=lambda made: made, reset=lambda: None) -> int:
    """Call make() with an interrupt at each of its lines in turn: every time, no folder and no fd is left but
    a folder made whole and handed over (kept(made): to the caller, or registered for removal at exit)."""
    with InterruptAt() as counting:
        made = make()
    folders.remove_run_dir(kept(made))
    reset()
    before = _fds()
    for k in range(counting.lines):
        made = None
        try:
            with InterruptAt(k):
                made = make()
        except KeyboardInterrupt:
            pass
        whole = kept(made)
        if whole is not None:  # the interrupt landed after it was whole: it is the caller's to remove
            folders.remove_run_dir(whole)
            reset()
        assert _left(str(tmp_path), prefix) == [], f"interrupted at line {k} of {counting.lines}"
        assert _fds() == before, f"interrupted at line {k} of {counting.lines}"
    return counting.lines


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts fds in /proc")
def test_no_run_folder_and_no_fd_survive_an_interrupt_while_the_folder_is_made(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(folders, "SHORT_ROOT", str(tmp_path))  # the lines run depend on what the folder holds
    assert _interrupt_every_line_of(folders.new_run_dir, tmp_path, folders.RUN_DIR_PREFIX) > 10


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts fds in /proc")
def test_no_multiprocessing_folder_survives_an_interrupt_while_it_is_made(tmp_path, monkeypatch):
    """The forkserver's folder (startmethod), made at a process's first launch."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(folders, "SHORT_ROOT", str(tmp_path))  # where a long temp dir's socket folder would go
    config = multiprocessing.process.current_process()._config
    monkeypatch.delitem(config, "tempdir", raising=False)

    assert _interrupt_every_line_of(startmethod._own_multiprocessing_dir, tmp_path, folders.MP_DIR_PREFIX,
                                    kept=lambda made: config.get("tempdir"),
                                    reset=lambda: config.pop("tempdir", None)) > 5


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts fds in /proc")
def test_no_socket_survives_an_interrupt_while_the_store_socket_is_made(monkeypatch):
    """The launch's rendezvous socket (starting.bind_listener): an interrupt at any of its lines, its exception held
    as a notebook holds it, leaves no descriptor. Raised inside socket.socket(), it left the new socket open,
    held by the traceback (found by the twenty interrupts below, at a line count the load made)."""
    with InterruptAt() as counting:
        starting.bind_listener("127.0.0.1", 0).close()
    before = _fds()
    for k in range(counting.lines):
        try:
            with InterruptAt(k):
                starting.bind_listener("127.0.0.1", 0).close()
        except KeyboardInterrupt as e:
            monkeypatch.setattr(sys, "last_value", e, raising=False)  # held, as a notebook holds its last error
        assert _fds() == before, f"interrupted at line {k} of {counting.lines}"


def _rank_value(rank, world_size):
    return rank


def _line_of(function, text: str) -> int:
    """The line number of the first line of function holding text."""
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.parametrize("where, when", [
    ("ending.end_launch", lambda f: f.f_locals.get("wait_s") == 10.0),  # once every rank reported
    ("joining.RankProcesses.__init__", lambda f: True),  # as the started ranks are handed to their watch
    ("launcher._supervise",  # the line that defers Ctrl-C while the socket and the logs are closed
     lambda f: f.f_lineno == _line_of(launcher._supervise, "with interrupts_deferred() as late")),
])
def test_an_interrupt_at_a_launchs_seams_leaves_no_fd(where, when, monkeypatch):
    """Ctrl-C on a line between two of a launch's deferred steps (found by the twenty interrupts below, at line
    counts the load made): LaunchInterrupted, the ranks ended and their fds, logs and socket let go."""
    from ddp_helpers import launch

    module, *names = where.split(".")
    code = {"ending": ending, "joining": joining, "launcher": launcher}[module]
    for name in names:
        code = getattr(code, name)
    code = code.__code__
    launch(_rank_value, 2)  # the forkserver up: the fds it keeps are there before
    before = _fds()

    def at_the_line(frame, event, arg):
        if event == "line" and when(frame):
            sys.settrace(None)
            frame.f_trace = None
            os.kill(os.getpid(), signal.SIGINT)  # raised at this line, as Ctrl-C would be
            return None
        return at_the_line

    sys.settrace(lambda frame, event, arg: at_the_line if frame.f_code is code else None)
    try:
        launch(_rank_value, 2)
    except LaunchInterrupted as e:
        monkeypatch.setattr(sys, "last_value", e, raising=False)  # held, as a notebook holds its last error
    except KeyboardInterrupt as e:  # noqa: B014 - the bare one is the finding
        pytest.fail(f"a bare {type(e).__name__}: {e!r}")
    else:
        pytest.fail("the launch was not interrupted")
    finally:
        sys.settrace(None)
    assert _fds() == before


def _interrupted_run(cfg, k):
    try:
        with InterruptAt(k):
            run_training(cfg, progress=False)
    except LaunchInterrupted as e:
        return e
    except KeyboardInterrupt as e:  # noqa: B014 - the bare one is the finding
        pytest.fail(f"a bare {type(e).__name__} at line {k}: {e!r}")
    return None


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts fds in /proc")
def test_twenty_interrupts_anywhere_in_run_training_leave_nothing(small_cfg, tmp_path, monkeypatch):
    """At the first lines (0 ms in) and at random lines of a whole run: LaunchInterrupted every time, with the
    steps recorded so far once a run folder exists; no run folder, no fd of the process gained (the last
    exception kept, as a kernel keeps it in sys.last_value)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cfg = small_cfg.replace(max_steps=30)  # long enough that some interrupts land between steps
    run_training(cfg, progress=False)  # the forkserver up, the data cached: what every later run finds
    with InterruptAt() as counting:  # how many lines a run takes (its watch loop's share varies with the load)
        run_training(cfg, progress=False)
    before = _fds()
    points = [0, 1, 2] + sorted(random.Random(61).sample(range(3, counting.lines * 9 // 10), 17))
    interrupted = 0
    for k in points:
        e = _interrupted_run(cfg, k)
        interrupted += e is not None
        monkeypatch.setattr(sys, "last_value", e, raising=False)  # held, as a notebook holds its last error
        assert _left(str(tmp_path), folders.RUN_DIR_PREFIX) == [], f"interrupted at line {k}"
        assert _fds() == before, f"interrupted at line {k} of {counting.lines}"
    assert interrupted >= 18, f"only {interrupted} of {len(points)} runs were interrupted"
