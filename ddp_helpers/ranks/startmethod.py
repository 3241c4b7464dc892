"""Which start method a launch uses, and the forkserver's set-up; stdlib only, so warm_up() runs before torch loads."""
from __future__ import annotations

import multiprocessing
import os

START_METHODS = ("auto", "forkserver", "spawn", "fork")
# What the forkserver imports once, so that each rank it forks starts with torch, torch.distributed and
# torch._dynamo (which DDP's constructor imports: ~3 s) already loaded. _server_watch comes first (the server
# must not outlive a launcher killed while it preloads), _freeze_gc last (see each).
FORKSERVER_PRELOAD = ["ddp_helpers.ranks.server_watch", "ddp_helpers.ranks.boot", "ddp_helpers.ranks.launcher", "ddp_helpers.engine.worker",
                      "torch.distributed",
                      "torch._dynamo", "ddp_helpers.ranks.freeze_gc"]


def resolve_start_method(start_method: str) -> str:
    """'auto' -> forkserver where the platform has it (Linux, macOS), else spawn (Windows); others unchanged."""
    if start_method == "auto":
        return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    return start_method


def prepare_forkserver() -> None:
    """Name the launcher and the preload list; both take effect when the server starts (once per process)."""
    ctx = multiprocessing.get_context("forkserver")
    os.environ["DDP_HELPERS_LAUNCHER_PID"] = str(os.getpid())  # whom _server_watch watches (the server inherits it)
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)


def warm_up() -> None:
    """Start the forkserver now (it imports torch in the background), so the first launch is fast too.

    An explicit call, for a notebook's set-up cell, best before anything imports torch: the server's imports
    then run beside the notebook's own. That saves ~1 s of the first run only when a core is free for them:
    with every core busy the gain disappears (and the set-up cell takes longer, its imports sharing the cores
    with the server's). The server keeps the package as it was imported: after changing ddp_helpers itself,
    restart the kernel (as after any change to an imported module).
    """
    if resolve_start_method("auto") != "forkserver":
        return
    prepare_forkserver()
    import multiprocessing.forkserver

    multiprocessing.forkserver.ensure_running()
