"""Re-execute the tutorial notebooks in place, the way they are committed (maintainers' tool).

    python tools/execute_notebooks.py                  # every notebook under notebooks/
    python tools/execute_notebooks.py notebooks/03_ddp_gradient_sync.ipynb

Runs each notebook top to bottom in its own folder with the python3 kernel, keeps the widget state (so
progress bars render on GitHub), merges consecutive stream outputs (how many chunks a print arrives in
varies between runs; nbval compares the merged text) and drops per-cell execution timestamps, so that a
re-run of unchanged code gives an unchanged file. Stops at the first failing cell.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
from typing import List, Optional

import nbformat
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parents[1]


def merge_streams(outputs: List[dict]) -> List[dict]:
    """Consecutive outputs of the same stream (stdout or stderr) joined into one."""
    merged: List[dict] = []
    for out in outputs:
        prev = merged[-1] if merged else None
        if (out.get("output_type") == "stream" and prev is not None and prev.get("output_type") == "stream"
                and prev.get("name") == out.get("name")):
            prev["text"] = "".join(prev["text"]) + "".join(out["text"])
        else:
            merged.append(out)
    return merged


def execute(path: pathlib.Path, timeout_s: int) -> None:
    """Execute one notebook and save it with its new outputs."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}},
                   store_widget_state=True).execute()
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # wall-clock timestamps: they would change on every run
        if cell.cell_type == "code":
            cell.outputs = [nbformat.from_dict(o) for o in merge_streams(cell.outputs)]
    nbformat.write(nb, path)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("notebooks", nargs="*", type=pathlib.Path, help="default: every notebook under notebooks/")
    p.add_argument("--timeout", type=int, default=900, help="seconds one cell may run")
    args = p.parse_args(argv)
    paths = args.notebooks or sorted(p for p in (ROOT / "notebooks").rglob("*.ipynb")
                                     if ".ipynb_checkpoints" not in p.parts)
    for path in paths:
        print(f"executing {path.relative_to(ROOT) if path.is_absolute() else path}", flush=True)
        execute(path.resolve(), args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
