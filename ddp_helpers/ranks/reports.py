"""What each rank reports, its value or its error, left in the run folder (ranks/folders.py) renamed into place
and read back (a pickle only from a folder that is this user's alone; JSON data for torchrun's ranks), and which
rank a failure is blamed on. Standard library only at the top: the launcher imports it before torch."""
from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import stat
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from ..common.errors import ranks_text
from ..common.files import atomic_write, private_dir_problem
from .folders import log_path, report_path

_TORCH_COMM_DIRS = (os.sep + os.path.join("torch", "distributed") + os.sep,
                    os.sep + os.path.join("torch", "nn", "parallel") + os.sep)
_AUTOGRAD_DIR = os.sep + os.path.join("torch", "autograd") + os.sep
# The C++ sources of torch's collectives, as the location in front of their errors names them
# ("[.../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer", ".../c10d/ProcessGroupNCCL.cpp").
_CPP_COMM_SOURCES = re.compile(r"(third_party/gloo/|/gloo/transport/|/c10d/|ProcessGroup\w*\.cpp)")


# --- the run folder's report files, written renamed into place, read only when they can be trusted ---


def write_report(run_dir: str, rank: int, report: Any) -> None:
    """Leave `report` (any picklable object) as this rank's outcome, renamed into place."""
    data = pickle.dumps(report)
    atomic_write(report_path(run_dir, rank), lambda tmp: Path(tmp).write_bytes(data))


def write_report_data(run_dir: str, rank: int, data: Dict[str, Any]) -> None:
    """Leave `data` (JSON: strings, numbers, booleans) as this rank's outcome, renamed into place."""
    text = json.dumps(data)
    atomic_write(report_path(run_dir, rank, as_json=True), lambda tmp: Path(tmp).write_text(text))


def read_reports(run_dir: str, world_size: int) -> Dict[int, Any]:
    """Every pickled outcome left so far, by rank; only from a folder that is this user's alone.

    Unpickling runs code: a report is read only where no other user can have written one (private_dir_problem:
    a real folder, owned by this user, mode 0700; launch()'s folders are made so by mkdtemp), and only a regular
    file owned by this user (opened without following a link). Anything else is refused, unread. A file that
    can't be unpickled is returned as Unreadable, never raised (read_rank_reports names it).
    """
    problem = private_dir_problem(run_dir)
    if problem:
        raise PermissionError(f"the run folder {run_dir} is refused: {problem}; no report in it was read. Use a "
                              "folder made by ddp_helpers.ranks.folders.new_run_dir()")
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
    """A report file that is there but can't be read (read_rank_reports names it, with its rank)."""

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
    from .output_log import read_tail

    return read_tail(log_path(run_dir, rank), n)


