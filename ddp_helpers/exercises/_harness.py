"""What every exercise check shares: the result and its verdicts, the learner's call inside a rank, the launch.

A check runs the learner's function on real ranks. Inside a rank nothing is printed (the launcher sends the
output to a log file), so each rank returns what the check needs as a dict, and the check judges it here, in
the parent: it raises a :class:`Verdict` for the first problem found, or returns the text of its PASS line.
"""
from __future__ import annotations

import os

import dis
import functools
import linecache
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..engine.config import ConfigError
from ..ranks.launcher import LaunchError, RankFailedError, launch
from ._display import VerdictView, show
from ._errors import code_of, error_report, refused_text

# The learner's functions live in notebook cells: the launcher sends them to the ranks by value (cloudpickle),
# so the checks use its default start method (a forkserver with torch preloaded, or spawn). Every check
# launches through run_ranks, so this is the one place that says so.
START_METHOD = "auto"
CHECK_TIMEOUT_S = 40.0  # a whole check; a learner's deadlock ends here at the latest
COLLECTIVE_TIMEOUT_S = 8.0  # a rank waiting in a collective its peer never joins fails after this long
SETUP_ATTEMPTS = 2  # launches of a check whose process group failed to form before the learner's code ran

NOT_DONE = "not_done"
NOT_DONE_HINT = "replace each `raise NotImplementedError()` line with your code, then run this cell again."


@dataclass
class CheckResult:
    """Outcome of one check: passed, the hint shown (or what was verified), the mistake's code and exact text."""

    exercise: str
    passed: bool
    hint: str  # what the check printed: a nudge the first time a mistake is seen, else the specific mistake
    mistake: str = ""  # "" when passed, NOT_DONE for a blank, else a code such as "no_divide"
    detail: str = ""  # the specific mistake found (the same as hint when no nudge was given)

    def __post_init__(self) -> None:
        self.detail = self.detail or self.hint

    @property
    def nudged(self) -> bool:
        """True when hint is the first tier (a nudge), not yet the specific mistake."""
        return self.hint != self.detail

    @property
    def done(self) -> bool:
        """False while the function is still the blank."""
        return self.mistake != NOT_DONE

    @property
    def verdict(self) -> str:
        """PASS, NOT DONE YET or TRY AGAIN."""
        if self.passed:
            return "PASS"
        return "NOT DONE YET" if self.mistake == NOT_DONE else "TRY AGAIN"

    @property
    def message(self) -> str:
        """The line the check prints (in Jupyter it is shown as HTML: see _display)."""
        return repr(self.view())

    def view(self) -> VerdictView:
        """The verdict for IPython's display (coloured HTML) with this message as its plain text."""
        return VerdictView(self.verdict, self.exercise, self.hint)

    def __str__(self) -> str:
        return self.message


def summarize(results: Sequence[CheckResult]) -> str:
    """One line per exercise plus a total, e.g. for the end of the exercise notebook."""
    lines = []
    for r in results:
        state = "done" if r.passed else ("not started" if r.mistake == NOT_DONE else "try again")
        lines.append(f"{r.exercise:<18} {state}")
    lines.append(f"{sum(r.passed for r in results)} of {len(results)} exercises pass")
    return "\n".join(lines)


class Verdict(Exception):
    """Raised anywhere inside a check (in the parent) to end it with this outcome."""

    def __init__(self, mistake: str, hint: str, passed: bool = False, nudge: str = ""):
        super().__init__(hint)
        self.mistake, self.hint, self.passed, self.nudge = mistake, hint, passed, nudge


def fail(mistake: str, hint: str, nudge: str = "") -> Verdict:
    """The verdict for a mistake: `raise fail(...)`, or return it from a diagnosis (nudge: its first tier)."""
    return Verdict(mistake, hint, nudge=nudge)


# ------------------------------------------------------------------------------------------------ tiered hints
# The first failed check of an exercise prints a nudge (where to look); running it again prints the specific
# mistake. A learner who thinks it over after the nudge finds the bug themselves; one who is stuck asks again.
# The count lives in this process, i.e. in the notebook's kernel: restarting the kernel starts over.
AGAIN = "Run the check again for the exact mistake."
# Mistakes whose specific text is only a fact about the learner's run (an error, a hang), never an answer.
NO_NUDGE = {NOT_DONE, "not_callable", "error", "refused_call", "timeout", "rank_died", "cannot_launch"}
COMMON_NUDGES = {
    "hardcoded_world_size": "right on 2 ranks but wrong on another number of ranks: is a number of ranks written "
                            "into your code?",
    "collective_mismatch": "one rank waited for the others in a collective: do all ranks run the same "
                           "communication calls?",
}
_failed_checks: Dict[str, int] = {}


