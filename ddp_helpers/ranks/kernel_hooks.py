"""A Jupyter kernel's shutdown, with the launcher's helper processes ended first.

ipykernel's shutdown (Kernel._at_shutdown) signals every child in the kernel's process group, SIGTERM then SIGKILL,
sleeping longer each round while any is left. Two are the launcher's: multiprocessing's resource tracker, which
ignores SIGTERM, and the forkserver, which dies of it but stays a zombie the kernel never reaps. A restart then
waited seconds longer than a kernel that never launched (docs/benchmarks.md) and the kernel was killed by Jupyter
instead of ending. Ended and reaped before ipykernel looks, they leave it nothing to wait for. Standard library only.
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Any


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
