"""The registry of typical wrong answers: each labelled with its exercise, mistake code and a piece of its hint."""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Callable, List

T = datetime.timedelta(seconds=20)  # the process-group timeout of wrong answers that set one


@dataclass(frozen=True)
class WrongAnswer:
    """A wrong answer: which exercise, the mistake code its check must report, and a piece of the hint text."""

    exercise: str
    mistake: str
    hint: str  # must appear in the printed hint
    fn: Callable


WRONG: List[WrongAnswer] = []  # the exercise notebook's (and the nbgrader assignment's)
PRACTICE_WRONG: List[WrongAnswer] = []  # the checked exercises of lesson notebooks 11 and 12
# A class-sized set for the hand-built synchronizations (notebook 0's two blanks, notebook 3b's buckets), run
# many to a launch by tests/exercises/test_sync_class.py: each must get its mistake; SYNC_RIGHT must pass.
SYNC_WRONG: List[WrongAnswer] = []
SYNC_RIGHT: List[WrongAnswer] = []  # mistake "" : correct variants


def wrong(exercise: str, mistake: str, hint: str, registry: List[WrongAnswer] = WRONG
          ) -> Callable[[Callable], Callable]:
    """Register fn as a typical wrong answer (in WRONG unless another registry is given)."""
    def deco(fn: Callable) -> Callable:
        registry.append(WrongAnswer(exercise, mistake, hint, fn))
        return fn
    return deco
