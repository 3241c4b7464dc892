"""Notebook 13, "When it breaks": each entry's message is in its stored output, is still the installed torch's (or
Python's) own text, and is findable: a heading with its anchor, listed in the index, cited, and fixed by a cell
that asserts. The site's search is checked in tests/project/test_site.py.

The entries are listed in _breaks_catalog.py. A torch release that rewords a message fails the text test here
before anyone re-runs the notebook; the needles are fixed parts of each message (the parts a format leaves as
they are), looked up in the torch package's Python files or, for C++ messages, in its shared libraries.
"""
from __future__ import annotations

import ast
import errno
import functools
import json
import mmap
import os
import re
import sysconfig
from pathlib import Path
from typing import List, Tuple

import pytest

from _breaks_catalog import CUDA_SO, ENTRIES, NOTEBOOK, STAGES, Entry

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_PATH = ROOT / "notebooks" / f"{NOTEBOOK}.ipynb"
IDS = [e.heading.split(".")[0] for e in ENTRIES]


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else (value or "")


@functools.lru_cache(maxsize=1)
def _cells() -> List[dict]:
    return json.loads(NOTEBOOK_PATH.read_text(encoding="utf-8"))["cells"]


def _section(entry: Entry) -> Tuple[str, List[dict]]:
    """The entry's markdown (its heading cell and the prose after it) and its code cells, up to the next heading."""
    cells = _cells()
    start = next(i for i, c in enumerate(cells)
                 if c["cell_type"] == "markdown" and _text(c["source"]).startswith(f"### {entry.heading}\n"))
    prose, code = [_text(cells[start]["source"])], []
    for cell in cells[start + 1:]:
        source = _text(cell["source"])
        if cell["cell_type"] == "markdown":
            if source.startswith("#"):
                break
            prose.append(source)
        else:
            code.append(cell)
    return "\n".join(prose), code


def _outputs(cells: List[dict]) -> str:
    return "\n".join(_text(o.get("text")) or _text(o.get("data", {}).get("text/plain"))
                     for c in cells for o in c.get("outputs", []))


def test_the_catalog_covers_every_stage_with_enough_messages():
    assert [e.stage for e in ENTRIES] == sorted((e.stage for e in ENTRIES), key=STAGES.index), "entries in stage order"
    assert set(STAGES) == {e.stage for e in ENTRIES}
    provoked_on_cpu = [e for e in ENTRIES if e.provoked]
    assert len(ENTRIES) >= 25 and len(provoked_on_cpu) >= 25, (len(ENTRIES), len(provoked_on_cpu))
    assert len({e.anchor for e in ENTRIES}) == len(ENTRIES), "two entries with one anchor"
    assert [e.heading.split(".")[0] for e in ENTRIES] == [str(n) for n in range(1, len(ENTRIES) + 1)]


def test_the_index_links_every_entry_in_order():
    index = next(_text(c["source"]) for c in _cells() if _text(c["source"]).startswith("## Index of the messages"))
    links = [f"[{e.heading}](#{e.anchor})" for e in ENTRIES]
    at = [index.find(link) for link in links]
    assert all(i >= 0 for i in at), [link for link, i in zip(links, at) if i < 0]
    assert at == sorted(at)


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_the_entry_has_its_anchor_citation_cause_and_asserted_fix(entry: Entry):
    prose, code = _section(entry)
    assert f'<a name="{entry.anchor}"></a>' in prose, "the anchor JupyterLab follows (myst makes the same one)"
    assert f"Met in: <{entry.cited}>" in prose and entry.cited.startswith("https://")
    assert "**Cause.**" in prose and "**Fix.**" in prose
    assert len(code) >= 2, "a cell that provokes the message and one that runs the fix"
    assert "assert " in _text(code[-1]["source"]), "the fix's cell checks that it worked"
    if entry.gpu_text:
        quoted = " ".join(prose.replace("\n>", " ").split())  # a block quote's lines joined
        assert entry.gpu_text in quoted, "a GPU message is quoted as torch writes it"


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_the_stored_output_shows_the_message(entry: Entry):
    _, code = _section(entry)
    shown = _outputs(code)
    for text in (entry.shown, *entry.also_shown):
        assert text in shown, f"entry {entry.heading!r}: {text!r} is not in its stored output:\n{shown[:2000]}"


@functools.lru_cache(maxsize=None)
def _mapped(path: Path) -> mmap.mmap:
    """A shared library mapped read-only: find() reads only the pages it scans, never the file into memory."""
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _holder(where: str) -> Path:
    import torch  # imported here: the other tests of this file read only the notebook

    if where.startswith("stdlib:"):
        return Path(sysconfig.get_paths()["stdlib"]) / where.split(":", 1)[1]
    return Path(torch.__file__).parent / where


NEEDLES: List[Tuple[str, str, str]] = [(e.heading.split(".")[0], where, text) for e in ENTRIES
                                       for where, text in e.needles]


@pytest.mark.parametrize("entry_id, where, text", NEEDLES, ids=[f"{n}:{w}" for n, w, _ in NEEDLES])
def test_the_message_is_still_the_installed_text(entry_id: str, where: str, text: str):
    if where.startswith("strerror:"):  # the OS's words, which Python puts in FileNotFoundError
        assert os.strerror(getattr(errno, where.split(":")[1])) == text
        return
    path = _holder(where)
    if where == CUDA_SO and not path.exists():
        pytest.skip("a CPU-only torch has no libtorch_cuda.so: this GPU message is checked where one is installed")
    assert path.exists(), f"{path} is gone: entry {entry_id}'s message moved"
    if path.suffix == ".py":
        found = text in path.read_text(encoding="utf-8")
    else:
        found = _mapped(path).find(text.encode()) >= 0
    assert found, f"entry {entry_id}: {text!r} is no longer in {where}: a torch release reworded it"


def test_gpu_entries_say_which_text_is_run_here():
    for entry in (e for e in ENTRIES if e.gpu_text):
        prose, _ = _section(entry)
        assert "run here" in prose or "nothing reproduces it" in prose, entry.heading


def test_the_anchors_are_mysts_slugs():
    """The index's links resolve on the site only if they are the slugs myst makes of the headings."""
    from mdit_py_plugins.anchors.index import slugify  # myst's default heading_slug_func

    assert {e.anchor: slugify(e.heading) for e in ENTRIES} == {e.anchor: e.anchor for e in ENTRIES}


def test_the_packages_hints_name_entries_that_exist():
    """The package's own errors that match an entry name it ("see notebook 13, #anchor"): the anchor must exist."""
    anchors = {e.anchor for e in ENTRIES}
    hints = []
    for path in sorted((ROOT / "ddp_helpers").rglob("*.py")):
        # adjacent literals are one string constant once parsed (inside an f-string too)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                hints += [(path.name, a) for a in re.findall(r"see notebook 13, #([\w-]+)", node.value)]
    assert len(hints) >= 4, hints
    assert not [h for h in hints if h[1] not in anchors], [h for h in hints if h[1] not in anchors]
