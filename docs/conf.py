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

extensions = ["myst_nb", "site_notebooks", "static_widgets", "figure_alt"]
root_doc = "index"
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]
nitpicky = True  # an unresolved reference is a warning, and `make site` turns warnings into errors

# The notebooks are stored executed; never run them here (that needs torch, minutes, and ranks).
nb_execution_mode = "off"
nb_merge_streams = True  # a rank-free parent prints in several chunks; show them as one block
# No widget JavaScript from a CDN: static_widgets draws the stored widget state as plain HTML at build time.
nb_ipywidgets_js = {}
myst_heading_anchors = 3  # "#summary"-style links inside a page resolve

html_theme = "alabaster"  # ships with Sphinx; no web fonts or scripts from the network
html_static_path = ["_static"]
html_css_files = ["site.css"]
html_theme_options = {
    "page_width": "1020px",  # below this the sidebar moves under the page; site.css lets the page grow to 1340px
    "sidebar_width": "220px",
    "font_family": "system-ui, -apple-system, 'Segoe UI', sans-serif",
    "head_font_family": "system-ui, -apple-system, 'Segoe UI', sans-serif",
    "code_font_family": "ui-monospace, 'SFMono-Regular', Menlo, Consolas, monospace",
    "show_powered_by": False,
}
html_show_sphinx = False
html_sidebars = {"**": ["about.html", "navigation.html", "relations.html", "searchbox.html"]}
html_show_sourcelink = False
html_copy_source = False
