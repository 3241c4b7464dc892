"""The first code a rank runs, before anything heavy is imported: tie the rank's life to its parent's.

This module imports only the standard library, so a rank started by spawn or forkserver reaches it in
milliseconds; torch and the function to run are unpickled afterwards (see launcher.Deferred).
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import signal
import threading

from .procs import die_with_parent


def _exit_when(sentinel) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(1)  # the parent is gone: nobody will read our result, and a rank must never outlive its job


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
    """Process target: watch the parent, then run the rank (launcher.rank_entry)."""
    _default_signals()
    watch_parent()
    from .launcher import rank_entry  # torch is imported only now

    rank_entry(rank, *args)
