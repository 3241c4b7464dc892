"""Process checks shared by the tests that kill a parent and look for what outlived it, and waiting for an event."""
from __future__ import annotations

import signal
import time

import psutil


# How long a test waits for processes told to end (or orphaned) to be gone: ended by that event as soon as it
# comes; the bound only keeps a broken run from hanging the suite. A process tearing down torch's mappings takes
# well over 5 s on a loaded 2-core machine (issue 52: such windows failed beside busy loops).
ENDS_WITHIN_S = 60.0


def wait_for(condition, timeout: float, proc=None) -> bool:
    """Poll condition() until it is true (True), timeout seconds pass or the Popen proc ends (False).

    The event a test waits for (a marker file the code under test writes, a process appearing) comes when it
    comes on a loaded machine: timeout only keeps a broken run from hanging the suite.
    """
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline or (proc is not None and proc.poll() is not None):
            return bool(condition())
        time.sleep(0.05)
    return True


def running(p: psutil.Process) -> bool:
    """True while p exists and has not exited (a zombie has exited: reaping it is its new parent's job)."""
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def outliving(family: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes of family still running after timeout seconds.

    An orphan is re-parented to PID 1, which in some containers never reaps it; it then stays a zombie with no
    code running and no resources but its PID entry, so psutil.wait_procs would count it alive.
    """
    deadline = time.monotonic() + timeout
    left = [p for p in family if running(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if running(p)]
    return left


def describe_and_kill(procs: list[psutil.Process]) -> list[str]:
    """Command lines of procs (for the failure message), killing each."""
    names = []
    for p in procs:
        try:
            names.append(f"pid {p.pid}: " + " ".join(p.cmdline()[:3]))
            p.kill()
        except psutil.NoSuchProcess:
            names.append(f"pid {p.pid} (ended while being described)")
    return names


def survivors_of_killed(parent, timeout: float = ENDS_WITHIN_S) -> list[str]:
    """SIGKILL the Popen `parent`; the descriptions of its descendants still running `timeout` s later (killed)."""
    family = psutil.Process(parent.pid).children(recursive=True)
    parent.kill()
    parent.wait()
    return describe_and_kill(outliving(family, timeout))


def default_signals() -> None:
    """preexec_fn for a child the test will signal: SIGINT, SIGTERM and SIGHUP at their defaults in it.

    An ignored signal stays ignored across exec, and pytest may run with some ignored (`nohup make test &`
    ignores SIGHUP, a background job of a script SIGINT); the child would then rightly ignore what the test
    sends. (Python installs its KeyboardInterrupt handler only where SIGINT starts at the default.)
    """
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def without_torch_note(out: str) -> str:
    """out less warm_up()'s one line naming a torch other than the recorded one (common/recorded.py), so a test
    of what a script prints holds on any torch; on the recorded torch there is no such line and out is as it was."""
    from ddp_helpers.common.recorded import torch_differs_note

    note = torch_differs_note()  # the same line the child printed: same interpreter, same installed torch
    if note is None:
        return out
    lines = out.splitlines(keepends=True)
    return "".join(line for line in lines if line.rstrip("\n") != note)