def reset_hints(exercise_name: Optional[str] = None) -> None:
    """Forget the failed checks (of one exercise, or of all): the next failure gets a nudge again."""
    if exercise_name is None:
        _failed_checks.clear()
    else:
        _failed_checks.pop(exercise_name, None)


def _tiered(exercise_name: str, v: Verdict, nudges: Dict[str, str]) -> CheckResult:
    """The result for a failed check: the nudge on this exercise's first failure, the specific hint after."""
    if v.mistake in NO_NUDGE:
        return CheckResult(exercise_name, False, v.hint, v.mistake)
    _failed_checks[exercise_name] = _failed_checks.get(exercise_name, 0) + 1
    nudge = v.nudge or nudges.get(v.mistake) or COMMON_NUDGES.get(v.mistake, "")
    if nudge and _failed_checks[exercise_name] == 1:
        return CheckResult(exercise_name, False, f"{nudge} {AGAIN}", v.mistake, v.hint)
    return CheckResult(exercise_name, False, v.hint, v.mistake, v.hint)


class Mistake(Exception):
    """Raised inside a rank by an instrumented call that has already seen the mistake (e.g. a wrong rank)."""

    def __init__(self, mistake: str, hint: str):
        super().__init__(hint)
        self.mistake, self.hint = mistake, hint


class RankReport(Exception):
    """Raised by a rank to end the whole launch now with its report, e.g. a mistake its peers would wait on."""

    # launch ends every rank when one raises and hands the parent this exception, pickled, as the failure's
    # `original`; run_ranks turns it back into the report.

    def __init__(self, out: Dict[str, Any]):
        super().__init__(out)  # the only argument, so that unpickling rebuilds it
        self.out = out

    def __str__(self) -> str:
        # No communication-error words here: launch must take this for the rank's own failure (the one it names),
        # not for a consequence of a lost peer.
        return f"the rank reported {self.out['call']['status']!r} early"


# ---------------------------------------------------------------------------------------------- making a check
def _is_blank(fn: Callable) -> bool:
    """True for a function whose body is only `...`, `pass` and/or a docstring."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    ops = [(i.opname, i.argval) for i in dis.get_instructions(code) if i.opname not in ("RESUME", "NOP", "CACHE")]
    return ops in ([("LOAD_CONST", None), ("RETURN_VALUE", None)], [("RETURN_CONST", None)])


def _run_checked(exercise: str, body: Callable[[], str], student_fn: Any, quiet: bool,
                 nudges: Dict[str, str]) -> CheckResult:
    """Refuse a non-function or an empty body, run the check's body, print and return its result."""
    try:
        if not callable(student_fn):
            raise fail("not_callable", f"pass your function itself (e.g. check(my_function)), not "
                                       f"{type(student_fn).__name__}")
        if _is_blank(student_fn):
            raise fail(NOT_DONE, "the function body is still empty: write your code in it, then run this cell "
                                 "again.")
        result = CheckResult(exercise, True, body())
    except Verdict as v:
        result = CheckResult(exercise, True, v.hint) if v.passed else _tiered(exercise, v, nudges)
    if not quiet:
        show(result.view())
    return result


def exercise(name: str, nudges: Optional[Dict[str, str]] = None
             ) -> Callable[[Callable[[Callable, Optional[int]], str]], Callable[..., CheckResult]]:
    """Decorator: turn a body (raising Verdict, returning a PASS text) into a printing, CheckResult check.

    The body gets the learner's function and the world size asked for (None: the exercise's own); nudges maps
    a mistake code to the first-tier hint printed the first time this exercise fails.
    """

    def deco(body: Callable[[Callable, Optional[int]], str]) -> Callable[..., CheckResult]:
        @functools.wraps(body)
        def check(student_fn: Callable, quiet: bool = False, world_size: Optional[int] = None) -> CheckResult:
            if world_size is not None and (not isinstance(world_size, int) or world_size < 2):
                raise ConfigError(f"world_size={world_size!r}: a check needs an int of at least 2 ranks "
                                  "(or leave it out for the exercise's own).")
            return _run_checked(name, lambda: body(student_fn, world_size), student_fn, quiet, nudges or {})

        check.exercise = name  # type: ignore[attr-defined]
        check.nudges = dict(nudges or {})  # type: ignore[attr-defined]
        return check

    return deco


