"""Small shared helpers: ceiling division and writing a file atomically."""
from __future__ import annotations

import os
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
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)  # a failed write (a full disk, an interrupt) leaves no half-written file behind
        raise
    return path
