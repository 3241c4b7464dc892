"""Which start method a launch uses, and the forkserver's set-up; stdlib only, so warm_up() runs before torch loads."""
from __future__ import annotations

import multiprocessing
import multiprocessing.process
import multiprocessing.util
import os
import shutil
import sys
import tempfile
from typing import Optional

START_METHODS = ("auto", "forkserver", "spawn", "fork")
PRELOAD = "ddp_helpers.ranks.server_preload"  # what the forkserver imports once (see that module)
WARM_UP_NOTICE = ("Setting up, once per kernel: this notebook and a server process for its ranks each import "
                  "torch (a few seconds, longer on a busy machine). The first launch waits for the server if it "
                  "is not ready yet; later launches start in a fraction of a second.")


def resolve_start_method(start_method: str) -> str:
    """'auto' -> forkserver where the platform has it (Linux, macOS), else spawn (Windows); others unchanged."""
    if start_method == "auto":
        return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    return start_method


# AF_UNIX socket paths hold at most 108 bytes on Linux, 104 on macOS and the BSDs, the final NUL included.
SOCKET_PATH_MAX = 108 if sys.platform.startswith("linux") else 104
SOCKET_NAME = "ddp_helpers-mp-xxxxxxxx/listener-xxxxxxxx"  # as long as the forkserver's socket path in the temp dir


def socket_root(temp_dir: Optional[str] = None) -> Optional[str]:
    """None when the temp dir's path leaves room for the forkserver's socket; else cleanup.SHORT_ROOT (a folder
    made there is private: mkdtemp, mode 0700, a random name), or a ConfigError naming TMPDIR. Clusters set long
    TMPDIRs: over ~65 characters, binding the socket failed with "AF_UNIX path too long"."""
    from ..common.errors import ConfigError
    from .folders import SHORT_ROOT

    temp_dir = temp_dir or tempfile.gettempdir()
    if len(os.fsencode(os.path.join(temp_dir, SOCKET_NAME))) < SOCKET_PATH_MAX:
        return None
    if os.path.isdir(SHORT_ROOT) and os.access(SHORT_ROOT, os.W_OK | os.X_OK):
        return SHORT_ROOT
    raise ConfigError(f"TMPDIR={temp_dir!r} is not accepted: the ranks' server listens on a socket in it, and its "
                      f"path would pass the {SOCKET_PATH_MAX - 1} bytes a socket's path may hold (AF_UNIX), and "
                      f"{SHORT_ROOT} is not writable either; set TMPDIR to a shorter folder (under "
                      f"{SOCKET_PATH_MAX - 1 - len(SOCKET_NAME) - 1} characters) before starting Python")


def _own_multiprocessing_dir() -> None:
    """Give multiprocessing a temp folder with an owner file, instead of the pymp-* it would make for the
    forkserver's socket: a process killed with SIGKILL leaves it behind, and the next launch removes it."""
    from .ending import before_dying, interrupts_deferred
    from .folders import MP_DIR_PREFIX, owned_dir, remove_own_multiprocessing_dir

    config = multiprocessing.process.current_process()._config
    if config.get("tempdir") is not None:
        return
    root = socket_root()
    with interrupts_deferred() as pending:  # Ctrl-C waits until the folder is made and known to be removed at exit
        folder = owned_dir(MP_DIR_PREFIX, root)  # what multiprocessing.util.get_temp_dir does, with our folder
        config["tempdir"] = folder
        multiprocessing.util.Finalize(None, shutil.rmtree, args=(folder, True), exitpriority=-100)
        before_dying(remove_own_multiprocessing_dir)  # and when a signal ends this process mid-launch
    if pending:
        raise KeyboardInterrupt


def prepare_forkserver() -> None:
    """Name the launcher and the preload list; both take effect when the server starts (once per process). In a
    Jupyter kernel, the server and the resource tracker are ended first when the kernel shuts down."""
    from .ending import end_helpers_before_kernel_shutdown

    _own_multiprocessing_dir()
    end_helpers_before_kernel_shutdown()
    ctx = multiprocessing.get_context("forkserver")
    os.environ["DDP_HELPERS_LAUNCHER_PID"] = str(os.getpid())  # the server's preload checks it is ours (inherited)
    ctx.set_forkserver_preload([PRELOAD])


def forkserver_pid() -> Optional[int]:
    """The pid of this process's forkserver (None if none runs)."""
    import multiprocessing.forkserver as fs

    return getattr(getattr(fs, "_forkserver", None), "_forkserver_pid", None)


def _in_launching_process() -> bool:
    """False in a rank or in the forkserver: both can run the main script's top level again (a notebook exported
    with nbconvert --to script calls warm_up() there), and a second server started from inside one breaks it."""
    if multiprocessing.process.parent_process() is not None:
        return False  # a process multiprocessing started: a rank
    if getattr(multiprocessing.process.current_process(), "_inheriting", False):
        return False  # a spawned rank re-importing the main script (spawn._main, before its bootstrap)
    forkserver = sys.modules.get("multiprocessing.forkserver")
    frame = sys._getframe()
    while frame is not None and forkserver is not None:  # the server runs its preloads inside its main()
        if frame.f_code is forkserver.main.__code__:
            return False
        frame = frame.f_back
    return True


def warm_up() -> None:
    """Start the forkserver now (it imports torch in the background), so the first launch is fast too.

    An explicit call, for a notebook's set-up cell, best before anything imports torch: the server's imports
    then run beside the notebook's own. That saves time on the first run (docs/benchmarks.md, "Start-up") only
    when a core is free for them: with every core busy the gain disappears (and the set-up cell takes longer,
    its imports sharing the cores with the server's). The server keeps the package as it was imported: after changing ddp_helpers itself,
    restart the kernel (as after any change to an imported module). A torch other than the one the notebooks
    were recorded with is named in one line (common/recorded.py).
    """
    if not _in_launching_process():
        return
    from ..common.recorded import torch_differs_note

    note = torch_differs_note()  # from torch's metadata: torch itself is not imported here
    if note:
        print(note, flush=True)
    if resolve_start_method("auto") != "forkserver":
        return
    prepare_forkserver()
    import multiprocessing.forkserver  # here: _in_launching_process reads its presence in sys.modules

    starting = multiprocessing.forkserver._forkserver._forkserver_pid is None  # not yet started in this process
    multiprocessing.forkserver.ensure_running()
    if starting:
        _say_in_a_notebook(WARM_UP_NOTICE)


def _say_in_a_notebook(text: str) -> None:
    """In a Jupyter kernel, print text under the running cell (it stays, as a stored notebook keeps it); else nothing."""
    ipython = sys.modules.get("IPython")  # loaded with the kernel: nothing is imported for a script or a rank
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or not hasattr(shell, "kernel"):  # a script, a terminal IPython, pytest: quiet
        return
    print(text, flush=True)
