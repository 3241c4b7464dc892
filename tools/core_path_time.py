"""How long notebook 0's core path takes its learner, counted from the notebook: words and code lines per cell, at
the rates docs/maintainers.md states ("The core path's time"), plus the time to write the two classes.

    python tools/core_path_time.py            # the minutes per stop and per part, then the total
    python tools/core_path_time.py --minutes  # the rounded figure alone (what the README and notebook 0 state)

The core path is every cell before the "## Second reading" heading, less the optional ones: the "Stuck?" boxes
(a worked class, opened only when stuck) and the exercises at the end.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "00_core_path.ipynb"
PROSE_WPM = 100  # words a minute: a learner new to DDP, where each paragraph brings a term, a call or an output
CODE_LPM = 10  # code lines a minute: read, and matched with the prose that explains them
OUTPUT_LPM = 20  # printed output lines a minute: scanned for the figure the prose points at
FIGURE_MIN = 1.0  # minutes a figure: read with the paragraph that says how
RUN_MIN = 1.0  # the cells' own run time (under a minute on a 2-core VM: docs/benchmarks.md) and the kernel's start
WRITING_MIN = {"AfterBackward": 10.0, "AsGradientsArrive": 20.0}  # write, check, read a hint, fix, check again
ROUND_TO = 5


def core_cells(nb: dict) -> list:
    """The core path's cells: those before the second reading, less the optional ones."""
    cells = []
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and source.startswith("## Second reading"):
            break
        optional = "<details>" in source or source.startswith("## Exercises")
        if not optional:
            cells.append({**cell, "source": source})
    return cells


def _output_lines(cell: dict) -> int:
    """Lines a cell printed (its stored outputs; figures are counted apart)."""
    lines = 0
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        if out.get("output_type") == "stream":
            lines += len("".join(out["text"]).splitlines())
        elif "text/plain" in data and "image/png" not in data:
            lines += len("".join(data["text/plain"]).splitlines())
    return lines


def cell_parts(cell: dict) -> list:
    """(stop, words, code lines, output lines, figures) for each part of a cell; a markdown cell that opens a
    stop ("## Stop 3") midway gives the words before the heading to the stop before."""
    if cell["cell_type"] == "markdown":
        parts, stop = [], None
        for piece in re.split(r"(?m)^(?=## Stop \d)", cell["source"]):
            heading = re.match(r"## Stop (\d)", piece)
            parts.append((int(heading.group(1)) if heading else stop, len(re.findall(r"\S+", piece)), 0, 0, 0))
        return parts
    lines = sum(1 for line in cell["source"].splitlines() if line.strip())
    figures = sum(1 for out in cell.get("outputs", []) if "image/png" in out.get("data", {}))
    return [(None, 0, lines, _output_lines(cell), figures)]


def _minutes(words: int, lines: int, output: int, figures: int) -> float:
    return words / PROSE_WPM + lines / CODE_LPM + output / OUTPUT_LPM + figures * FIGURE_MIN


def estimate(path: Path = NOTEBOOK) -> dict:
    """The totals: words, code lines, output lines, figures; the minutes each part and each stop take."""
    cells = core_cells(json.loads(path.read_text(encoding="utf-8")))
    rows, stop = [], 0  # stop 0: the introduction, before stop 1
    for cell in cells:
        for part_stop, *counts in cell_parts(cell):
            stop = part_stop if part_stop is not None else stop
            rows.append((stop, *counts))
    words, lines, output, figures = (sum(r[i] for r in rows) for i in range(1, 5))
    parts = {"reading prose": words / PROSE_WPM, "reading code": lines / CODE_LPM,
             "reading output": output / OUTPUT_LPM, "figures": figures * FIGURE_MIN, "running": RUN_MIN,
             "writing": sum(WRITING_MIN.values())}
    stops = {s: sum(_minutes(*r[1:]) for r in rows if r[0] == s) for s in sorted({r[0] for r in rows})}
    total = sum(parts.values())
    return {"cells": len(cells), "words": words, "code lines": lines, "output lines": output, "figures": figures,
            "parts": parts, "stops": stops, "total": total, "stated": ROUND_TO * round(total / ROUND_TO)}


def main() -> None:
    """Print the table and the figure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", action="store_true", help="print the rounded figure alone")
    args = parser.parse_args()
    result = estimate()
    if args.minutes:
        print(result["stated"])
        return
    for stop, minutes in result["stops"].items():
        print(f"  {'introduction' if stop == 0 else f'stop {stop}':<14} {minutes:5.1f} min read")
    print(f"{result['cells']} core cells: {result['words']:,} words at {PROSE_WPM}/min, {result['code lines']} code "
          f"lines at {CODE_LPM}/min, {result['output lines']} output lines at {OUTPUT_LPM}/min, "
          f"{result['figures']} figures at {FIGURE_MIN:g} min")
    for part, minutes in result["parts"].items():
        print(f"  {part:<14} {minutes:5.1f} min")
    print(f"total {result['total']:.1f} min; stated: about {result['stated']} minutes")


if __name__ == "__main__":
    main()
