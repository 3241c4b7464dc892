"""A rank's rows file: named tables in one file mapped into memory, written by one rank, read by any process.

The layout: 8 magic bytes, 8 bytes saying where the data start, a JSON table of contents (dtype, shape and
offset of each table), then the tables, each on a 64-byte boundary. A rank fills its tables in place; another
process maps the same file and sees each value as soon as it is written (the page cache is shared), also after
the writer was killed.
"""
from __future__ import annotations

import json
import mmap
import os
from typing import Any, Dict, Optional, Tuple

import numpy as np

from .ending import interrupts_deferred
from .folders import rows_paths

MAGIC = b"DDPROWS1"
_ALIGN = 64  # each table starts on a cache line
TableSpec = Tuple[Any, Tuple[int, ...], Any]  # dtype, shape, initial fill


def _layout(specs: Dict[str, TableSpec]) -> Tuple[bytes, int]:
    """The file's header (magic, where the data start, a JSON table of contents) and the file's size.

    Offsets in the table of contents count from the data start, so the header's length doesn't depend on them.
    """
    toc, offset = {}, 0
    for name, (dtype, shape, _) in specs.items():
        offset = -(-offset // _ALIGN) * _ALIGN
        toc[name] = {"dtype": np.dtype(dtype).str, "shape": [int(n) for n in shape], "offset": offset}
        offset += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    body = json.dumps(toc).encode()
    start = -(-(len(MAGIC) + 8 + len(body)) // _ALIGN) * _ALIGN
    return MAGIC + start.to_bytes(8, "little") + body, start + max(offset, 1)


def _parse(header: bytes) -> Dict[str, dict]:
    """The table of contents with absolute offsets, from a file's first bytes."""
    if header[:len(MAGIC)] != MAGIC:
        raise ValueError("not a rows file")
    start = int.from_bytes(header[len(MAGIC):len(MAGIC) + 8], "little")
    toc = json.loads(header[len(MAGIC) + 8:start].rstrip(b"\0"))
    for entry in toc.values():
        entry["offset"] += start
    return toc


def _views(mm: mmap.mmap, toc: Dict[str, dict]) -> Dict[str, np.ndarray]:
    return {name: np.frombuffer(mm, dtype=np.dtype(e["dtype"]), count=int(np.prod(e["shape"], dtype=np.int64)),
                                offset=e["offset"]).reshape(e["shape"]) for name, e in toc.items()}


def create_tables(path: str, specs: Dict[str, TableSpec]) -> Dict[str, np.ndarray]:
    """A new rows file at `path` holding the tables `specs` names, filled; returns writable views of them.

    The file is sized, filled and only then renamed to `path`, so a reader never sees it half made. The views
    stay valid for the life of the process (the mapping is never closed: a rank ends with its process).
    """
    header, size = _layout(specs)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w+b") as fh:
            fh.truncate(size)
            fh.write(header)
            fh.flush()
            mm = mmap.mmap(fh.fileno(), size)
        tables = _views(mm, _parse(header))
        for name, (_, _, fill) in specs.items():
            tables[name].fill(fill)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return tables


class RowsReader:
    """Read-only access to the rows files of a run; values are handed out as copies, never as views."""

    def __init__(self, run_dir: str, world_size: int):
        self.run_dir, self.world_size = run_dir, world_size
        self.paths = rows_paths(run_dir, world_size)
        self._maps: Dict[int, Tuple[mmap.mmap, Dict[str, dict]]] = {}
        self._given: Dict[int, Dict[str, np.ndarray]] = {}  # rows that came another way (over the group)

    def _open(self, rank: int) -> Optional[Tuple[mmap.mmap, Dict[str, dict]]]:
        if rank not in self._maps:
            with interrupts_deferred() as pending:  # a mapping (it holds an fd) is kept for close(), or closed
                opened = self._map(rank)
            if pending:
                raise KeyboardInterrupt
            if opened is None:
                return None
        return self._maps[rank]

    def _map(self, rank: int) -> Optional[Tuple[mmap.mmap, Dict[str, dict]]]:
        try:
            with open(self.paths[rank], "rb") as fh:
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (FileNotFoundError, ValueError):  # not made yet (ValueError: an empty file can't be mapped)
            return None
        try:
            start = int.from_bytes(mm[len(MAGIC):len(MAGIC) + 8], "little")
            self._maps[rank] = (mm, _parse(mm[:start]))
        except ValueError:
            mm.close()
            raise ValueError(f"{self.paths[rank]} is not a rows file") from None
        return self._maps[rank]

    def give(self, rank: int, tables: Dict[str, np.ndarray]) -> None:
        """Rows of a rank whose file this process can't see (sent over the process group)."""
        self._given[rank] = {k: np.array(v) for k, v in tables.items()}

    def has(self, rank: int) -> bool:
        """Are this rank's rows here (its file, or given)?"""
        return rank in self._given or self._open(rank) is not None

    def tables(self, rank: int) -> Optional[Dict[str, np.ndarray]]:
        """A copy of every table of one rank, or None if it has none yet."""
        if rank in self._given:
            return {k: v.copy() for k, v in self._given[rank].items()}
        opened = self._open(rank)
        if opened is None:
            return None
        with interrupts_deferred() as pending:  # no view outlives this (in a traceback): close() must unmap
            views = _views(*opened)
            copies = {k: v.copy() for k, v in views.items()}
            del views  # the mapping can be closed only once no array refers to it
        if pending:
            raise KeyboardInterrupt
        return copies

    def scalar(self, rank: int, table: str, index: int = 0) -> Optional[float]:
        """One element of one table (e.g. a step counter), read without copying the rest."""
        if rank in self._given:
            return self._given[rank][table].reshape(-1)[index].item()
        opened = self._open(rank)
        if opened is None:
            return None
        mm, toc = opened
        e = toc[table]
        dtype = np.dtype(e["dtype"])
        return np.frombuffer(mm, dtype=dtype, count=1, offset=e["offset"] + index * dtype.itemsize)[0].item()

    def close(self) -> None:
        """Unmap every file (on Windows a mapped file can't be removed)."""
        for mm, _ in self._maps.values():
            mm.close()
        self._maps.clear()
