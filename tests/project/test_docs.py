"""The Markdown docs: the README stays short, links to local files resolve, the module map names every module."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Iterator, List, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200  # issue #28: the README is for learners; maintainer detail lives in docs/
PACKAGE = ROOT / "ddp_helpers"
MODULE_MAP = ROOT / "docs" / "architecture.md"
# The Markdown files a reader follows links in, on GitHub or in a checkout (docs/ pages are also site pages).
# benchmarks/history/ holds the benchmark logs, out of docs/ and the site (issue 60).
LINKED_DOCS = ["README.md", "notebooks/README.md", *sorted(p.relative_to(ROOT).as_posix()
                                                           for p in (ROOT / "docs").glob("*.md")),
               *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "benchmarks" / "history").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """The text without fenced code blocks and code spans (a link written as code is not a link)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _links(text: str) -> Iterator[str]:
    yield from (m.group(1) for m in _LINK.finditer(_prose(text)))


def _slug(heading: str) -> str:
    """GitHub's (and myst's) anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(md: Path) -> List[str]:
    return [_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", _FENCE.sub("", md.read_text()), re.M)]


def _broken_links(doc: Path) -> Tuple[List[str], int]:
    """(broken local links of doc, local links checked)."""
    broken, checked = [], 0
    for target in _links(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto: ...: not a local file
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        checked += 1
        if not file.exists():
            broken.append(f"{target} -> no such file {file.relative_to(ROOT) if ROOT in file.parents else file}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target} -> no heading with anchor #{anchor} in {file.name}")
    return broken, checked


def test_readme_is_at_most_200_lines():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, (f"README.md has {n} lines, more than {README_MAX_LINES}: it is for learners; "
                                   "move maintainer detail to a page in docs/ and link it")


def test_readme_links_to_local_files_resolve():
    broken, checked = _broken_links(ROOT / "README.md")
    assert checked >= 3, f"only {checked} local links found in README.md: is the link pattern still right?"
    assert not broken, "README.md has broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("name", [n for n in LINKED_DOCS if n != "README.md"])
def test_other_markdown_links_to_local_files_resolve(name):
    broken, _ = _broken_links(ROOT / name)
    assert not broken, f"{name} has broken links:\n" + "\n".join(broken)


def test_link_checker_sees_a_broken_link(tmp_path):
    """The checker itself: a missing file and a missing anchor are reported, code is not read as a link."""
    (tmp_path / "there.md").write_text("# A heading (`x.py`)\n")
    doc = tmp_path / "doc.md"
    doc.write_text("[ok](there.md#a-heading-xpy) [gone](missing.md) [bad](there.md#nope) [web](https://x.org)\n"
                   "`[code](missing.md)`\n```\n[fenced](missing.md)\n```\n")
    broken, checked = _broken_links(doc)
    assert checked == 3, broken
    assert [b.split(" ->")[0] for b in broken] == ["missing.md", "there.md#nope"]


def _sections(text: str) -> dict:
    """docs/architecture.md's module tables, by folder: {"engine": "...", "lesson/figures": "..."}."""
    parts = re.split(r"^### `([a-z_]+(?:/[a-z_]+)*)/`\s*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def test_module_map_names_every_module():
    """Each subpackage has a section in docs/architecture.md naming each of its modules; top-level modules too."""
    text = MODULE_MAP.read_text(encoding="utf-8")
    sections = _sections(text)
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if path.name == "__init__.py" or "notebooks" in rel.parts:
            continue
        if len(rel.parts) == 1:
            if f"`ddp_helpers/{rel.as_posix()}`" not in text:
                missing.append(f"ddp_helpers/{rel.as_posix()} (not named in the folder table)")
            continue
        folder = "/".join(rel.parts[:-1])
        if folder not in sections:
            missing.append(f"ddp_helpers/{folder}/ (no '### `{folder}/`' section)")
        elif f"`{path.name}`" not in sections[folder] and f"`{path.stem}`" not in sections[folder]:
            missing.append(f"ddp_helpers/{rel.as_posix()} (not in the '### `{folder}/`' section)")
    for folder in sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()):
        if f"`ddp_helpers/{folder}/`" not in text:
            missing.append(f"ddp_helpers/{folder}/ (not in the folder table)")
    assert not missing, ("docs/architecture.md, the maintainers' module map, misses:\n" + "\n".join(missing)
                         + "\nadd each with its one responsibility (read its docstring)")


def test_module_map_lists_no_module_that_is_gone():
    """Every module a folder's table of docs/architecture.md describes still exists."""
    gone = [f"ddp_helpers/{folder}/{name}"
            for folder, section in _sections(MODULE_MAP.read_text(encoding="utf-8")).items()
            for name in re.findall(r"^\| `([a-z_]+\.py)` \|", section, re.M)
            if not (PACKAGE / folder / name).is_file()]
    assert not gone, "docs/architecture.md describes modules that no longer exist: " + ", ".join(gone)


def test_the_readmes_first_screen_gives_the_two_commands_what_they_download_how_long_and_where_next():
    """Issue 62: the first screen hid the ~6 GB install and every duration. Its first 25 lines (a screen) hold
    the two commands, the download's size, durations, and the next step."""
    first = "\n".join((ROOT / "README.md").read_text(encoding="utf-8").splitlines()[:25])
    for needed in ("make demo", "make test", "4.5 GB", "minutes", "make lab", "00_core_path.ipynb"):
        assert needed in first, f"the README's first screen doesn't say {needed!r}"
