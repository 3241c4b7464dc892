"""The files the package ships beside its code: the notebooks, and the example scripts notebook 4 reads.

A wheel carries them as package data (ddp_helpers/notebooks/, ddp_helpers/examples/); a source checkout has
them in its top-level notebooks/ and examples/. `ddp-helpers-notebooks DEST` copies both into DEST.
"""
from __future__ import annotations

from pathlib import Path
from typing import Dict

_PACKAGE = Path(__file__).resolve().parents[1]  # ddp_helpers/


def _shipped(folder: str, pattern: str) -> Path:
    """The installed package data folder, else the source checkout's top-level one; the first holding files."""
    for candidate in (_PACKAGE / folder, _PACKAGE.parent / folder):
        if any(candidate.glob(pattern)):
            return candidate
    raise FileNotFoundError(f"no {pattern} files in {_PACKAGE / folder} or {_PACKAGE.parent / folder}: this "
                            "ddp_helpers installation lacks them; reinstall it from a wheel or a checkout")


def notebook_source() -> Path:
    """The folder holding the notebooks (exercises/ and appendix/ inside it)."""
    return _shipped("notebooks", "*.ipynb")


def examples_source() -> Path:
    """The folder holding the example scripts (Listing 7.2 as printed, and fixed)."""
    return _shipped("examples", "*.py")


def list_notebooks(src: Path) -> Dict[str, Path]:
    """Every notebook under src (exercises/ and appendix/ included) by relative path; hidden folders skipped."""
    found = {}
    for path in sorted(src.rglob("*.ipynb")):
        rel = path.relative_to(src)
        if not any(part.startswith(".") for part in rel.parts):  # .ipynb_checkpoints/
            found[rel.as_posix()] = path
    return found


def list_examples(src: Path) -> Dict[str, Path]:
    """Every example script in src, by the relative path it gets beside the notebooks (examples/NAME.py)."""
    return {f"examples/{path.name}": path for path in sorted(src.glob("*.py"))}


def example_file(name: str) -> Path:
    """An example script as a notebook reads it: examples/NAME beside the notebook, else the package's copy.

    A folder made by ddp-helpers-notebooks has examples/ beside the notebooks (so a learner's edits there
    count); in the repository, notebooks/ has none and the top-level examples/ is used.
    """
    beside = Path("examples") / name  # relative to the kernel's folder, which is the notebook's
    if beside.is_file():
        return beside
    path = examples_source() / name
    if not path.is_file():
        shipped = sorted(p.name for p in examples_source().glob("*.py"))
        raise FileNotFoundError(f"no example {name!r} beside this notebook or in the package: it ships {shipped}")
    return path
