"""The forkserver's one preload: torch and the rank's modules imported once, so each forked rank starts warm.

multiprocessing runs code in its forkserver only by importing the modules named as preloads, so importing this
module *in that server* is the call to preload(); imported anywhere else it does nothing.
"""
from __future__ import annotations

import gc
import os
import signal
import sys
import threading
import warnings

from .ending import become_subreaper

LAUNCHER_PID_ENV = "DDP_HELPERS_LAUNCHER_PID"  # set by startmethod.prepare_forkserver just before the server starts
# torch._dynamo: DDP's constructor imports it (seconds). psutil: every rank uses it (the interface towards the
# master, its descendants at exit) and would import it at each start. cloudpickle: every rank's report is pickled
# with it (a cell's classes come back), at each launch's end. What each costs unloaded: docs/benchmarks.md.
MODULES = ("torch.distributed", "torch._dynamo", "psutil", "cloudpickle", "ddp_helpers.ranks.starting",
           "ddp_helpers.ranks.rank", "ddp_helpers.engine.worker")
EXTRA_ENV = "DDP_HELPERS_PRELOAD"  # more modules for the server to import once (comma-separated): what every rank imports


def _watch(launcher: int, stop: threading.Event) -> None:
    while not stop.wait(0.1):
        if os.getppid() != launcher:  # re-parented: the launcher is gone
            os._exit(1)


def preload() -> None:
    """Import MODULES (and those $DDP_HELPERS_PRELOAD names) with the garbage collector off, ending the server if its
    launcher dies meanwhile; then freeze the heap and turn the collector back on.

    Once the preloads are done the server's own loop notices the launcher's exit (its alive pipe closes), but
    importing torch takes seconds (far longer on a busy machine): a launcher killed in that window would leave
    the server, and the resource tracker it holds open, running on their own. The watch ends before the first
    fork, so the server forks its ranks from a single thread. Frozen, the millions of objects torch creates are
    skipped by every forked rank's garbage collections (a part of each start-up: docs/benchmarks.md).
    """
    # The notebook's stop button sends SIGINT to the kernel's whole process group, this server included: while it
    # preloads that would end it mid-import (a 40-line traceback in the cell, and an EOFError at the next launch).
    # multiprocessing's own loop ignores SIGINT too, but only once the preloads are done.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The imports create hundreds of thousands of long-lived objects, and each collection they trigger walks those
    # made so far: a part of the server's time, which the first launch waits for (docs/benchmarks.md, issue 62).
    # Nothing is collected until the heap is frozen; the ranks it forks collect as usual (boot.rank_main).
    gc.disable()
    stop = threading.Event()
    watch = threading.Thread(target=_watch, args=(os.getppid(), stop), name="ddp_helpers-server-watch", daemon=True)
    watch.start()
    try:
        for name in MODULES + tuple(m for m in os.environ.get(EXTRA_ENV, "").split(",") if m):
            __import__(name)
    finally:
        stop.set()
        watch.join()
        # Frozen as it is, the imports' few garbage objects included: collecting them first would walk every
        # object once more, and a rank never collects what it inherits anyway (boot.rank_main freezes it).
        gc.freeze()
        gc.enable()  # also after a failed import (multiprocessing's server goes on without that preload)
    # The orphans of a rank's children (the rank killed before it could collect them) come to this server, whose
    # loop reaps every child as it exits: their pids leave a pids cgroup then, not when PID 1 gets round to them.
    # Not inherited by the ranks it forks. The loop warns of each child it didn't fork: these are expected.
    become_subreaper()
    warnings.filterwarnings("ignore", message="forkserver: waitpid returned unexpected pid")


def _in_forkserver() -> bool:
    return (sys.argv[:1] == ["-c"] and "multiprocessing.forkserver" in sys.modules
            and os.environ.get(LAUNCHER_PID_ENV) == str(os.getppid()))


if _in_forkserver():
    preload()