# ----------------------------------------------------------------------------------------------- inside a rank
def _where_text(where: Any, source_file: Optional[str]) -> str:
    """' at `<source line>`' for a (file, line) from a rank, read here: a notebook cell's source is in this
    kernel's linecache, not in a rank started from a clean server, and a function sent by value (cloudpickle)
    arrives with its file name replaced by "<dynamic-code>"."""
    if not isinstance(where, tuple):
        return where or ""
    path, lineno = where
    line = linecache.getline(source_file if path == "<dynamic-code>" and source_file else path, lineno).strip()
    return f" at `{line}`" if line else ""


def _locate_errors(out: Any, source_file: Optional[str]) -> Any:
    """Every "where" in a rank's report turned into text (see _where_text)."""
    if isinstance(out, dict):
        return {k: _where_text(v, source_file) if k == "where" else _locate_errors(v, source_file)
                for k, v in out.items()}
    return out


def _source_file(args: tuple) -> Optional[str]:
    return next((code_of(a).co_filename for a in args if code_of(a) is not None), None)


def call_student(fn: Callable, *args: Any) -> Dict[str, Any]:
    """Run the learner's function inside a rank; turn whatever it raises into data the parent can judge."""
    try:
        return {"status": "ok", "value": fn(*args)}
    except NotImplementedError:
        return {"status": NOT_DONE}
    except Mistake as e:
        return {"status": "mistake", "mistake": e.mistake, "hint": e.hint}
    except Exception as e:  # noqa: BLE001 - any error of the learner's code becomes a hint, not a traceback
        return error_report(e, fn)


def call_cases(fn: Callable, cases: Dict[str, tuple], report: Callable[[Any], Dict[str, Any]]) -> Dict[str, Any]:
    """In a rank: fn(*args) for each case, report(value) on success, until one fails; "call" holds the outcome."""
    out: Dict[str, Any] = {}
    for key, args in cases.items():
        call = call_student(fn, *args)
        if call["status"] == "ok":
            call = report(call["value"])
        out[key] = call
        if call["status"] != "ok":
            out["call"] = call
            return out
    out["call"] = {"status": "ok"}
    return out


def swap_globals(fn: Callable, original: Any, replacement: Any) -> None:
    """Inside a rank only: names in fn's globals bound to `original` now point at `replacement`."""
    # A class's methods share the globals of the cell or module that defined the class.
    g = getattr(fn, "__globals__", None)
    if g is None and isinstance(fn, type):
        g = next((v.__globals__ for v in vars(fn).values() if hasattr(v, "__globals__")), None)
    if not isinstance(g, dict):
        return
    for k, v in list(g.items()):
        if v is original:
            g[k] = replacement


# ----------------------------------------------------------------------------------------------- in the parent
class _CheckDeadline(Exception):
    """Raised by _Deadline through launch's on_poll: the check ran past CHECK_TIMEOUT_S."""


