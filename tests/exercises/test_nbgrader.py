"""The exercises as an nbgrader assignment: the release is the committed notebook, and autograding gives full
marks to the solutions, zero to the blank release and partial marks with the check's hint to wrong answers."""
from __future__ import annotations

import html
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # teacher/ sits next to the package, outside it (not installed on purpose)

from ddp_helpers.exercises import EXERCISES  # noqa: E402
from teacher import grading  # noqa: E402
from teacher.solutions import SOLUTIONS  # noqa: E402
from teacher.wrong_answers import WRONG  # noqa: E402

# nbgrader (the teacher extra) is looked up, not imported: it and nbformat load only in the worker that runs these
# tests (importing nbformat builds jsonschema's format parsers, ~2 s of CPU at each worker's collection).
pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(importlib.util.find_spec("nbgrader") is None, reason="nbgrader is not installed")]


def _read(path):
    """The notebook at path (nbformat v4)."""
    import nbformat

    return nbformat.read(path, as_version=4)


def _nbgrader(cell) -> dict:
    return cell.metadata.get("nbgrader", {})


def _points() -> dict:
    """grade_id of each graded cell of the source -> its points."""
    nb = _read(grading.SOURCE)
    return {_nbgrader(c)["grade_id"]: _nbgrader(c)["points"] for c in nb.cells if _nbgrader(c).get("grade")}


# Graded here: the solved sample and the one with two mistakes, whose exercises 5-7 are blank (so blank cells are
# graded too). make grade's third sample, the blank release, would cost one more kernel to show what those cells
# and test_blank_says_not_done_yet (every exercise, in test_exercises.py) show already.
GRADED = ("sample-solved", "sample-two-mistakes")


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """A course folder: the assignment generated, two sample submissions autograded, feedback written."""
    course = tmp_path_factory.mktemp("course")
    grading.generate(course)
    for student, answers in grading.sample_submissions().items():
        if student in GRADED:
            grading.submit(course, student, answers)
    grading.autograde(course)
    return course


def _cell_scores(course: Path, student: str) -> dict:
    """grade_id -> points the autograder gave this student's graded cell."""
    from nbgrader.api import Gradebook

    notebook = grading.NOTEBOOK.removesuffix(".ipynb")
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        graded = gb.find_submission_notebook(notebook, grading.ASSIGNMENT, student)
        return {grade.name: grade.score for grade in graded.grades}


def _feedback(course: Path, student: str) -> str:
    """The feedback page as text: tags dropped, entities decoded, whitespace folded."""
    page = grading.feedback_page(course, student).read_text(encoding="utf-8")
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page)).split())


@pytest.mark.slow
def test_committed_student_notebook_is_the_generated_release(course):
    release = _read(course / "release" / grading.ASSIGNMENT / grading.NOTEBOOK)
    committed = _read(grading.STUDENT_NOTEBOOK)
    cells = [[(c.cell_type, c.source, _nbgrader(c), c.metadata.get("tags", [])) for c in nb.cells]
             for nb in (release, committed)]
    assert cells[0] == cells[1], "notebooks/exercises/exercises.ipynb differs from the release: run make assignment"


@pytest.mark.slow
def test_release_has_blanks_and_no_solutions_or_hidden_tests(course):
    release = _read(course / "release" / grading.ASSIGNMENT / grading.NOTEBOOK)
    text = "\n".join(c.source for c in release.cells if c.cell_type == "code")
    assert "BEGIN SOLUTION" not in text and "HIDDEN TESTS" not in text and "world_size=" not in text
    assert text.count("raise NotImplementedError()") == len(EXERCISES)
    for name in EXERCISES:
        code = [line.strip() for line in inspect.getsource(SOLUTIONS[name]).splitlines()
                if line.strip() and not line.strip().startswith("#")]
        body = code[-2]  # a line of the solution's code (not a comment): it must not reach the student
        assert body not in text, f"{name}'s solution line {body!r} is in the student notebook"


def test_source_solutions_are_the_teacher_solutions():
    """The source's solution regions are teacher/solutions.py's function bodies, so the two can't drift."""
    nb = _read(grading.SOURCE)
    regions = {}
    for cell in nb.cells:
        if _nbgrader(cell).get("solution"):
            lines = cell.source.split("\n")
            begin, end = lines.index("    ### BEGIN SOLUTION"), lines.index("    ### END SOLUTION")
            regions[_nbgrader(cell)["grade_id"]] = lines[begin + 1:end]
    assert list(regions) == list(EXERCISES)
    for name, region in regions.items():
        assert region == inspect.getsource(SOLUTIONS[name]).rstrip("\n").split("\n")[2:], name


def test_every_check_cell_has_points_and_a_hidden_test_at_another_world_size():
    nb = _read(grading.SOURCE)
    graded = [c for c in nb.cells if _nbgrader(c).get("grade")]
    assert [_nbgrader(c)["grade_id"] for c in graded] == [f"check_{n}" for n in EXERCISES]
    for cell in graded:
        hidden = cell.source.split("### BEGIN HIDDEN TESTS")[1]
        assert re.search(r"world_size=\d", hidden) and "assert hidden.passed, hidden.hint" in hidden
        assert _nbgrader(cell)["points"] > 0


@pytest.mark.slow
def test_solutions_get_full_marks(course):
    score, best = grading.scores(course)["sample-solved"]
    assert best == sum(_points().values()) and score == best
    # The learner's own summary cell, run in the autograding kernel (the release is the committed notebook).
    assert f"{len(EXERCISES)} of {len(EXERCISES)} exercises pass" in _feedback(course, "sample-solved")


@pytest.mark.slow
def test_blank_cells_get_zero_and_say_not_done_yet(course):
    blank = [name for name in EXERCISES if name not in grading.sample_submissions()["sample-two-mistakes"]]
    assert blank, "the sample with two mistakes leaves some exercises blank"
    cells = _cell_scores(course, "sample-two-mistakes")
    assert sorted(cells) == sorted(f"check_{n}" for n in EXERCISES), cells
    assert all(cells[f"check_{name}"] == 0 for name in blank), cells
    page = _feedback(course, "sample-two-mistakes")
    assert all(f"NOT DONE YET {name}: " in page for name in blank), page[:2000]


@pytest.mark.slow
def test_wrong_answers_get_partial_marks_and_each_its_hint(course):
    student = "sample-two-mistakes"
    points = _points()
    assert grading.scores(course)[student][0] == sum(points[f"check_{n}"] for n in ("init_group", "shard_indices"))
    cells = _cell_scores(course, student)
    assert cells["check_init_group"] == points["check_init_group"] and cells["check_global_mean"] == 0, cells
    page = _feedback(course, student)
    failures = re.findall(r"AssertionError ?: (.{0,400})", page)  # the hidden tests', each with its mistake
    for exercise_name, mistake in (("global_mean", "no_divide"), ("make_loader", "no_set_epoch")):
        wrong = next(w for w in WRONG if (w.exercise, w.mistake) == (exercise_name, mistake))
        assert f"TRY AGAIN {exercise_name}: " in page  # the visible check's printed verdict (the nudge)
        assert any(" ".join(wrong.hint.split()) in f for f in failures), f"no {mistake} hint on {student}'s page"
