"""What every check's hint must do, shared by the exercise notebook's tests and the practice chapter's."""
from __future__ import annotations

import inspect
from typing import Callable, List

from ddp_helpers.exercises._harness import AGAIN, COMMON_NUDGES, NO_NUDGE


def norm(text: str) -> str:
    return " ".join(text.replace('"', "'").split())


def solution_statements(solution: Callable) -> List[str]:
    """The solution's code lines (comments and docstring dropped), normalised, longer than one short call.

    A specific hint may name the one call or argument a mistake lacks (`sampler.set_epoch(epoch)`,
    `world_size=world_size`); it must not hand over the solution's real lines.
    """
    lines = inspect.getsource(solution).splitlines()[2:]  # below the def line and the docstring
    code = [norm(line.split("  #")[0]) for line in lines]
    return [c for c in code if len(c) > 24]


def nudge(check: Callable, mistake: str) -> str:
    """The first-tier hint a check prints for this mistake ('' when it has none)."""
    return check.nudges.get(mistake) or COMMON_NUDGES.get(mistake, "")


def assert_gets_its_hint(wrong, check: Callable, solution: Callable, result, printed: str) -> None:
    """The first failure prints the nudge; the specific mistake is in .detail; neither spells out the solution."""
    assert not result.passed
    assert result.mistake == wrong.mistake, result.message
    assert wrong.hint in result.detail, result.detail
    assert printed == f"TRY AGAIN  {wrong.exercise}: {result.hint}\n"
    assert "Traceback" not in printed
    if wrong.mistake not in NO_NUDGE:
        assert result.nudged and result.hint == f"{nudge(check, wrong.mistake)} {AGAIN}", result.hint
        assert wrong.hint not in result.hint, "the nudge gives the specific mistake away"
    for text in (result.hint, result.detail):
        given = [s for s in solution_statements(solution) if s in norm(text)]
        assert not given, f"the hint contains the solution's code {given}: {text}"
