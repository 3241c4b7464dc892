"""Small file helpers: writing a file atomically, and checking a folder or a file before a run needs it."""
from __future__ import annotations

import errno
import glob
import os
import shutil
import stat
from typing import Callable, Optional

from .errors import ConfigError, setting
from .trusted import OutputFolder, UntrustedFolder, fix_for, path_problem


def atomic_write(path: str, write: Callable[[str], None]) -> str:
    """Call write(tmp_path), then rename the file to path: readers see the old file or the complete new one.

    The folder is opened through a path judged component by component (common/trusted.py: no folder on the way
    another user owns or can write without the sticky bit). The temporary file is made in it with an
    unpredictable name, O_CREAT|O_EXCL and, where the platform has it, O_NOFOLLOW: a symlink planted at a
    guessable name is never written through. The rename, relative to the folder's descriptor, replaces whatever
    is at path, a symlink included, rather than writing through it.
    """
    folder, base = os.path.split(os.path.abspath(path))
    try:
        with OutputFolder(folder, f"the folder of {path}", create=False) as out:
            out.write_by_path(base, write)  # atomic on POSIX and Windows (same folder, same filesystem)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"no space left on the device to write {path} "
                                        f"({free_text(path)}); free some space or write to another folder") from e
        raise
    return path


def private_dir_problem(path: str) -> str:
    """What makes `path` unfit to hold this user's private files ('' when it is fit): judged by lstat, it must
    be a real folder (not a symlink), owned by this user, with mode 0700, in folders no other user can change
    (common/trusted.py). Windows: only that it is a folder."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"it can't be examined ({e.strerror or e})"
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link, not a folder"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a folder"
    if not hasattr(os, "getuid"):
        return ""
    if st.st_uid != os.getuid():
        return f"it is owned by another user (uid {st.st_uid}), not by this user (uid {os.getuid()})"
    if stat.S_IMODE(st.st_mode) != 0o700:
        return f"its mode is {stat.S_IMODE(st.st_mode):04o}, not 0700 (only this user may enter it)"
    parent = path_problem(os.path.dirname(os.path.abspath(path)))  # or another user could swap it for theirs
    return f"a folder on its way can be changed by another user: {parent}" if parent else ""


def make_private_dir(path: str, what: str, fix: str) -> str:
    """Create folder `path` with mode 0700, or accept an existing one only if private_dir_problem finds nothing;
    raises PermissionError naming `what`, the path, what is wrong and `fix`. Nothing in a refused folder is read."""
    parent = path_problem(os.path.dirname(os.path.abspath(path)))
    if parent:  # judged first: nothing is made in a folder another user can change
        raise UntrustedFolder(parent, f"{what} {path}")
    try:
        os.mkdir(path, 0o700)
        os.chmod(path, 0o700)  # whatever the umask
    except FileExistsError:
        pass
    problem = private_dir_problem(path)
    if problem:
        raise PermissionError(f"{what} {path} is refused: {problem}; nothing in it was read or written. "
                              f"Another user may have made it first. {fix}")
    return path


def free_text(path: str) -> str:
    """'N bytes free' on the file system holding path (or its folder), or 'unknown'."""
    try:
        folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        return f"{shutil.disk_usage(folder).free:,} bytes free"
    except OSError:
        return "free space unknown"


def probe_output_dir(setting: str, path: str) -> str:
    """Create folder `path` (if needed) and write a probe file in it, so a bad output folder is refused before
    training rather than after; returns the folder. Raises ValueError naming `setting`. Every folder on the way
    is judged (common/trusted.py): one another user could change is refused, naming it and its owner."""
    folder = os.path.expanduser(os.fspath(path))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"{setting} {path!r} is an existing file, not a folder; choose a folder")
    try:
        with OutputFolder(folder, f"{setting} {path!r}") as out:
            out.write(".probe", lambda fh: None)
            out.remove_file(".probe")
    except UntrustedFolder as e:
        raise ValueError(str(e)) from None
    except OSError as e:
        raise ValueError(f"{setting} {path!r} can't be written ({e.strerror or e}); choose a folder this user "
                         "can write") from None
    return folder


def nearest_existing(path: str) -> str:
    """path itself if it exists, else its nearest existing parent folder."""
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe.rstrip(os.sep)) or "."
        if parent == probe:
            break
        probe = parent
    return probe


def check_writable_dir(name: str, path: str, owner: str = "TrainConfig") -> None:
    """Refuse a folder path whose nearest existing folder this user can't write, or with a folder on its way that
    another user owns or could change under us (ConfigError naming the setting `owner.name`, e.g.
    TrainConfig.checkpoint_dir): each component from the root is judged, not only the last (common/trusted.py)."""
    path = os.path.expanduser(path)
    head = f"{setting(name, path, owner=owner)} is not accepted"
    probe = nearest_existing(path)
    if os.path.exists(probe) and not os.path.isdir(probe):  # a file in the way: "not writable" would mislead
        raise ConfigError(f"{head}: a directory this user can write ({probe!r} is a "
                          "file, not a folder); choose another path")
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{head}: a directory this user can write ({probe!r} is not "
                          "writable); choose another path")
    problem = path_problem(path)
    if problem:
        raise ConfigError(f"{head}: a directory of this user's own ({problem}: another user could plant links "
                          f"where the run writes); {fix_for(problem)}")


def check_readable_file(name: str, value: str, what: str, pattern: Optional[str] = None, fix: str = "",
                        kind: str = "file", empty: str = "", owner: str = "TrainConfig") -> None:
    """Refuse a path that is not a file this user can read (ConfigError naming the setting `owner.name` and `value`).

    what: the file expected ("an existing checkpoint file (ckpt-*.pt written by a run)"), kind: its short name
    ("checkpoint file"); pattern: for a folder given instead, the files in it to suggest (the last in name order);
    fix: a last way out, e.g. ", or set ..."; empty: what to give instead when the folder holds none.
    Standard library only: the command line checks it before torch loads.
    """
    path = os.path.expanduser(str(value))
    head = f"{setting(name, value, owner=owner)} is not accepted"
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(glob.escape(path), pattern))) if pattern else []
        pick = f"give one of its {pattern} files, e.g. the latest {found[-1]!r}" if found else \
            f"it holds no {pattern or 'such file'}: give {empty or what}"
        raise ConfigError(f"{head}: it is a directory, not a {kind}; {pick}")
    try:
        os.stat(path)
        why = None if os.path.isfile(path) else "is not a regular file"
    except FileNotFoundError:
        why = "doesn't exist"
    except OSError as e:  # e.g. a folder on the way this user can't enter: not "missing"
        why = f"can't be reached ({e.strerror or e})"
    if why:
        raise ConfigError(f"{head}: {what}; {path!r} {why}")
    try:
        with open(path, "rb"):  # opened here, not by the reader: an unreadable file is named as one
            pass
    except OSError as e:
        raise ConfigError(f"{head}: this user can't read the file ({e.strerror or e}); make it readable for this "
                          f"user (chmod a+r {path}), run as its owner{fix}") from None
