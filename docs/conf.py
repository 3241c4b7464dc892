"""Sphinx configuration of the tutorial's static site: `make site` -> docs/_build/html (offline, no execution).

The pages are the committed, executed notebooks: nothing is run at build time. The notebooks live in the
repository's notebooks/ (outside this folder), so each build first mirrors them into docs/notebooks/ (ignored
by git); the table of contents is built from what is there, in name order, so a new notebook needs no edit here.
"""
from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))

from site_notebooks import mirror_notebooks  # noqa: E402  (docs/_ext, on the path just above)

mirror_notebooks(DOCS.parent / "notebooks", DOCS / "notebooks")

project = "DDP from a notebook"
author = "ddp_helpers"
copyright = "ddp_helpers contributors"  # noqa: A001  (Sphinx's name for it)

# sphinx_copybutton: a copy button on each code block (the notebooks' cells and the shell lines), not on outputs.
# site_archive: the whole set as ddp-tutorial.zip (the notebooks and the package's source) and, on the index and
# every notebook page, where the package comes from and the one line that installs it.
extensions = ["myst_nb", "sphinx_copybutton", "site_notebooks", "static_widgets", "figure_alt", "site_archive"]
root_doc = "index"
exclude_patterns = ["_build", "_ext", "_templates", "**/.ipynb_checkpoints"]  # _ext: the extensions and the archive's README
nitpicky = True  # an unresolved reference is a warning, and `make site` turns warnings into errors

# The notebooks are stored executed; never run them here (that needs torch, minutes, and ranks).
nb_execution_mode = "off"
nb_merge_streams = True  # a rank-free parent prints in several chunks; show them as one block
# No widget JavaScript from a CDN: static_widgets draws the stored widget state as plain HTML at build time.
nb_ipywidgets_js = {}
myst_heading_anchors = 3  # "#summary"-style links inside a page resolve

# sphinx-book-theme (on pydata-sphinx-theme): made for notebook books. Its fonts, icons and scripts are files of
# the site (nothing from a CDN); the left sidebar (the table of contents) stays in view while a page scrolls and
# folds into a drawer on a phone; every page ends with previous/next links; a download button gives a notebook
# page's .ipynb (the stored notebook, with its outputs: html_copy_source) and a print to PDF.
html_theme = "sphinx_book_theme"
html_title = project
html_theme_options = {
    "use_download_button": True,
    "use_fullscreen_button": False,
    "use_repository_button": False,  # no repository address is named on the site
    "show_prev_next": True,
    "home_page_in_toc": True,
    "show_navbar_depth": 1,
    "navigation_with_keys": False,
}
html_static_path = ["_static"]
# _templates/search-button-field.html: the theme's search button with a name that says what it shows
# (see the file; pydata-sphinx-theme's to fix upstream, drafted in docs/maintainers.md).
templates_path = ["_templates"]
html_css_files = ["site.css"]
html_js_files = ["figures.js", "sidebar_toggle.js"]
html_show_sphinx = False
html_copy_source = True  # the download button's files: _sources/notebooks/NN_name.ipynb, the stored notebook
html_sourcelink_suffix = ""  # ...under their own name (Sphinx would add .txt)
html_show_sourcelink = False
copybutton_selector = "div.cell_input div.highlight pre, div.highlight-bash div.highlight pre, " \
                      "div.highlight-python div.highlight pre"


def _drop_theme_macros(app, exception) -> None:
    """pydata-sphinx-theme copies its Jinja macro files into _static/ unrendered: they are not pages (their
    links are template code), so they leave the built site."""
    if exception is None and app.builder.format == "html":
        for macros in Path(app.outdir, "_static").glob("*webpack-macros.html"):
            macros.unlink()


def setup(app) -> None:
    app.connect("build-finished", _drop_theme_macros)
