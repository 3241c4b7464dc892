"""The site's whole-set download and install line: ddp-tutorial.zip (every notebook and the package's source, so
`pip install ".[vision]"` works in its folder: the package is not on PyPI), written into the built site, and a note
naming it on the index and on every notebook page. The archive's README is its own (archive_readme.md, for a reader
with pip and no repository), not the repository's, whose make targets need files the archive leaves out."""
from __future__ import annotations

import html
import zipfile
from pathlib import Path
from typing import List

ARCHIVE = "ddp-tutorial.zip"
TOP = "ddp-tutorial"  # the folder the archive unpacks into
INSTALL = 'pip install ".[vision]"'  # one line that runs every notebook: the listing's script needs torchvision
# What `pip install .` reads (pyproject.toml's packages and package-dir: the notebooks and examples travel in the
# wheel) and the recorded pins; nothing of the tests, the docs or the teachers' files. README.md is written from
# README_SOURCE (pyproject.toml's readme: pip needs one); notebooks/README.md is for maintainers (as in the wheel).
CONTENTS = ("pyproject.toml", "requirements-recorded.txt", "ddp_helpers", "notebooks", "examples")
README_SOURCE = Path(__file__).with_name("archive_readme.md")
LEFT_OUT = ("notebooks/README.md",)
SKIPPED_PARTS = {"__pycache__", ".ipynb_checkpoints"}
FIXED_TIME = (2020, 1, 1, 0, 0, 0)  # the same bytes for the same files: rebuilds don't churn the download


def archive_files(root: Path) -> List[Path]:
    """The files under root that go into the archive, in a stable order."""
    found: List[Path] = []
    for name in CONTENTS:
        path = root / name
        paths = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        found += [p for p in paths if not SKIPPED_PARTS & set(p.relative_to(root).parts)
                  and p.suffix not in (".pyc", ".tmp") and not p.name.startswith(".")
                  and p.relative_to(root).as_posix() not in LEFT_OUT]
    return found


def write_archive(root: Path, dest: Path) -> Path:
    """dest: a zip of archive_files(root) under TOP/."""
    entries = [("README.md", README_SOURCE.read_bytes())]
    entries += [(path.relative_to(root).as_posix(), path.read_bytes()) for path in archive_files(root)]
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in entries:
            info = zipfile.ZipInfo(f"{TOP}/{name}", FIXED_TIME)
            info.compress_type, info.external_attr = zipfile.ZIP_DEFLATED, 0o644 << 16
            zf.writestr(info, data)
    return dest


def note_html(href: str) -> str:
    """Where the package comes from and the one line that installs it, with the archive's link."""
    return (f'<div class="admonition note ddp-install"><p class="admonition-title">Run these notebooks yourself'
            f'</p><p>The <code>ddp_helpers</code> package is not on PyPI: download <a href="{href}">{ARCHIVE}'
            f'</a> (every notebook and the package\'s source), unzip it, and in its folder <code>{TOP}</code> '
            f'run <code>{html.escape(INSTALL)}</code>; then <code>jupyter lab notebooks</code>. Its README says '
            'what that downloads and how to keep a CPU-only torch. A notebook run without the package stops at its '
            'first cell, naming this archive.</p></div>\n')


def _add_note(app, pagename: str, templatename: str, context: dict, doctree) -> None:
    if doctree is not None and (pagename == app.config.root_doc or pagename.startswith("notebooks/")):
        context["body"] = note_html(context["pathto"](ARCHIVE, 1)) + context["body"]


def _write(app, exception) -> None:
    if exception is None and app.builder.format == "html":
        write_archive(Path(app.srcdir).parent, Path(app.outdir) / ARCHIVE)


def setup(app):
    app.connect("html-page-context", _add_note)
    app.connect("build-finished", _write)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
