"""Run folders: where every rank leaves its outcome, its rows and its log; making them, holding them, telling
a dead owner's from a live one's (one flock probe: lock_free), removing them and what a dead launch left
(`run_folder`: a launch's folder for its whole life, made, handed over and removed).

launch()'s ranks and torchrun's ranks report the same way. Each rank writes:
- its report, renamed into place (a reader sees none of it or all of it): `report<r>.pkl` for launch()'s ranks
  (its value, any object, by cloudpickle), read only from a folder that is this user's alone (mkdtemp, owned,
  0700), so no other user can have put code there; `report<r>.json` for torchrun's ranks (data, never code:
  their folder is shared by independent processes and found by name) (ranks/reports.py);
- `rank<r>.rows`: its per-step rows, in a file mapped into memory (ranks/rows.py). A row is in the file
  the moment the rank writes it, so a rank that is killed (by a signal, the OOM killer, torchrun's agent)
  loses nothing it had written, and another process on the machine can read it at any time;
- `rank<r>.log` (launched ranks): its stdout and stderr (ranks/output_log.py).

Ctrl-C can't split a folder's making or removal: a folder is whole (its owner file written, its lock held) and
handed to the caller, or gone, and no descriptor is left open (an interrupt between mkdtemp and hold() once left
a folder holding only its owner file, and the temp dir kept it after the kernel ended)."""
from __future__ import annotations

import contextlib
import glob
import multiprocessing.process
import os
import shutil
import stat
import tempfile
from typing import Callable, Dict, Iterator, List, Optional

from .ending import interrupts_deferred, stop_helpers

try:
    import fcntl
except ImportError:  # Windows: a folder's owner is named by its pid and start time instead
    fcntl = None  # type: ignore[assignment]

RUN_DIR_PREFIX = "ddp_helpers-ranks-"  # a launch's run folder in the temp dir (what is in it: above)
MP_DIR_PREFIX = "ddp_helpers-mp-"  # a launching process's multiprocessing folder (the forkserver's socket)
SHORT_ROOT = "/tmp"  # where a socket's folder goes when the temp dir's path is too long for AF_UNIX
LOCK = "owner.lock"  # held (flock, shared) by every process the folder belongs to, for as long as it runs
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # a planted link is never opened
_HELD: Dict[str, int] = {}  # folder -> the descriptor holding its lock in this process


def report_path(run_dir: str, rank: int, as_json: bool = False) -> str:
    """Where rank `rank` leaves its outcome (as_json: a torchrun rank's, data only)."""
    return os.path.join(run_dir, f"report{rank}.{'json' if as_json else 'pkl'}")


def rows_path(run_dir: str, rank: int) -> str:
    """Where rank `rank` keeps its per-step rows."""
    return os.path.join(run_dir, f"rank{rank}.rows")


def rows_paths(run_dir: str, world_size: int) -> List[str]:
    """Where each rank keeps its per-step rows, by rank."""
    return [rows_path(run_dir, rank) for rank in range(world_size)]


def log_path(run_dir: str, rank: int) -> str:
    """Where a launched rank's stdout and stderr go."""
    return os.path.join(run_dir, f"rank{rank}.log")


def log_paths(run_dir: str, world_size: int) -> List[str]:
    """Where each launched rank's stdout and stderr go, by rank."""
    return [log_path(run_dir, rank) for rank in range(world_size)]


@contextlib.contextmanager
def run_folder(given: Optional[str] = None) -> Iterator[str]:
    """A launch's run folder for the block: `given` (the caller's to remove) or a new one, removed after it."""
    made = None
    try:
        if given is None:
            made = new_run_dir()
        yield given if made is None else made
    finally:
        if made is not None:
            remove_run_dir(made)


def new_run_dir() -> str:
    """A private run folder for a launch's ranks, marked with its owner; then dead launches' folders removed."""
    # the temp dir judged as the folder is made, before anything there is read; handed over with the stale ones
    # gone (they leave this live one alone: its lock is held), or removed
    return owned_dir(RUN_DIR_PREFIX, then=remove_stale)


def check_temp_dir(where: Optional[str] = None) -> None:
    """Refuse (ConfigError naming TMPDIR, before any process starts) a temp dir with a folder on its way that
    another user owns or can write without the sticky bit: they could swap a launch's folder for one of theirs
    (common/trusted.py)."""
    from ..common.errors import ConfigError
    from ..common.trusted import fix_for, path_problem

    where = where or tempfile.gettempdir()
    problem = path_problem(where)
    if problem:
        raise ConfigError(f"TMPDIR={where!r} (the temp dir, where a launch's folders go) is not accepted: {problem}: "
                          "another user could swap a folder made there for one of theirs; nothing was made there. "
                          + fix_for(problem, "Set TMPDIR to a folder this user owns, in folders of this user's or "
                                             "root's only, before starting Python"))


