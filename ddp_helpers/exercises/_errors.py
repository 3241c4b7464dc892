"""An error raised in a rank, as data the parent can judge: its type and line, and what it means.

Three kinds of error end a learner's function, and each needs its own hint:

* a **refused call**: a torch.distributed function the learner called refused its arguments (a TypeError or
  ValueError raised before anything was sent, e.g. `init_process_group(..., timeout=30)`); every rank that makes
  the same call gets the same error, and no peer is missing. The hint names the call, the argument and the fix.
* a **lost peer**: any other error out of torch's collectives or DDP's reducer (`raised_in_collective`): a
  rank waited in a collective its peers never joined, or a peer died; the hint is about the collectives the ranks
  call, not this rank's error.
* an error of the learner's own code: its type, line and message.
"""
from __future__ import annotations

import os
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..ranks.launcher import raised_in_collective

# The errors torch.distributed raises about the arguments of a call (its _check_* helpers, init_process_group's
# checks), before it sends anything. A lost peer shows as a RuntimeError (gloo), a DistError or a timeout.
ARGUMENT_ERRORS = (TypeError, ValueError)
# Frames between the learner's call and the torch function it called: the checks' own watchers, torch's
# c10d_logger decorators (`wrapper`) and functools' wrappers.
_PASS_THROUGH_DIRS = (os.sep + "exercises" + os.sep,)
_PASS_THROUGH_FILES = ("c10d_logger.py", "functools.py")


def code_of(fn: Any) -> Any:
    """The code object of the learner's function, or of the first method of the learner's class (None if none)."""
    code = getattr(fn, "__code__", None)
    if code is None and isinstance(fn, type):
        code = next((v.__code__ for v in vars(fn).values() if hasattr(v, "__code__")), None)
    return code


# Set on an error that came out of the wait() of a watched asynchronous collective (_watch): the C++ Work.wait()
# has no Python frame in torch.distributed, so where it was raised does not say it; the mark does.
IN_WAIT = "_ddp_helpers_raised_in_wait"


def raised_waiting(e: BaseException) -> bool:
    """True for an error out of an asynchronous collective's wait(): a Work the checks watch, or a Future."""
    if getattr(e, IN_WAIT, False):
        return True
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and (os.sep + os.path.join("torch", "futures") + os.sep) in tb.tb_frame.f_code.co_filename


def where(exc: BaseException, fn: Callable) -> Optional[Tuple[str, int]]:
    """(file, line number) of the deepest frame of the learner's function in exc's traceback, else None."""
    found = _learner_frames(exc, fn)
    return (found[-1][0].f_code.co_filename, found[-1][1]) if found else None


def _learner_frames(exc: BaseException, fn: Callable) -> List[Tuple[Any, int]]:
    code = code_of(fn)
    if code is None:
        return []
    return [(f, n) for f, n in traceback.walk_tb(exc.__traceback__) if f.f_code.co_filename == code.co_filename]


def _called(exc: BaseException, fn: Callable) -> Optional[Any]:
    """The frame of the function the learner's deepest frame called (past the checks' watchers and torch's
    logging wrappers), or None when the error was raised in the learner's own line."""
    frames = list(traceback.walk_tb(exc.__traceback__))
    mine = _learner_frames(exc, fn)
    if not mine:
        return None
    below = frames[[f for f, _ in frames].index(mine[-1][0], 0) + 1:]
    for frame, _ in below:
        path = frame.f_code.co_filename
        if any(d in path for d in _PASS_THROUGH_DIRS) or os.path.basename(path) in _PASS_THROUGH_FILES:
            continue
        return frame
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def refused_call(exc: BaseException, fn: Callable) -> Optional[Dict[str, Any]]:
    """For an argument error that a torch.distributed function raised about the learner's own call:
    {"call": its name, "argument": the parameter its message names (or None), "value", "value_type"}; else None."""
    if not isinstance(exc, ARGUMENT_ERRORS) or not raised_in_collective(exc):
        return None
    frame = _called(exc, fn)
    if frame is None:
        return None
    code = frame.f_code
    params = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    words = set(str(exc).replace("`", " ").replace(",", " ").split())
    named = next((p for p in params if p in words and p in frame.f_locals), None)
    out: Dict[str, Any] = {"call": code.co_name, "argument": named, "value": None, "value_type": None}
    if named is not None:
        value = frame.f_locals[named]
        out.update(value=_short(value), value_type=type(value).__name__)
    return out


def error_report(e: BaseException, fn: Callable) -> Dict[str, Any]:
    """An error raised in a rank as data: type, first line, where in fn, whether torch refused the learner's call
    ("refused") and whether it only says a peer was lost ("comm")."""
    text = str(e).strip()
    refused = refused_call(e, fn)
    return {"status": "error", "type": type(e).__name__, "message": text.splitlines()[0][:300] if text else "",
            "where": where(e, fn), "refused": refused,
            "comm": refused is None and (raised_in_collective(e) or raised_waiting(e))}


def _fix(refused: Dict[str, Any], message: str) -> str:
    """What to pass instead, as far as the error says."""
    if "timedelta" in message:
        return "pass a datetime.timedelta instead, e.g. datetime.timedelta(seconds=20)."
    if "torch.Tensor" in message:
        return "pass a tensor: the collectives send tensors and write their result into them, in place."
    return f"give it what the message asks for (help(dist.{refused['call']}) lists each argument)."


def refused_text(c: Dict[str, Any], on: str) -> str:
    """The hint for a call torch refused: the call, the argument, the fix (c: a rank's error report)."""
    refused = c["refused"]
    said = (f"dist.{refused['call']} refused your call{c['where']} on {on}, before any rank sent anything: "
            f"{c['type']}: {c['message']}")
    if refused["argument"] is None:
        return f"{said}. It is the call itself that is wrong, not a rank that went missing."
    kind = refused["value_type"]
    return (f"{said}. Your function passed {refused['argument']}={refused['value']} "
            f"({'an' if kind[0] in 'aeiou' else 'a'} {kind}): {_fix(refused, c['message'])}")
