"""Notebook 0's time is one figure, said the same everywhere, and the one tools/core_path_time.py counts (issue 58)."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import core_path_time  # noqa: E402  (tools/ is not a package)

PLACES = ["README.md", "notebooks/README.md", "docs/index.md"]


def _notebook_intro() -> str:
    nb = json.loads((ROOT / "notebooks" / "00_core_path.ipynb").read_text(encoding="utf-8"))
    return "".join(nb["cells"][0]["source"])


def _core_path_minutes(text: str) -> list:
    """Every 'about N minutes' said of the core path (a heading, a table row or a sentence naming it)."""
    found = []
    for paragraph in re.split(r"\n\s*\n", text):
        if re.search(r"core path|Notebook 0|It takes about", paragraph):
            found += [int(n) for n in re.findall(r"about (\d+) minutes", paragraph)]
    return found


def test_every_place_states_the_counted_figure_and_no_other():
    stated = core_path_time.estimate()["stated"]
    for name, text in [(p, (ROOT / p).read_text(encoding="utf-8")) for p in PLACES] + [
            ("notebook 0, cell 0", _notebook_intro())]:
        minutes = _core_path_minutes(text)
        assert minutes and set(minutes) == {stated}, f"{name} says {minutes}; the count is {stated}"


def test_the_count_leaves_out_the_second_reading_the_stuck_boxes_and_the_exercises():
    nb = json.loads((ROOT / "notebooks" / "00_core_path.ipynb").read_text(encoding="utf-8"))
    core = core_path_time.core_cells(nb)
    sources = [c["source"] for c in core]
    assert not [s for s in sources if "<details>" in s or s.startswith(("## Exercises", "## Second reading"))]
    assert not [s for s in sources if "Reducer::" in s], "the internals belong to the second reading"
    heads = ["".join(c["source"]) for c in nb["cells"]]
    second = next(i for i, s in enumerate(heads) if s.startswith("## Second reading"))
    assert heads.index(next(s for s in heads if s.startswith("## Summary"))) < second
    result = core_path_time.estimate()
    assert result["parts"]["writing"] == 30 and 60 < result["total"] < 120