def owned_dir(prefix: str, where: Optional[str] = None, then: Optional[Callable[[], None]] = None) -> str:
    """A new folder in the temp dir that is live while this process runs (remove_stale leaves it alone); then(),
    if given, runs once it is held, in the same Ctrl-C-deferred step (the folder is handed over, or removed).

    Its lock file is locked before it takes its name, so no other process ever sees it unlocked. A lock is the
    kernel's, not a pid: it holds across PID namespaces (containers sharing /tmp see other pids), and it is
    released when its process ends, however it ends. Where there is no flock (Windows), the owner file's pid
    and start time say the same within one namespace.
    """
    import psutil

    check_temp_dir(where)  # the one place it is judged: swapped, a run folder or a socket could be someone else's
    started = psutil.Process().create_time()
    folder = None
    try:
        with interrupts_deferred() as pending:  # Ctrl-C waits for the folder to be whole
            folder = tempfile.mkdtemp(prefix=prefix, dir=where)  # where: None = the temp dir
            with open(os.path.join(folder, "owner"), "w") as fh:
                fh.write(f"{os.getpid()} {started}")
            hold(folder)
            if then is not None:
                then()
        if pending:
            raise KeyboardInterrupt
        return folder
    except BaseException:
        if folder is not None:
            remove_run_dir(folder)
        raise


def hold(folder: str) -> None:
    """Take a shared hold on folder's lock (created if missing) for the rest of this process's life."""
    if fcntl is None or folder in _HELD:
        return
    tmp = os.path.join(folder, f".{LOCK}.{os.getpid()}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        os.link(tmp, os.path.join(folder, LOCK))  # the lock appears already held; an existing one is shared
    except FileExistsError:
        os.close(fd)
        fd = os.open(os.path.join(folder, LOCK), os.O_RDONLY | _NOFOLLOW)
        fcntl.flock(fd, fcntl.LOCK_SH)
    finally:
        os.remove(tmp)
    _HELD[folder] = fd


def release(folder: str) -> None:
    """Drop this process's hold on folder (before removing it)."""
    fd = _HELD.pop(folder, None)
    if fd is not None:
        os.close(fd)


@contextlib.contextmanager
def lock_free(lock: str) -> Iterator[Optional[bool]]:
    """Is the flock on the file `lock` free, its holders all gone (they hold it for as long as they run)? True,
    and held exclusively by this process for the block; False while a process holds it; None where it can't be
    told (no such file, or not this user's to open; no flock: Windows)."""
    if fcntl is None:
        yield None
        return
    try:
        fd = os.open(lock, os.O_RDONLY | _NOFOLLOW)
    except OSError:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            free = True
        except OSError:
            free = False
        yield free
    finally:
        os.close(fd)


def _owner_gone(folder: str) -> bool:
    """Without a lock: is the pid in the owner file gone, or reused by a process that started later?"""
    import psutil

    try:
        with open(os.path.join(folder, "owner")) as fh:
            pid, started = fh.read().split()
        return not (psutil.pid_exists(int(pid)) and abs(psutil.Process(int(pid)).create_time() - float(started)) < 1e-3)
    except (OSError, ValueError, psutil.Error):
        return False  # not ours (no owner file), or being written, or its owner just left: leave it


def _ours(folder: str) -> bool:
    """Is folder a real folder (lstat: not a link) owned by this user? Only such a folder is judged or removed."""
    try:
        st = os.lstat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and (not hasattr(os, "getuid") or st.st_uid == os.getuid())


def remove_stale() -> None:
    """Remove the folders of launches whose processes are gone (a kernel restart or SIGKILL skips their
    cleanup): the run folders, and the multiprocessing folder of each launching process (startmethod)."""
    places = [(tempfile.gettempdir(), RUN_DIR_PREFIX), (tempfile.gettempdir(), MP_DIR_PREFIX),
              (SHORT_ROOT, MP_DIR_PREFIX)]  # a long temp dir's socket folders go to SHORT_ROOT (startmethod)
    for root, prefix in dict.fromkeys(places):
        for folder in glob.glob(os.path.join(root, prefix + "*")):
            with interrupts_deferred() as pending:  # a folder half removed (its owner file gone) is never judged
                _remove_if_stale(folder)
            if pending:
                raise KeyboardInterrupt


def _remove_if_stale(folder: str) -> None:
    if not _ours(folder):
        return  # another user's, or a link: never read, never removed
    lock = os.path.join(folder, LOCK)
    if fcntl is not None and os.path.exists(lock):
        with lock_free(lock) as free:
            stale = free is True  # None: not ours to judge (another user's), or just removed
    else:
        stale = _owner_gone(folder)
    if stale:
        shutil.rmtree(folder, ignore_errors=True)


def remove_run_dir(folder: str) -> None:
    """Remove a run folder this process made (its hold released first). Ctrl-C meanwhile is dropped: this is a
    launch's last step, whether it ends or is already ending, and the folder goes whole."""
    with interrupts_deferred():
        release(folder)
        shutil.rmtree(folder, ignore_errors=True)


def remove_own_multiprocessing_dir() -> None:
    """Before this process dies of a signal (no atexit runs then; ending.before_dying, as startmethod gives it the
    folder): end its forkserver and resource tracker, and remove the multiprocessing folder, which would stay
    until the next launch."""
    folder = multiprocessing.process.current_process()._config.get("tempdir")
    if folder is None or not os.path.basename(folder).startswith(MP_DIR_PREFIX):
        return  # none, or multiprocessing's own pymp-* (its finalizer's business)
    stop_helpers()
    release(folder)
    shutil.rmtree(folder, ignore_errors=True)
