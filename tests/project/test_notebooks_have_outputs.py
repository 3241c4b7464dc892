"""The teaching notebooks are committed executed: every code cell has stored outputs, none is an error.

nbval (pytest --nbval notebooks/) compares fresh outputs with the stored ones, so a notebook saved without
outputs, or with an error in it, would make the regression test meaningless; this test catches that without
running any notebook. It also checks that every notebook ends with its Summary and Exercises.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parents[2] / "notebooks"
# The numbered teaching notebooks, in reading order: these also need a Summary and Exercises. A letter after the
# number (03b_...) inserts a notebook after that number's without renumbering the ones after it.
NOTEBOOKS = sorted(p for p in NOTEBOOK_DIR.glob("[0-9][0-9]*_*.ipynb") if re.match(r"^\d\d[a-z]?_", p.name))
# The appendix notebooks (A1, A2, ...): outside the reading order, but held to the same structure.
APPENDIX = sorted((NOTEBOOK_DIR / "appendix").glob("A[0-9]_*.ipynb"))
# Every notebook under notebooks/ (subfolders included) must be stored executed and free of errors.
ALL_NOTEBOOKS = sorted(p for p in NOTEBOOK_DIR.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)


def _id(path: Path) -> str:
    return str(path.relative_to(NOTEBOOK_DIR))


def _load(path: Path) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def test_notebooks_exist_in_reading_order():
    names = [p.name for p in NOTEBOOKS]
    assert len(names) >= 6, f"expected the six numbered notebooks in {NOTEBOOK_DIR}, found {names}"
    numbers = [int(n[:2]) for n in names if n[2] == "_"]
    first = 0 if names[0] == "00_core_path.ipynb" else 1  # notebook 0 is the core path, before the numbered ones
    assert numbers == list(range(first, first + len(numbers))), \
        f"notebooks must be numbered 01, 02, ... without gaps (00 only for the core path): {names}"
    inserted = [n for n in names if n[2] != "_"]
    assert all(int(n[:2]) in numbers for n in inserted), f"a lettered notebook follows a numbered one: {inserted}"
    assert (NOTEBOOK_DIR / "README.md").is_file(), "notebooks/README.md lists the notebooks in reading order"


def test_appendix_notebooks_are_numbered_without_gaps():
    names = [p.name for p in APPENDIX]
    assert [int(n[1]) for n in names] == list(range(1, len(names) + 1)), f"appendix: A1, A2, ... without gaps: {names}"


@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=_id)
def test_every_code_cell_has_stored_outputs(path: Path):
    nb = _load(path)
    code = {i: c for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and _source(c).strip()}
    assert code, f"{_id(path)} has no code cells"
    empty = [i for i, c in code.items() if not c.get("outputs")]
    assert not empty, (f"{_id(path)}: code cell(s) {empty} have no stored output; execute the notebook and save "
                       "it with its outputs (jupyter nbconvert --to notebook --execute --inplace)")


@pytest.mark.parametrize("path", ALL_NOTEBOOKS, ids=_id)
def test_no_stored_output_is_an_error(path: Path):
    nb = _load(path)
    errors = []
    for i, cell in enumerate(nb["cells"]):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                errors.append(f"cell {i}: {out.get('ename')}: {out.get('evalue')}")
            elif out.get("output_type") == "stream" and out.get("name") == "stderr":
                text = "".join(out.get("text", ""))
                if "Traceback (most recent call last)" in text:
                    errors.append(f"cell {i}: traceback on stderr")
    assert not errors, f"{_id(path)} has stored errors: {errors}"


@pytest.mark.parametrize("path", NOTEBOOKS + APPENDIX, ids=_id)
def test_cells_were_executed_top_to_bottom(path: Path):
    nb = _load(path)
    counts = [c.get("execution_count") for c in nb["cells"] if c["cell_type"] == "code" and _source(c).strip()]
    assert counts == list(range(1, len(counts) + 1)), (
        f"{path.name}: execution counts {counts} are not 1, 2, 3, ...: run it top to bottom in a fresh kernel")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_id)
def test_every_numbered_notebook_has_a_figure(path: Path):
    """Where the prose explains a sequence, a picture stands beside it: at least one stored figure per lesson."""
    nb = _load(path)
    figures = sum("image/png" in out.get("data", {}) for c in nb["cells"] for out in c.get("outputs", []))
    assert figures >= 1, f"{path.name} has no figure (no image/png output)"


@pytest.mark.parametrize("path", NOTEBOOKS + APPENDIX, ids=_id)
def test_has_summary_and_exercises_headings(path: Path):
    nb = _load(path)
    headings = [line.strip("# ").strip() for c in nb["cells"] if c["cell_type"] == "markdown"
                for line in _source(c).splitlines() if re.match(r"^#{1,6}\s", line)]
    for wanted in ("Summary", "Exercises"):
        assert wanted in headings, f"{path.name} has no '{wanted}' markdown heading (headings: {headings})"
