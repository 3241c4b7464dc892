"""The exercises as an nbgrader assignment: generate the student notebook, autograde submissions, feedback.

    python -m teacher.grading assignment   # source -> release (build/nbgrader) -> notebooks/exercises/, executed
    python -m teacher.grading grade --samples   # three sample submissions, autograded, with feedback pages
    python -m teacher.grading grade        # every notebook in build/nbgrader/submitted/<student>/ddp_exercises/

The source notebook (solutions between BEGIN/END SOLUTION, graded check cells with hidden tests) is
teacher/nbgrader/source/ddp_exercises/exercises.ipynb; the course folder nbgrader works in is generated.
"""
from __future__ import annotations

import argparse
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
ASSIGNMENT = "ddp_exercises"
NOTEBOOK = "exercises.ipynb"
SOURCE = ROOT / "teacher" / "nbgrader" / "source" / ASSIGNMENT / NOTEBOOK
CONFIG = ROOT / "teacher" / "nbgrader" / "nbgrader_config.py"
STUDENT_NOTEBOOK = ROOT / "notebooks" / "exercises" / NOTEBOOK  # the release, executed (what learners open)
COURSE = ROOT / "build" / "nbgrader"


def nbgrader_env() -> Dict[str, str]:
    """The environment nbgrader runs in: this Python's scripts first on PATH, this checkout first on PYTHONPATH."""
    env = dict(os.environ)
    # nbgrader runs `alembic` (its database migrations) through PATH: it must be this environment's.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # The kernels that autograde the notebooks import ddp_helpers: the one of this checkout.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def run_nbgrader(course: Path, *args: str) -> str:
    """Run one nbgrader command in the course folder; its output, or a RuntimeError with its last lines."""
    proc = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=nbgrader_env(),
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"`nbgrader {' '.join(args)}` failed (exit {proc.returncode}) in {course}:\n{tail}")
    return proc.stdout + proc.stderr


def make_course(course: Path = COURSE) -> Path:
    """A course folder with this repository's nbgrader settings and the assignment's source notebook."""
    (course / "source" / ASSIGNMENT).mkdir(parents=True, exist_ok=True)
    shutil.copy(CONFIG, course / "nbgrader_config.py")
    shutil.copy(SOURCE, course / "source" / ASSIGNMENT / NOTEBOOK)
    return course


def generate(course: Path = COURSE) -> Path:
    """nbgrader generate_assignment: the student notebook (solutions and hidden tests removed); its path."""
    make_course(course)
    run_nbgrader(course, "generate_assignment", ASSIGNMENT, "--force")
    return course / "release" / ASSIGNMENT / NOTEBOOK


def function_source(fn: Callable, name: str) -> str:
    """fn's source as a notebook cell would define it, under the exercise's function name."""
    src = inspect.getsource(fn)
    src = src[re.search(r"^def ", src, flags=re.M).start():]  # without decorators (teacher/wrong_answers.py's)
    return re.sub(r"^def \w+\(", f"def {name}(", src, count=1)


def submit(course: Path, student: str, answers: Dict[str, Callable]) -> Path:
    """A submission: the release with the blanks of `answers` (exercise -> function) filled in, as a student does."""
    import nbformat  # here: importing it builds jsonschema's format parsers (~2 s), which importers of this module skip

    nb = nbformat.read(course / "release" / ASSIGNMENT / NOTEBOOK, as_version=4)
    for cell in nb.cells:
        name = cell.metadata.get("nbgrader", {}).get("grade_id")
        if cell.metadata.get("nbgrader", {}).get("solution") and name in answers:
            cell.source = function_source(answers[name], name) + f'\n\nprint("defined {name}")'
    path = course / "submitted" / student / ASSIGNMENT / NOTEBOOK
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


def sample_submissions() -> Dict[str, Dict[str, Callable]]:
    """Student id -> answers: everything solved, nothing done, and two typical wrong answers (partial marks)."""
    if str(ROOT) not in sys.path:  # teacher/ sits next to the package, not installed
        sys.path.insert(0, str(ROOT))
    from teacher.solutions import SOLUTIONS
    from teacher.wrong_answers import loader_no_set_epoch, mean_sum_only

    return {
        "sample-solved": dict(SOLUTIONS),
        "sample-blank": {},
        # 1 and 3 right, 2 (a sum, not a mean) and 4 (no set_epoch) wrong, 5-7 blank: one page shows two hints
        "sample-two-mistakes": {"init_group": SOLUTIONS["init_group"], "global_mean": mean_sum_only,
                                "shard_indices": SOLUTIONS["shard_indices"], "make_loader": loader_no_set_epoch},
    }


def autograde(course: Path = COURSE) -> None:
    """nbgrader autograde and generate_feedback for every submission in the course folder."""
    run_nbgrader(course, "autograde", ASSIGNMENT, "--force")
    run_nbgrader(course, "generate_feedback", ASSIGNMENT, "--force")


def scores(course: Path = COURSE) -> Dict[str, Tuple[float, float]]:
    """Student id -> (score, max score) from the course's gradebook."""
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        return {s.student.id: (s.score, s.max_score) for s in gb.assignment_submissions(ASSIGNMENT)}


def feedback_page(course: Path, student: str) -> Path:
    """The feedback page nbgrader wrote for one student."""
    return course / "feedback" / student / ASSIGNMENT / NOTEBOOK.replace(".ipynb", ".html")


def write_student_notebook(course: Path = COURSE, target: Path = STUDENT_NOTEBOOK) -> Path:
    """Generate the release and store it, executed, as the learners' notebook in notebooks/exercises/."""
    shutil.copy(generate(course), target)
    subprocess.run([sys.executable, str(ROOT / "tools" / "execute_notebooks.py"), str(target)], check=True,
                   env=nbgrader_env())
    return target


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["assignment", "grade"])
    p.add_argument("--course", type=Path, default=COURSE, help="nbgrader's course folder (default: build/nbgrader)")
    p.add_argument("--samples", action="store_true", help="grade: first write the three sample submissions")
    args = p.parse_args(argv)
    course = args.course.resolve()
    if args.command == "assignment":
        path = write_student_notebook(course)
        print(f"student notebook: {course / 'release' / ASSIGNMENT / NOTEBOOK} (hand this out)\n"
              f"  and, executed, {path.relative_to(ROOT)}")
        return 0
    generate(course)
    if args.samples:
        for student, answers in sample_submissions().items():
            submit(course, student, answers)
    if not any((course / "submitted").glob(f"*/{ASSIGNMENT}/{NOTEBOOK}")):
        print(f"no submissions: put each student's notebook at {course}/submitted/<student>/{ASSIGNMENT}/{NOTEBOOK}"
              " (or pass --samples)")
        return 1
    autograde(course)
    for student, (score, best) in sorted(scores(course).items()):
        print(f"{student:<22} {score:4g} / {best:g}   {feedback_page(course, student).relative_to(course)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