class _Deadline:
    """on_poll callback for launch: ends a check that takes too long (a deadlock in the learner's code)."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def __call__(self) -> None:
        if time.monotonic() > self.end:
            raise _CheckDeadline()


def timeout_verdict() -> Verdict:
    """The verdict for a check that ran past CHECK_TIMEOUT_S."""
    return fail("timeout", f"your function did not finish within {CHECK_TIMEOUT_S:.0f} s on every rank: a "
                           "collective that only some ranks call waits forever (e.g. an all_reduce inside "
                           "`if rank == 0:`). Every rank must call the same collectives in the same order.")


def run_ranks(harness: Callable, world_size: int, args: tuple,
              init_group: bool = True) -> List[Optional[Dict[str, Any]]]:
    """Run harness(rank, world_size, *args) on real ranks (in one gloo group if init_group); their dicts."""
    # A rank that raises RankReport ends the launch early: its dict comes back, None for every other rank.
    if START_METHOD == "fork" and torch.cuda.is_initialized():  # said for learners, before launch refuses it
        raise fail("cannot_launch", "CUDA is initialized in this kernel, so forked ranks can't start: restart the "
                                    "kernel and run the exercises before touching CUDA.")
    deadline = _Deadline(CHECK_TIMEOUT_S)
    try:
        for attempt in range(SETUP_ATTEMPTS):
            try:
                outs = launch(harness, world_size=world_size, args=args, backend="gloo", start_method=START_METHOD,
                              timeout_s=COLLECTIVE_TIMEOUT_S, threads_per_rank=1, on_poll=deadline,
                              init_group=init_group)
                break
            except RankFailedError as e:
                # The group the check sets up failed before the learner's code ran (on a machine so busy that a
                # rank reached the rendezvous after its peer's timeout): not the learner's mistake, so again.
                if not (init_group and "init_group_from_env" in e.traceback_text) or attempt == SETUP_ATTEMPTS - 1:
                    raise
    except _CheckDeadline:
        raise timeout_verdict() from None
    except (LaunchError, ConfigError) as e:
        if "can't send the function" in str(e):  # the learner's function holds what a new process can't receive
            raise fail("unsendable_function", "your function can't be sent to the ranks: each rank is a new "
                                              "process that receives it pickled, with every global it uses, and "
                                              f"one of them can't be ({str(e).split('ranks (', 1)[-1].split(').')[0]}). "
                                              "Make that object inside your function instead.") from None
        raise fail("cannot_launch", f"the check could not start its processes: {e}") from None
    except RankFailedError as e:
        if isinstance(e.original, RankReport):
            out = _locate_errors(e.original.out, _source_file(args))
            return [out if r == e.rank else None for r in range(world_size)]
        if "can't be sent back to the launching process" in e.message:
            raise fail("unsendable_value", f"rank {e.rank} could not send its result back to this notebook: "
                                           f"{e.message.split('failed: ', 1)[-1]}") from None
        if "exercises" + os.sep in e.traceback_text and "call_student" not in e.traceback_text:
            # Raised in the rank outside the learner's call: the check's own reading of what it returned failed.
            raise fail("unusable_value", f"on rank {e.rank} the check could not use what your function returned "
                                         f"({e.message}): return what the exercise asks for (its docstring says "
                                         "what)") from None
        raise fail("rank_died", f"rank {e.rank}'s process ended before reporting ({e.message}): does your "
                                "function call exit(), os._exit() or destroy the process group?") from None
    silent = [r for r, out in enumerate(outs) if out is None]  # the process exited with 0 but returned nothing
    if silent:
        raise fail("rank_died", f"rank {silent[0]}'s process ended without reporting: does your function call "
                                "exit() or os._exit()?")
    return [_locate_errors(out, _source_file(args)) for out in outs]


def student_outcomes(outs: Sequence[Optional[Dict[str, Any]]], key: str = "call") -> List[Dict[str, Any]]:
    """The learner's call on each rank that reported; raises the verdict for a blank, a known mistake or an error."""
    calls = {r: o[key] for r, o in enumerate(outs) if o is not None}
    if any(c["status"] == NOT_DONE for c in calls.values()):
        raise fail(NOT_DONE, NOT_DONE_HINT)
    for c in calls.values():
        if c["status"] == "mistake":
            raise fail(c["mistake"], c["hint"])
    errors = {r: c for r, c in calls.items() if c["status"] == "error"}
    if errors:
        own = {r: c for r, c in errors.items() if not c["comm"]}
        if not own:  # only lost peers: someone waited in a collective the others never joined
            r = min(errors)
            others = [x for x in range(len(outs)) if x not in errors]
            who = f"rank {others[0]}" if others else "another rank"
            raise fail("collective_mismatch",
                       f"rank {r} waited in a collective that {who} never joined: every rank must call the same "
                       "collectives (all_reduce, barrier, ...) in the same order, e.g. no all_reduce inside "
                       "`if rank == 0:`.")
        r = min(own)
        c = own[r]
        if c.get("refused"):  # torch refused the learner's own call: the call, the argument, the fix
            alike = len(own) == len(calls) > 1 and all(o.get("refused") and o["type"] == c["type"]
                                                        for o in own.values())
            raise fail("refused_call", refused_text(c, "every rank" if alike else f"rank {r}"))
        raise fail("error", f"your function raised {c['type']} on rank {r}{c['where']}: {c['message']}")
    return list(calls.values())


HARDCODED_FIX = "divide by dist.get_world_size(), not a fixed 2."


def check_on_2_and_3_ranks(harness: Callable, diagnose: Callable, student_fn: Callable,
                           world_size: Optional[int] = None,
                           hardcoded: Tuple[Sequence[str], str] = (("no_divide", "divided_twice", "wrong_value"),
                                                                   HARDCODED_FIX),
                           sizes: Tuple[int, ...] = (2, 3)) -> Tuple[int, ...]:
    """Run on 2 ranks, then on 3 (or on the sizes given, or on world_size only): an answer right on 2 but wrong
    on more has the world size hard-coded. hardcoded: the mistakes on more ranks that mean that, and what to do
    instead. Returns the world sizes it ran."""
    sizes = sizes if world_size is None else (world_size,)
    codes, fix = hardcoded
    for k, size in enumerate(sizes):
        verdict = diagnose(run_ranks(harness, size, (student_fn,)), size)
        if verdict is None:
            continue
        if k > 0 and verdict.mistake in codes:
            raise fail("hardcoded_world_size", f"right on {sizes[0]} ranks but wrong on {size}: {fix}")
        raise verdict
    return sizes
