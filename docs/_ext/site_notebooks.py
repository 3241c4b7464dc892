"""The site's notebook pages: mirror notebooks/ into the Sphinx source folder and list them in the index."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import List

from ddp_helpers.common.shipped import list_notebooks  # the same notebooks the wheel ships

# Sections of the table of contents, in order: (caption, folder under notebooks/). Each lists its *.ipynb by name.
SECTIONS = [("Notebooks", ""), ("Appendix", "appendix"), ("Exercises", "exercises")]
PLACEHOLDER = "<!-- notebook-toc -->"  # docs/index.md's line that the tables of contents replace
MIRROR = "notebooks"  # the mirror's folder under docs/, and the page names' prefix


def mirror_notebooks(src: Path, dest: Path) -> List[str]:
    """Make dest hold exactly src's notebooks; unchanged files keep their mtime so rebuilds stay incremental."""
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is missing: the site is built from the repository's notebooks/ folder")
    wanted = list_notebooks(src)
    dest.mkdir(parents=True, exist_ok=True)
    for rel, path in wanted.items():
        target = dest / rel
        if not target.exists() or target.read_bytes() != path.read_bytes():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
    for old in sorted(dest.rglob("*"), reverse=True):  # files first, then the folders they leave empty
        rel = old.relative_to(dest).as_posix()
        if old.is_file() and rel not in wanted:
            old.unlink()
        elif old.is_dir() and not any(old.iterdir()):
            old.rmdir()
    return sorted(wanted)


def toc_markdown(names: List[str]) -> str:
    """MyST toctrees, one per non-empty section, for the notebooks' relative paths `names`."""
    blocks = []
    for caption, folder in SECTIONS:
        pages = sorted(n[: -len(".ipynb")] for n in names if Path(n).parent.as_posix() == (folder or "."))
        if pages:
            entries = "\n".join(f"{MIRROR}/{p}" for p in pages)
            blocks.append(f"```{{toctree}}\n:caption: {caption}\n:maxdepth: 1\n\n{entries}\n```\n")
    return "\n".join(blocks)


def _fill_toc(app, docname: str, source: List[str]) -> None:
    """Put the tables of contents into the index; links to the repository's README point at the index."""
    source[0] = source[0].replace("](../README.md)", f"]({app.config.root_doc}.md)")  # the README isn't a page
    if docname == app.config.root_doc and PLACEHOLDER in source[0]:
        names = sorted(list_notebooks(Path(app.srcdir) / MIRROR))
        source[0] = source[0].replace(PLACEHOLDER, toc_markdown(names))


def setup(app):
    app.connect("source-read", _fill_toc)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
