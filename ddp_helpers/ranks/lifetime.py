"""A process's lifetime and what it leaves: dying with its parent, leading its own process group, killing a group
or every descendant (and collecting them), its peak memory, and its heap frozen out of the garbage collector's
view."""
from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys

try:
    import resource
except ImportError:  # Windows: psutil answers for the peak memory instead
    resource = None  # type: ignore[assignment]


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so no worker outlives a crashed launcher."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the launcher's own cleanup still applies
        pass


def peak_rss_bytes(children: bool = True) -> float:
    """Peak resident memory of this process (plus, by default, its largest finished child), in bytes; NaN if unknown.

    ru_maxrss is in KiB on Linux and in bytes on macOS; Windows has no `resource` module (psutil answers there).
    """
    if resource is None:  # Windows: psutil's peak working set (children not included)
        import psutil

        info = psutil.Process().memory_info()
        return float(getattr(info, "peak_wset", info.rss))
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if children:
        usage += resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # e.g. the listing's DataLoader workers
    return float(usage) * (1 if sys.platform == "darwin" else 1024)


def freeze_heap() -> None:
    """Move every object alive now out of the garbage collector's view.

    torch (and the torch._dynamo that DDP imports) leaves millions of long-lived objects; freezing them keeps
    Python's full garbage collections from walking them in the middle of a step (tens of ms each).
    """
    gc.collect()
    gc.freeze()


def lead_own_group() -> None:
    """Make this process the leader of a new process group, so that it and all it starts can be ended at once."""
    if hasattr(os, "setpgid"):
        try:
            os.setpgid(0, 0)
        except OSError:  # already a group or session leader
            pass


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
