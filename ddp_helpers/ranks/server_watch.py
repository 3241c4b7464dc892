"""Imported first by the forkserver: end the server if its launcher dies while the server is still preloading.

Once the preloads are done the server's own loop notices the launcher's exit (its alive pipe closes), but
importing torch takes seconds (far longer on a busy machine), and a launcher killed in that window would leave
the server, and the resource tracker it holds open, running on their own. Polling the parent's pid works on
every platform that has a forkserver. The last preload (_freeze_gc) stops the watch, so that the server forks
its ranks from a single thread.
"""
import os
import threading

_launcher = os.getppid()
_named = int(os.environ.get("DDP_HELPERS_LAUNCHER_PID", _launcher))  # set by the launcher just before our start


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists (another user's)
        pass
    return True


if _named != _launcher and not _alive(_named):
    os._exit(1)  # our launcher died before we got here (we are already re-parented)
# (A named pid that is alive but not our parent was inherited from an older launcher: watch our parent.)
_stop = threading.Event()


def _watch() -> None:
    while not _stop.wait(0.1):
        if os.getppid() != _launcher:  # re-parented: the launcher is gone
            os._exit(1)


_thread = threading.Thread(target=_watch, name="ddp_helpers-server-watch", daemon=True)
_thread.start()


def stop() -> None:
    """End the watch (the preloads are done; the server's loop watches the launcher from now on)."""
    _stop.set()
    _thread.join()