# --- a rank's report, and the rank a failure is blamed on ---


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
    by where it was raised, not by its words: torch.distributed's own error types, an innermost frame in
    torch.distributed or torch.nn.parallel (gloo raises plain RuntimeErrors), or, for an error the autograd engine
    re-raised, a C++ source of the collectives in front of its message (DDP's reducer waits inside backward).

    Any other error out of the autograd engine is the learner's: a hook that returns a value ("Tensor post
    accumulate grad hooks should return None."), an error raised in a hook, a shape that backward refuses."""
    import torch.distributed as dist

    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    innermost = tb.tb_frame.f_code.co_filename
    if any(d in innermost for d in _TORCH_COMM_DIRS):
        return True
    return _AUTOGRAD_DIR in innermost and bool(_CPP_COMM_SOURCES.search(str(e).replace(os.sep, "/")))


@dataclass
class Report:
    """One rank's last word: its value (pickled), or its error."""

    ok: bool
    value: Optional[bytes] = None  # pickle of the returned value
    error: Optional[bytes] = None  # pickle of the exception, None if it can't be pickled
    traceback_text: str = ""
    text: str = ""  # "Type: message"
    in_collective: bool = False


_FIELD_TYPES = {"ok": (bool,), "value": (bytes, type(None)), "error": (bytes, type(None)), "traceback_text": (str,),
                "text": (str,), "in_collective": (bool,)}


def read_rank_reports(run_dir: str, world_size: int) -> Dict[int, Report]:
    """Every rank's report left so far (read_reports); a file that can't be read, or that holds anything
    but a rank's Report, becomes a failed report naming it, so the rank is blamed by name and nothing is raised raw."""
    found = {}
    for rank, rep in read_reports(run_dir, world_size).items():
        if isinstance(rep, Unreadable):
            found[rank] = Report(False, text=rep.said())
        elif not isinstance(rep, Report) or any(not isinstance(getattr(rep, k, None), t) for k, t in
                                                _FIELD_TYPES.items()):
            what = "a Report with fields of other types" if isinstance(rep, Report) else f"a {type(rep).__name__}"
            why = f"it holds {what}, not a rank's report"
            found[rank] = Report(False, text=Unreadable(os.path.join(run_dir, f"report{rank}.pkl"), why).said())
        else:
            found[rank] = rep
    return found


def first_unreported(reports: Dict[int, Report], world_size: int) -> Optional[int]:
    """The first rank whose report holds no value (none, or an error), or None when every rank returned one."""
    for rank in range(world_size):
        if rank not in reports or not reports[rank].ok:
            return rank
    return None


def returned_values(reports: Dict[int, Report], world_size: int) -> List[Any]:
    """Each rank's returned value, unpickled; RankFailedError naming the rank whose value can't be."""
    values = []
    for r in range(world_size):
        try:
            values.append(pickle.loads(reports[r].value))  # type: ignore[arg-type]
        except Exception as e:  # noqa: BLE001 - a value whose class can't be found here, a cut file...
            raise RankFailedError(r, f"its returned value can't be unpickled in the launching process "
                                     f"({error_text(e)}): return plain data instead: numbers, strings, lists, "
                                     "dicts, tensors or arrays") from None
    return values


def report_data(rep: Report) -> Dict[str, Any]:
    """A report as data (JSON), for a folder other processes find by name: its text, never a pickle."""
    return {"ok": bool(rep.ok), "text": str(rep.text), "traceback_text": str(rep.traceback_text),
            "in_collective": bool(rep.in_collective)}


def report_from_data(data: Dict[str, Any]) -> Report:
    """The report report_data wrote (fields of another type are read as empty)."""
    def text(key: str) -> str:
        return data.get(key) if isinstance(data.get(key), str) else ""
    return Report(data.get("ok") is True, traceback_text=text("traceback_text"), text=text("text"),
                  in_collective=data.get("in_collective") is True)


def value_report(value: Any) -> Report:
    """The report of a rank that returned. By value where pickle can't name a class (a dataclass or namedtuple
    defined in a notebook cell, as the function itself travelled): cloudpickle. Raises TypeError, saying so, for
    a value that can't be sent at all."""
    import cloudpickle

    try:
        return Report(True, value=cloudpickle.dumps(value))
    except Exception as e:  # noqa: BLE001 - pickling fails with TypeError, PicklingError, AttributeError...
        raise TypeError(f"the function returned a {type(value).__name__} that can't be sent back to the launching "
                        f"process ({error_text(e)}); return plain data instead: numbers, strings, lists, "
                        "dicts, tensors or arrays") from None


def error_text(e: BaseException) -> str:
    """'Type: message' for an error, whatever its own code does: an exception whose __str__ raises (or returns
    no string) is said by its type and whatever of it can be rendered (its arguments, one by one)."""
    name = type(e).__name__
    try:
        return f"{name}: {str(e)}"
    except Exception as failure:  # noqa: BLE001 - the error's own __str__ may raise anything
        why = f"its str() raised {type(failure).__name__}"
    shown = []
    for arg in getattr(e, "args", ()) if isinstance(getattr(e, "args", ()), tuple) else ():
        try:
            shown.append(repr(arg))
        except Exception:  # noqa: BLE001 - an argument's __repr__ may raise too
            shown.append(f"<a {type(arg).__name__} that can't be shown>")
    return f"{name}: {', '.join(shown) or '<no message that can be shown>'} ({why})"


def error_report(e: BaseException) -> Report:
    """The report of a rank that raised (inside an except block); never raises itself: an error that can't be
    pickled is sent as text, and one whose text can't be rendered by its type (error_text)."""
    import cloudpickle

    try:
        payload = cloudpickle.dumps(e)
        pickle.loads(payload)
    except Exception:  # noqa: BLE001 - unpicklable exceptions are sent as text only
        payload = None
    try:
        tb = traceback.format_exc()
    except Exception as failure:  # noqa: BLE001 - formatting calls the error's own code
        tb = f"(its traceback can't be shown: {type(failure).__name__})"
    try:
        in_collective = raised_in_collective(e)
    except Exception:  # noqa: BLE001 - torch.distributed that can't be imported: not a collective's
        in_collective = False
    return Report(False, error=payload, traceback_text=tb, text=error_text(e), in_collective=in_collective)


def diagnose(reports: Dict[int, Report], run_dir: str, world_size: int, first: Optional[int] = None,
             codes: Optional[Sequence[Optional[int]]] = None, server_died: bool = False) -> RankFailedError:
    """The rank to blame, in this order: one killed by a signal of its own, one that exited without reporting,
    the lowest that raised outside a collective, one the others waited for in vain, the lowest that raised.

    codes: each rank's exit code (None while running), when the caller started the ranks (launch); a torchrun
    rank knows only what the run folder holds (codes=None), and blames by the reports alone. first: the rank
    whose exit was seen first.
    """
    errors = {r: rep for r, rep in reports.items() if not rep.ok}
    others = [f"rank {r}: {rep.text}" for r, rep in sorted(errors.items())]
    known = list(codes) if codes is not None else [None] * world_size
    killed = _killed(first, known, errors)
    if killed is not None:
        return RankFailedError(killed, f"process was killed by signal {_signal_name(known[killed])} "
                                       f"(exit code {known[killed]})", log_tail=log_tail(run_dir, killed),
                               others=others)
    exited = [r for r, c in enumerate(known) if c is not None and c >= 0 and r not in reports]
    if exited:
        return _exited_silently(exited[0], known[exited[0]], run_dir, server_died, others)
    if not errors:
        r = first if first is not None else 0
        return RankFailedError(r, f"process exited with code {known[r]} without reporting",
                               log_tail=log_tail(run_dir, r), others=others)
    own = sorted(r for r, rep in errors.items() if not rep.in_collective)
    silent = [r for r in range(world_size) if r not in reports]
    if not own and silent:
        return RankFailedError(silent[0], _unresponsive(silent, launched=codes is not None),
                               log_tail=log_tail(run_dir, silent[0]), others=others)
    r = own[0] if own else min(errors)  # the lowest rank, not the first in time: the same answer on every run
    return _raised(r, errors[r], others)


def _unresponsive(silent: List[int], launched: bool) -> str:
    """Why the ranks with no report are blamed: the lowest is named, and under launch() every other one with it."""
    if not launched:  # a torchrun rank reads its node's folder only: a rank silent there may have reported elsewhere
        return ("reported nothing while the others failed in a collective with it: it was killed, or it hung or "
                "skipped a collective")
    also = ranks_text(silent[1:]) if len(silent) > 1 else ""
    it, was = ("them", "they were") if also else ("it", "it was")
    return (f"stopped responding{', as did ' + also if also else ''}: the other ranks timed out waiting for {it} "
            f"in a collective (a hang, a deadlock, or a rank that skipped a collective); {was} then terminated "
            "(see notebook 13, #7-timed-out-waiting-for-recv-operation-the-nccl-watchdog-timeout)")


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


def _exited_silently(rank: int, code: int, run_dir: str, server_died: bool, others: List[str]) -> RankFailedError:
    if server_died:
        return RankFailedError(rank, "the forkserver that starts the ranks died during the run, and its ranks with "
                                     "it (killed from outside?); the next launch starts a new one", others=others)
    if not os.path.exists(log_path(run_dir, rank)):
        # The log is the first thing a rank opens: this one died while Python was still starting it.
        return RankFailedError(rank, f"process exited with code {code} before it reached the training function. "
                                     "With start_method 'spawn' or 'forkserver' each rank first re-imports the main "
                                     "script; a script that starts training at import time, or fails to import, ends "
                                     "the rank there (its error is printed above). Put the launch under "
                                     "`if __name__ == \"__main__\":` (see notebook 13, #24-an-attempt-has-been-made-"
                                     "to-start-a-new-process-before-the-bootstrapping-phase)",
                               others=others)
    full = _full_temp_dir(run_dir)
    if full:
        return RankFailedError(rank, f"exited with code {code} without a report: {full}", others=others,
                               log_tail=log_tail(run_dir, rank))
    return RankFailedError(rank, f"exited with code {code} without returning a result (os._exit() or a crash "
                                 "in native code ends a process before it can report; see notebook 13, "
                                 "#23-process-1-terminated-with-exit-code-1)",
                           log_tail=log_tail(run_dir, rank), others=others)


def _full_temp_dir(run_dir: str) -> str:
    """Why a rank could not leave its report, if the run folder's file system is full; else ''."""
    try:
        free = shutil.disk_usage(run_dir).free
    except OSError:
        return ""
    if free >= 2**20:
        return ""
    return (f"the temp folder holding the run ({os.path.dirname(run_dir)}) is full ({free:,} bytes free), so the "
            "rank could not write its report; free space there, or point TMPDIR at a folder with room")


def _killed(first: Optional[int], codes: Sequence[Optional[int]], errors: dict) -> Optional[int]:
    """The rank a signal ended before anyone stopped it, or None.

    torch's join names the first rank it saw exit; the others it then ended with SIGTERM. A rank ended by
    another signal (SIGKILL from the OOM killer, a segfault) died on its own, even if join saw a peer first.
    """
    if first is not None and first not in errors and codes[first] is not None and codes[first] < 0:
        return first
    if any(not rep.in_collective for rep in errors.values()):
        return None  # a rank raised an error of its own: the others' signals are the launcher ending them
    # (SIGTERM first; a rank that ignores it gets SIGKILL after the grace period)
    own = [r for r, c in enumerate(codes) if c is not None and c < 0 and c != -signal.SIGTERM and r not in errors]
    return own[0] if own else None


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return str(-code)
