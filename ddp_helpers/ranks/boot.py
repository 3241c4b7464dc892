"""The first code a rank runs, before anything heavy is imported: tie the rank's life to its parent's.

This module imports only the standard library, so a rank started by spawn or forkserver reaches it in
milliseconds; torch and the function to run are unpickled afterwards (see launcher.Deferred).
"""
from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading

from .lifetime import die_with_parent, kill_group, lead_own_group


def _exit_when(sentinel) -> None:
    multiprocessing.connection.wait([sentinel])
    # The parent is gone: nobody will read our result, and a rank must never outlive its job, nor what it started.
    if hasattr(os, "getpgrp") and os.getpgrp() == os.getpid():
        kill_group(os.getpid())  # this rank's group: itself and everything it started
    os._exit(1)


def watch_parent() -> None:
    """End this process when the process that launched it ends (at once if it already has)."""
    die_with_parent()  # Linux: SIGKILL from the kernel when our parent dies (under forkserver: the server)
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    # parent.sentinel becomes ready when the launching process exits, whatever the start method or platform.
    if multiprocessing.connection.wait([parent.sentinel], timeout=0):
        os._exit(1)  # it died while we were starting (a kernel restart mid-launch)
    threading.Thread(target=_exit_when, args=(parent.sentinel,), name="ddp_helpers-parent-watch",
                     daemon=True).start()


def _default_signals() -> None:
    # A forked rank inherits the launcher's SIGTERM/SIGHUP handlers (which end a launch cleanly): in a rank the
    # launcher's SIGTERM must simply end it, not be reported back as the rank's own error.
    for name in ("SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, signal.SIG_DFL)


def rank_main(rank: int, *args) -> None:
    """Process target: lead a process group of its own, watch the parent, then run the rank (rank.rank_entry)."""
    # First: Ctrl-C is the launcher's to handle. In Jupyter it reaches the kernel's whole process group, this
    # rank too until lead_own_group: a KeyboardInterrupt here would print its traceback into a notebook cell.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A forked rank holds a copy of its parent's heap, garbage included: collected here, a torch object's C++
    # destructor would run in a process without the threads it owns (std::terminate: "Fatal Python error:
    # Aborted" in freeze_heap's collection). Frozen, the parent's objects are never collected in the rank (and
    # their pages stay shared); what the rank makes from now on is collected as usual.
    gc.freeze()
    _default_signals()
    lead_own_group()  # the launcher ends this group at the end: whatever the rank starts goes with it
    watch_parent()
    from .rank import rank_entry  # torch is imported only now

    rank_entry(rank, *args)
