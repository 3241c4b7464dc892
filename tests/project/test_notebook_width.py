"""Every code line of every notebook fits JupyterLab's default width: at most 100 characters.

A longer line makes the learner scroll sideways in Lab (issue 44). Break such a line inside brackets, move a
trailing comment onto its own line above the statement, or split a long string into adjacent literals.
The teacher's nbgrader source is checked too: the learners' exercises notebook is generated from it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAX_CHARS = 100
NOTEBOOKS = sorted(p for p in (ROOT / "notebooks").rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
NOTEBOOKS.append(ROOT / "teacher" / "nbgrader" / "source" / "ddp_exercises" / "exercises.ipynb")


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _too_long(path: Path) -> List[str]:
    """'cell C, line L (N chars): start of the line' for each code line over MAX_CHARS."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    found = []
    for c, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        for n, line in enumerate(source.splitlines(), start=1):
            if len(line) > MAX_CHARS:
                found.append(f"cell {c}, line {n} ({len(line)} chars): {line[:60].strip()}...")
    return found


def test_the_notebooks_are_found():
    assert len(NOTEBOOKS) > 10 and all(p.is_file() for p in NOTEBOOKS), NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_id)
def test_code_lines_fit_the_default_width(path: Path):
    long_lines = _too_long(path)
    assert not long_lines, (f"{_id(path)}: {len(long_lines)} code line(s) over {MAX_CHARS} characters "
                            "(cells counted from 0, lines from 1):\n  " + "\n  ".join(long_lines))
