"""What each rank reports back (a file in the launch's log folder), and which rank a failure is blamed on."""
from __future__ import annotations

import os
import pickle
import signal
import traceback
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from ..engine.fileio import atomic_write

_TORCH_COMM_DIRS = (os.sep + os.path.join("torch", "distributed") + os.sep,
                    os.sep + os.path.join("torch", "nn", "parallel") + os.sep,
                    os.sep + os.path.join("torch", "autograd") + os.sep)


class RankFailedError(RuntimeError):
    """A rank raised, exited or was killed; names the rank and keeps the original error and the partial result."""

    def __init__(self, rank: int, message: str, traceback_text: str = "", original: Optional[BaseException] = None,
                 log_tail: str = "", others: Sequence[str] = ()):
        text = f"rank {rank} failed: {message}"
        if traceback_text:
            text += f"\n--- traceback from rank {rank} ---\n{traceback_text.rstrip()}"
        if log_tail.strip():
            text += f"\n--- last output of rank {rank} ---\n{log_tail.rstrip()}"
        super().__init__(text)
        self.rank = rank
        self.message = message
        self.traceback_text = traceback_text
        self.original = original
        self.others = list(others)  # what the other ranks reported (usually "peer closed the connection")
        self.partial_result: Any = None  # run_training fills in the metrics collected before the failure


def raised_in_collective(e: BaseException) -> bool:
    """True when the error came out of torch's collectives or DDP's reducer (a rank that lost its peer), judged
    by where it was raised, not by its text: torch.distributed's own error types, or an innermost frame in
    torch.distributed, torch.nn.parallel or the autograd engine (gloo raises plain RuntimeErrors)."""
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return any(d in tb.tb_frame.f_code.co_filename for d in _TORCH_COMM_DIRS)


@dataclass
class Report:
    """One rank's last word: its value (pickled), or its error."""

    ok: bool
    value: Optional[bytes] = None  # pickle of the returned value
    error: Optional[bytes] = None  # pickle of the exception, None if it can't be pickled
    traceback_text: str = ""
    text: str = ""  # "Type: message"
    in_collective: bool = False


def write_report(log_dir: str, rank: int, report: Report) -> None:
    """Write the report; renamed into place, so the parent never reads half of one."""
    atomic_write(os.path.join(log_dir, f"report{rank}.pkl"), lambda tmp: _write_pickle(tmp, report))


def _write_pickle(path: str, obj: Any) -> None:
    with open(path, "wb") as fh:
        pickle.dump(obj, fh)


def value_report(value: Any) -> Report:
    """The report of a rank that returned."""
    return Report(True, value=pickle.dumps(value))


def error_report(e: BaseException) -> Report:
    """The report of a rank that raised (inside an except block)."""
    try:
        payload = pickle.dumps(e)
        pickle.loads(payload)
    except Exception:  # noqa: BLE001 - unpicklable exceptions are sent as text only
        payload = None
    return Report(False, error=payload, traceback_text=traceback.format_exc(),
                  text=f"{type(e).__name__}: {e}", in_collective=raised_in_collective(e))


def read_reports(log_dir: str, world_size: int) -> Dict[int, Report]:
    """Every report written so far."""
    found = {}
    for rank in range(world_size):
        try:
            with open(os.path.join(log_dir, f"report{rank}.pkl"), "rb") as fh:
                found[rank] = pickle.load(fh)
        except FileNotFoundError:
            continue
    return found


def log_tail(log_dir: str, rank: int, n: int = 2000) -> str:
    """The end of a rank's captured stdout and stderr."""
    try:
        with open(os.path.join(log_dir, f"rank{rank}.log"), errors="replace") as fh:
            return fh.read()[-n:]
    except OSError:
        return ""


def diagnose(first: int, codes: Sequence[Optional[int]], reports: Dict[int, Report], log_dir: str,
             server_died: bool = False) -> RankFailedError:
    """The rank to blame, in this order: one killed by a signal of its own, one that exited without reporting,
    the lowest that raised outside a collective, one the others waited for in vain, the lowest that raised."""
    errors = {r: rep for r, rep in reports.items() if not rep.ok}
    others = [f"rank {r}: {rep.text}" for r, rep in sorted(errors.items())]
    killed = _killed(first, codes, errors)
    if killed is not None:
        return RankFailedError(killed, f"process was killed by signal {_signal_name(codes[killed])} "
                                       f"(exit code {codes[killed]})", log_tail=log_tail(log_dir, killed),
                               others=others)
    exited = [r for r, c in enumerate(codes) if c is not None and c >= 0 and r not in reports]
    if exited:
        return _exited_silently(exited[0], codes[exited[0]], log_dir, server_died, others)
    if not errors:
        return RankFailedError(first, f"process exited with code {codes[first]} without reporting",
                               log_tail=log_tail(log_dir, first), others=others)
    own = sorted(r for r, rep in errors.items() if not rep.in_collective)
    silent = [r for r in range(len(codes)) if r not in reports]
    if not own and silent:
        r = silent[0]
        return RankFailedError(r, "stopped responding: the other ranks timed out waiting for it in a collective "
                                  "(a hang, a deadlock, or a rank that skipped a collective); it was then terminated",
                               log_tail=log_tail(log_dir, r), others=others)
    r = own[0] if own else min(errors)  # the lowest rank, not the first in time: the same answer on every run
    return _raised(r, errors[r], others)


def _raised(rank: int, rep: Report, others: List[str]) -> RankFailedError:
    original = None
    if rep.error is not None:
        try:
            original = pickle.loads(rep.error)
        except Exception:  # noqa: BLE001
            original = None
    err = RankFailedError(rank, rep.text, traceback_text=rep.traceback_text, original=original, others=others)
    if original is not None:
        err.__cause__ = original
    return err


def _exited_silently(rank: int, code: int, log_dir: str, server_died: bool, others: List[str]) -> RankFailedError:
    if server_died:
        return RankFailedError(rank, "the forkserver that starts the ranks died during the run, and its ranks with "
                                     "it (killed from outside?); the next launch starts a new one", others=others)
    if not os.path.exists(os.path.join(log_dir, f"rank{rank}.log")):
        # The log is the first thing a rank opens: this one died while Python was still starting it.
        return RankFailedError(rank, f"process exited with code {code} before it reached the training function. "
                                     "With start_method 'spawn' or 'forkserver' each rank first re-imports the main "
                                     "script; a script that starts training at import time, or fails to import, ends "
                                     "the rank there (its error is printed above). Put the launch under "
                                     "`if __name__ == \"__main__\":`", others=others)
    return RankFailedError(rank, f"exited with code {code} without returning a result (os._exit() or a crash "
                                 "in native code ends a process before it can report)",
                           log_tail=log_tail(log_dir, rank), others=others)


def _killed(first: int, codes: Sequence[Optional[int]], errors: dict) -> Optional[int]:
    """The rank a signal ended before anyone stopped it, or None.

    torch's join names the first rank it saw exit; the others it then ended with SIGTERM. A rank ended by
    another signal (SIGKILL from the OOM killer, a segfault) died on its own, even if join saw a peer first.
    """
    if first not in errors and codes[first] is not None and codes[first] < 0:
        return first
    own = [r for r, c in enumerate(codes) if c is not None and c < 0 and c != -signal.SIGTERM and r not in errors]
    return own[0] if own else None


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return str(-code)
