"""The exercise checks: solutions pass, the notebook's blanks say "not done yet", each typical mistake gets its hint."""
from __future__ import annotations

import inspect
import json
import os
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # teacher/ sits next to the package, outside it (not installed on purpose)

from ddp_helpers.exercises import EXERCISES, NOT_DONE, CheckResult, summarize  # noqa: E402
from teacher.solutions import SOLUTIONS  # noqa: E402
from teacher.wrong_answers import WRONG  # noqa: E402

NOTEBOOK = ROOT / "notebooks" / "exercises" / "exercises.ipynb"


def _cells(tag=None):
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    return [c for c in nb["cells"] if c["cell_type"] == "code"
            and (tag is None or tag in c.get("metadata", {}).get("tags", []))]


def _src(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


@pytest.fixture(scope="module")
def blanks():
    """The notebook's blank functions, defined the way the notebook defines them (setup cell + blank cells)."""
    ns: dict = {"__name__": "exercise_notebook"}
    exec(_src(_cells()[0]), ns)  # the imports
    for cell in _cells("blank"):
        exec(_src(cell), ns)
    return ns


def test_every_exercise_has_a_solution_and_wrong_answers():
    assert len(EXERCISES) >= 6
    assert set(SOLUTIONS) == set(EXERCISES)
    assert {w.exercise for w in WRONG} == set(EXERCISES)
    codes = [(w.exercise, w.mistake) for w in WRONG]
    assert len(codes) == len(set(codes)), "each wrong answer should show a different mistake"


def test_notebook_has_one_blank_and_one_check_per_exercise(blanks):
    names = [n for n in EXERCISES if callable(blanks.get(n))]
    assert names == list(EXERCISES), f"blank functions found in the notebook: {names}"
    calls = "\n".join(_src(c) for c in _cells())
    for name, check in EXERCISES.items():
        assert f"{check.__name__}({name})" in calls
        assert list(inspect.signature(blanks[name]).parameters) == list(inspect.signature(SOLUTIONS[name]).parameters)


@pytest.mark.parametrize("name", list(EXERCISES))
def test_solution_passes(name, capsys):
    result = EXERCISES[name](SOLUTIONS[name])
    printed = capsys.readouterr().out
    assert isinstance(result, CheckResult)
    assert result.passed, result.message
    assert result.mistake == "" and printed.startswith(f"PASS  {name}: ")


@pytest.mark.parametrize("name", list(EXERCISES))
def test_blank_says_not_done_yet(name, blanks, capsys):
    result = EXERCISES[name](blanks[name])
    printed = capsys.readouterr().out
    assert not result.passed and result.mistake == NOT_DONE and not result.done
    assert printed == f"NOT DONE YET  {name}: replace the `raise NotImplementedError(...)` line with your code, " \
                      "then run this cell again.\n"
    assert "Traceback" not in printed


def test_empty_body_also_says_not_done_yet(capsys):
    def average_gradients(model):
        """Only a docstring and `...`: nothing written yet."""
        ...

    result = EXERCISES["average_gradients"](average_gradients)
    assert result.mistake == NOT_DONE and "still empty" in result.hint


@pytest.mark.parametrize("wrong", WRONG, ids=[f"{w.exercise}-{w.mistake}" for w in WRONG])
def test_typical_wrong_answer_gets_its_hint(wrong, capsys):
    result = EXERCISES[wrong.exercise](wrong.fn)
    printed = capsys.readouterr().out
    assert not result.passed
    assert result.mistake == wrong.mistake, result.message
    assert wrong.hint in result.hint
    assert printed == f"TRY AGAIN  {wrong.exercise}: {result.hint}\n"
    assert "Traceback" not in printed


def test_an_unexpected_error_is_named_with_its_line(capsys):
    def global_mean(value):
        return value.no_such_method()

    result = EXERCISES["global_mean"](global_mean)
    assert result.mistake == "error"
    assert "AttributeError on rank 0 at `return value.no_such_method()`" in result.hint
    assert "Traceback" not in capsys.readouterr().out


def test_one_ranks_mistake_ends_init_group_at_once():
    """Rank 1's wrong rank is named before the rendezvous; rank 0, already waiting there (20 s timeout), is ended."""
    wrong = next(w for w in WRONG if (w.exercise, w.mistake) == ("init_group", "wrong_rank"))
    start = time.monotonic()
    result = EXERCISES["init_group"](wrong.fn, quiet=True)
    assert result.mistake == "wrong_rank"
    assert time.monotonic() - start < 10, "the check waited for rank 0's rendezvous timeout"


@pytest.mark.parametrize("name", ["init_group", "global_mean"])
def test_a_function_that_ends_its_process_is_named(name):
    def ends_the_process(*args):
        os._exit(0)

    result = EXERCISES[name](ends_the_process, quiet=True)
    assert result.mistake == "rank_died" and "os._exit()" in result.hint, result.message


def test_checks_leave_the_callers_random_state_alone():
    import torch

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    EXERCISES["accumulation_step"](SOLUTIONS["accumulation_step"], quiet=True)
    assert torch.equal(torch.rand(3), expected)


def test_summary_counts_passes():
    results = [CheckResult("a", True, "ok"), CheckResult("b", False, "x", NOT_DONE), CheckResult("c", False, "y", "z")]
    assert summarize(results).splitlines() == ["a                  done", "b                  not started",
                                               "c                  try again", "1 of 3 exercises pass"]


def test_solved_notebook_passes_in_a_real_kernel(tmp_path):
    """The blanks replaced by the solutions, run in a Jupyter kernel: fork really runs cell-defined functions."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(str(NOTEBOOK), as_version=4)
    for cell in nb.cells:
        if "blank" in cell.metadata.get("tags", []):
            name = next(n for n in EXERCISES if f"def {n}(" in cell.source)
            cell.source = inspect.getsource(SOLUTIONS[name])
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    last = "".join(o.get("text", "") for o in nb.cells[-2].outputs)
    assert last.rstrip().endswith(f"{len(EXERCISES)} of {len(EXERCISES)} exercises pass"), last
