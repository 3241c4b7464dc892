"""A class-sized set of answers to the hand-built synchronizations (notebook 0's two blanks, notebook 3b's buckets):
every wrong answer gets the mistake it made, named, and no other; every correct variant passes (issue 58).

The answers run many to a launch: each rank runs the check's own per-rank harness on every answer in turn, and
the parent judges each answer's records with the check's own diagnosis, on 2 ranks and then, for those right on 2,
on 3 (as check_on_2_and_3_ranks does). Answers that leave a rank waiting for a peer (a collective on rank 0 only)
are not in this set: they end a launch, and PRACTICE_WRONG holds them.
"""
from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # teacher/ sits next to the package, outside it

from ddp_helpers import launch  # noqa: E402
from ddp_helpers.exercises import PRACTICE_EXERCISES  # noqa: E402
from ddp_helpers.exercises._harness import Verdict, _locate_errors, _source_file  # noqa: E402
from teacher.solutions import PRACTICE_SOLUTIONS  # noqa: E402
from teacher.wrong_answers import SYNC_RIGHT, SYNC_WRONG  # noqa: E402

from _hints import norm, solution_statements  # noqa: E402

EXERCISES = ("after_backward", "as_gradients_arrive", "bucketed_sync")
HARDCODED = {"after_backward": ("no_divide", "divided_twice", "wrong_value", "some_params", "wrong_divisor"),
             "as_gradients_arrive": ("no_divide", "divided_twice", "wrong_value", "some_params", "wrong_divisor"),
             "bucketed_sync": ("no_divide", "divided_twice", "wrong_value")}


def _many(rank: int, world_size: int, exercise: str, answers: list) -> list:
    """In a rank: the check's harness on every answer, in turn (the same order on every rank)."""
    from ddp_helpers.exercises import bucketed_sync, core_sync

    harness = bucketed_sync._in_rank if exercise == "bucketed_sync" else core_sync._in_rank
    return [harness(rank, world_size, answer) for answer in answers]


def _diagnosis(exercise: str) -> Callable[[List[Dict[str, Any]], int], Optional[Verdict]]:
    from ddp_helpers.exercises import _bucket_verdicts
    from ddp_helpers.exercises._core_verdicts import diagnose

    if exercise == "bucketed_sync":
        return _bucket_verdicts.diagnose
    step = 1 if exercise == "after_backward" else 2
    return lambda outs, size: diagnose(outs, size, step, {})


def _judge(exercise: str, answers: list, size: int) -> List[Optional[Verdict]]:
    """Each answer's verdict on `size` ranks (None: passed), all answers in one launch."""
    per_rank = launch(_many, size, args=(exercise, answers), threads_per_rank=1, timeout_s=8.0)
    verdicts = []
    for k, answer in enumerate(answers):
        outs = [_locate_errors(per_rank[r][k], _source_file((answer,))) for r in range(size)]
        try:
            verdicts.append(_diagnosis(exercise)(outs, size))
        except Verdict as v:  # student_outcomes raises its verdicts
            verdicts.append(v)
    return verdicts


def _outcomes(exercise: str) -> Dict[str, Optional[Verdict]]:
    """Every answer of this exercise (wrong and right) judged as check_on_2_and_3_ranks judges: 2 ranks, then 3."""
    answers = [a for a in SYNC_WRONG + SYNC_RIGHT if a.exercise == exercise]
    fns = [a.fn for a in answers]
    first = _judge(exercise, fns, 2)
    again = [k for k, v in enumerate(first) if v is None]
    later = dict(zip(again, _judge(exercise, [fns[k] for k in again], 3))) if again else {}
    out = {}
    for k, a in enumerate(answers):
        v = first[k] if first[k] is not None else later[k]
        if first[k] is None and v is not None and v.mistake in HARDCODED[exercise]:
            v = Verdict("hardcoded_world_size", f"right on 2 ranks but wrong on 3 ({v.mistake}): not a fixed number")
        out[a.fn.__name__] = v
    return out


@pytest.fixture(scope="module")
def outcomes() -> Dict[str, Dict[str, Optional[Verdict]]]:
    return {name: _outcomes(name) for name in EXERCISES}


def test_the_set_is_class_sized_with_correct_variants():
    count = {name: sum(a.exercise == name for a in SYNC_WRONG) for name in EXERCISES}
    assert count["after_backward"] + count["as_gradients_arrive"] >= 40 and count["bucketed_sync"] >= 25, count
    assert all(sum(a.exercise == name for a in SYNC_RIGHT) >= 3 for name in EXERCISES)
    names = [a.fn.__name__ for a in SYNC_WRONG + SYNC_RIGHT]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("name", EXERCISES)
def test_every_wrong_answer_gets_its_own_mistake_and_every_correct_one_passes(name, outcomes):
    got = outcomes[name]
    wrong = [(a.fn.__name__, a.mistake, a.hint, got[a.fn.__name__]) for a in SYNC_WRONG if a.exercise == name]
    misjudged = [(fn, want, None if v is None else (v.mistake, v.hint)) for fn, want, hint, v in wrong
                 if v is None or v.mistake != want or hint not in v.hint]
    failed = [(a.fn.__name__, got[a.fn.__name__].hint) for a in SYNC_RIGHT
              if a.exercise == name and got[a.fn.__name__] is not None]
    assert not misjudged and not failed, f"misjudged: {misjudged}\ncorrect answers failed: {failed}"
    code = solution_statements(PRACTICE_SOLUTIONS[name])
    answers = {a.fn.__name__: a.fn for a in SYNC_WRONG}
    given = [(fn, s) for fn, _, _, v in wrong for s in code if s in norm(_unquoted(v.hint, answers[fn]))]
    assert not given, f"hints that hand over the solution's code: {given}"


def _unquoted(hint: str, answer: Any) -> str:
    """The hint without the lines it quotes from the answer itself (where an error was raised): the learner's own
    code, which may read like the solution's."""
    source = inspect.getsource(answer if isinstance(answer, type) else sys.modules[answer.__module__])
    parts = hint.split("`")
    return "`".join(p for k, p in enumerate(parts) if k % 2 == 0 or p not in source)


@pytest.mark.parametrize("name", EXERCISES)
def test_every_mistake_of_the_set_has_a_nudge(name):
    codes = {a.mistake for a in SYNC_WRONG if a.exercise == name} - {"hardcoded_world_size", "error"}
    assert codes <= set(PRACTICE_EXERCISES[name].nudges), codes - set(PRACTICE_EXERCISES[name].nudges)
