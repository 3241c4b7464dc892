"""The run folder: where every rank, however it was started, leaves its outcome and its per-step rows.

launch()'s ranks and torchrun's ranks report the same way. Each rank writes:
- `report<r>.pkl`: its value or its error, renamed into place (a reader sees none of it or all of it);
- `rank<r>.rows`: its per-step rows, in a file mapped into memory (ranks/rowsfile.py). A row is in the file
  the moment the rank writes it, so a rank that is killed (by a signal, the OOM killer, torchrun's agent)
  loses nothing it had written, and another process on the machine can read it at any time;
- `rank<r>.log` (launched ranks): its stdout and stderr.
Whoever reads the run (the launching process, or a torchrun rank assembling a result) opens those files.
Standard library only: the launcher imports it before torch.
"""
from __future__ import annotations

import os
import pickle
from typing import Any, Dict

from ..common.files import atomic_write

def report_path(run_dir: str, rank: int) -> str:
    """Where rank `rank` leaves its outcome."""
    return os.path.join(run_dir, f"report{rank}.pkl")


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


def read_reports(run_dir: str, world_size: int) -> Dict[int, Any]:
    """Every outcome left so far, by rank."""
    found = {}
    for rank in range(world_size):
        try:
            with open(report_path(run_dir, rank), "rb") as fh:
                found[rank] = pickle.load(fh)
        except FileNotFoundError:
            continue
    return found


def log_tail(run_dir: str, rank: int, n: int = 2000) -> str:
    """The last n characters of a launched rank's log, read from the file's end (a log can be large)."""
    from .ranklog import read_tail

    return read_tail(log_path(run_dir, rank), n)
