"""Ending processes: a launch's ranks reaped or stopped, everything they started ended (wherever it went), a
rank's own descendants killed and collected, the kernel's helper processes ended before its shutdown, and an
interrupt during any of it can't cut it short, and SIGTERM or SIGHUP ending a launch as Ctrl-C does. The one module
that ends processes (joining.py uses it)."""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, FrozenSet, Iterator, List, Optional

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


def kill_group(pgid: int) -> None:
    """SIGKILL every process left in the group a rank leads (what it started, even after the rank exited)."""
    if hasattr(os, "killpg"):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # empty: nothing left
            pass


def end_descendants() -> None:
    """SIGKILL every process this one started, and theirs, then collect them all before this process exits.

    A killed process keeps its pid, and its place in a pids cgroup (pids.max), until its parent reaps it; one
    orphaned by its parent's death waits for PID 1, which some containers' inits reap only now and then.
    After a rank forked to the cgroup's limit and failed, the next launch was refused meanwhile. So this
    process first becomes the subreaper of its tree (Linux): the orphans of the killed come to it, and it waits
    for each exit (os.waitpid: the event, not a clock) until none is left. A descendant that can't die (stuck
    in the kernel) holds this process only until the launcher ends it.
    """
    if os.name != "posix":  # Windows: no zombies to collect (and os.waitpid(-1) would wait on this process itself)
        kill_descendants()
        return
    become_subreaper()
    while True:
        kill_descendants()  # again after each exit: one forked just before the last sweep comes to us alive
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:  # none left
            return
        except OSError:
            return


def become_subreaper() -> None:
    """Linux: the orphans of this process's descendants are re-parented to it (not to PID 1), for it to reap."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1)  # 36 = PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):  # not Linux: only this process's own children come back to it
        pass


def kill_descendants() -> None:
    """SIGKILL every process this one started, and theirs, wherever they moved (psutil walks the tree)."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass


# A Jupyter kernel's shutdown (ipykernel's Kernel._at_shutdown) signals every child in the kernel's process group,
# SIGTERM then SIGKILL, sleeping longer each round while any is left. Two are the launcher's: multiprocessing's
# resource tracker, which ignores SIGTERM, and the forkserver, which dies of it but stays a zombie the kernel
# never reaps. A restart then waited seconds longer than a kernel that never launched (docs/benchmarks.md) and the
# kernel was killed by Jupyter instead of ending. Ended and reaped before ipykernel looks, they leave it nothing
# to wait for.


def stop_helpers() -> None:
    """End and reap this process's forkserver (SIGKILL: it holds nothing worth saving, and it may still be
    importing) and its resource tracker (its pipe closed: it cleans up and exits)."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    server = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if server is not None:
        try:
            os.kill(server, getattr(signal, "SIGKILL", signal.SIGTERM))
        except OSError:
            pass
        try:
            forkserver._forkserver._stop()  # closes its pipe and reaps it
        except (OSError, ChildProcessError, AttributeError):
            pass
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    try:
        if tracker is not None:
            tracker._resource_tracker._stop()
    except (OSError, ChildProcessError, AttributeError):
        pass


def end_helpers_before_kernel_shutdown() -> bool:
    """In a Jupyter kernel, run stop_helpers() first when it shuts down (once per kernel); False elsewhere, or
    where this ipykernel has no _at_shutdown to precede (its shutdown then waits as before)."""
    ipython = sys.modules.get("IPython")  # loaded with the kernel: nothing is imported for a script or a rank
    shell = ipython.get_ipython() if ipython is not None else None
    kernel: Any = getattr(shell, "kernel", None)
    if kernel is None or not hasattr(kernel, "_at_shutdown"):
        return False
    if getattr(kernel, "_ddp_helpers_first", False):
        return True
    original = kernel._at_shutdown

    async def at_shutdown(*args: Any, **kwargs: Any) -> Any:
        stop_helpers()
        return await original(*args, **kwargs)

    kernel._at_shutdown = at_shutdown
    kernel._ddp_helpers_first = True
    return True


_BEFORE_DYING: List[Callable[[], None]] = []  # what EndOnSignals runs before a re-delivered signal kills us


def before_dying(fn: Callable[[], None]) -> None:
    """Run fn when this process dies of a SIGTERM or SIGHUP that EndOnSignals re-delivers (atexit runs not then)."""
    if fn not in _BEFORE_DYING:
        _BEFORE_DYING.append(fn)


class Signalled(SystemExit):
    """SIGTERM or SIGHUP arrived while ranks ran: unwind (ending them), then die of that signal."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


class EndOnSignals:
    """While the ranks run, SIGTERM and SIGHUP end the launch as Ctrl-C does (the ranks stopped, the run folder
    removed); then the previous disposition is restored, what before_dying() was given runs (what atexit would
    have done) and the signal is delivered again, so the process ends as it would have without us (a Jupyter
    kernel's shutdown relies on that). Only replaces the default action."""

    def __init__(self) -> None:
        self.saved: dict = {}

    def __enter__(self) -> "EndOnSignals":
        if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
            return self
        with interrupts_deferred() as pending:  # all installed, or none
            for name in ("SIGTERM", "SIGHUP"):
                sig = getattr(signal, name, None)  # Windows has no SIGHUP
                if sig is not None and signal.getsignal(sig) == signal.SIG_DFL:  # never replace someone's handler
                    self.saved[sig] = signal.signal(sig, self._raise)
        if pending:
            self._restore()
            raise KeyboardInterrupt
        return self

    def _restore(self) -> None:
        with interrupts_deferred():  # all restored (a Ctrl-C now comes as the launch ends anyway)
            for sig, handler in self.saved.items():
                signal.signal(sig, handler)

    @staticmethod
    def _raise(signum: int, frame: Any) -> None:
        raise Signalled(signum)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self._restore()
        if isinstance(exc, Signalled) and exc.signum in self.saved:
            for fn in _BEFORE_DYING:  # dying of the signal skips atexit
                fn()
            signal.raise_signal(exc.signum)  # the default action: this process ends, killed by that signal
