"""The run folder: where every rank, however it was started, leaves its outcome and its per-step rows.

launch()'s ranks and torchrun's ranks report the same way. Each rank writes:
- its report, renamed into place (a reader sees none of it or all of it): `report<r>.pkl` for launch()'s ranks
  (its value, any object, by cloudpickle), read only from a folder that is this user's alone (mkdtemp, owned,
  0700), so no other user can have put code there; `report<r>.json` for torchrun's ranks (data, never code:
  their folder is shared by independent processes and found by name);
- `rank<r>.rows`: its per-step rows, in a file mapped into memory (ranks/rowsfile.py). A row is in the file
  the moment the rank writes it, so a rank that is killed (by a signal, the OOM killer, torchrun's agent)
  loses nothing it had written, and another process on the machine can read it at any time;
- `rank<r>.log` (launched ranks): its stdout and stderr.
Whoever reads the run (the launching process, or a torchrun rank assembling a result) opens those files.
Standard library only: the launcher imports it before torch.
"""
from __future__ import annotations

import json
import os
import pickle
import stat
from dataclasses import dataclass
from typing import Any, Dict

from ..common.files import atomic_write, private_dir_problem


def report_path(run_dir: str, rank: int, as_json: bool = False) -> str:
    """Where rank `rank` leaves its outcome (as_json: a torchrun rank's, data only)."""
    return os.path.join(run_dir, f"report{rank}.{'json' if as_json else 'pkl'}")


def rows_path(run_dir: str, rank: int) -> str:
    """Where rank `rank` keeps its per-step rows."""
    return os.path.join(run_dir, f"rank{rank}.rows")


def log_path(run_dir: str, rank: int) -> str:
    """Where a launched rank's stdout and stderr go."""
    return os.path.join(run_dir, f"rank{rank}.log")


def write_report(run_dir: str, rank: int, report: Any) -> None:
    """Leave `report` (any picklable object) as this rank's outcome, renamed into place."""
    def write(tmp: str) -> None:
        with open(tmp, "wb") as fh:
            pickle.dump(report, fh)
    atomic_write(report_path(run_dir, rank), write)


def write_report_data(run_dir: str, rank: int, data: Dict[str, Any]) -> None:
    """Leave `data` (JSON: strings, numbers, booleans) as this rank's outcome, renamed into place."""
    text = json.dumps(data)

    def write(tmp: str) -> None:
        with open(tmp, "w") as fh:
            fh.write(text)
    atomic_write(report_path(run_dir, rank, as_json=True), write)


def read_reports(run_dir: str, world_size: int) -> Dict[int, Any]:
    """Every pickled outcome left so far, by rank; only from a folder that is this user's alone.

    Unpickling runs code: a report is read only where no other user can have written one (private_dir_problem:
    a real folder, owned by this user, mode 0700; launch()'s folders are made so by mkdtemp), and only a regular
    file owned by this user (opened without following a link). Anything else is refused, unread. A file that
    can't be unpickled is returned as Unreadable, never raised (report.read_rank_reports names it).
    """
    problem = private_dir_problem(run_dir)
    if problem:
        raise PermissionError(f"the run folder {run_dir} is refused: {problem}; no report in it was read. Use a "
                              "folder made by ddp_helpers.ranks.cleanup.new_run_dir()")
    found: Dict[int, Any] = {}
    for rank in range(world_size):
        data = _read_own(report_path(run_dir, rank), "rb")
        if data is not None:
            try:
                found[rank] = pickle.loads(data)
            except Exception as e:  # noqa: BLE001 - a cut or forged pickle fails with any error at all
                found[rank] = Unreadable(report_path(run_dir, rank), f"{type(e).__name__} while unpickling it")
    return found


@dataclass
class Unreadable:
    """A report file that is there but can't be read (ranks/report.py names it, with its rank)."""

    path: str
    why: str

    def said(self) -> str:
        """The words for it."""
        return (f"its report file {self.path} can't be read ({self.why}): it is corrupt or cut short, or was "
                "not written by a rank of this package")


def read_report_data(run_dir: str, world_size: int) -> Dict[int, Dict[str, Any]]:
    """Every JSON outcome left so far, by rank (data, never code); a file that isn't a JSON object is read as a
    failed report that names it."""
    found = {}
    for rank in range(world_size):
        data = _read_own(report_path(run_dir, rank, as_json=True), "r")
        if data is None:
            continue
        try:
            value = json.loads(data)
        except ValueError as e:
            value = e
        if not isinstance(value, dict):  # data, never code; a file that isn't a JSON object is named as such
            why = "not JSON" if isinstance(value, ValueError) else f"JSON {type(value).__name__}, not an object"
            value = {"ok": False, "text": Unreadable(report_path(run_dir, rank, as_json=True), why).said()}
        found[rank] = value
    return found


def _read_own(path: str, mode: str) -> Any:
    """A file's contents if it is a regular file owned by this user, opened without following a link; None if
    it is missing. Another user's file, or a link, raises PermissionError."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return None
    except OSError as e:
        raise PermissionError(f"{path} is refused ({e.strerror or e}: a link, or not this user's file)") from None
    with os.fdopen(fd, mode) as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
            raise PermissionError(f"{path} is refused: not a regular file of this user's (uid {st.st_uid})")
        return fh.read()


def log_tail(run_dir: str, rank: int, n: int = 2000) -> str:
    """The last n characters of a launched rank's log, read from the file's end (a log can be large)."""
    from .ranklog import read_tail

    return read_tail(log_path(run_dir, rank), n)
