"""Small shared helpers: ceiling division, writing a file atomically, and checking an output folder early."""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
from typing import Callable


def ceil_div(a: int, b: int) -> int:
    """a / b rounded up, for counts (batches in a shard, steps in an epoch)."""
    return -(-a // b)


def atomic_write(path: str, write: Callable[[str], None]) -> str:
    """Call write(tmp_path), then rename the file to path: readers see the old file or the complete new one."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)  # atomic on POSIX and Windows (same folder, same filesystem)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)  # a failed write (a full disk, an interrupt) leaves no half-written file behind
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"no space left on the device to write {path} "
                                        f"({_free(path)} free); free some space or write to another folder") from e
        raise
    return path


def _free(path: str) -> str:
    try:
        return f"{shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free:,} bytes"
    except OSError:
        return "unknown"


def probe_output_dir(setting: str, path: str) -> str:
    """Create folder `path` (if needed) and write a probe file in it, so a bad output folder is refused before
    training rather than after; returns the folder. Raises ValueError naming `setting`."""
    folder = os.path.expanduser(os.fspath(path))
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"{setting} {path!r} is an existing file, not a folder; choose a folder")
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as e:
        raise ValueError(f"{setting} {path!r} can't be written ({e.strerror or e}); choose a folder this user "
                         "can write") from None
    return folder
