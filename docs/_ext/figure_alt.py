"""The site's figures keep their alt text: a notebook image output whose metadata holds "alt" gets it on its <img>.

A `ddp_helpers` Diagram puts its alt text in the output's metadata ({"image/png": {"alt": ...}}); JupyterLab has
no way to show it, and myst-nb reads only width and height from there. myst-nb names each image file after the
SHA-256 of its bytes, so after a notebook is read this extension finds each image node by that name and gives
it the alt text of the output it came from.
"""
from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Dict

from docutils import nodes


def alt_texts(notebook: dict) -> Dict[str, str]:
    """SHA-256 (hex) of each PNG output's bytes -> the alt text in that output's metadata."""
    found = {}
    for cell in notebook.get("cells", []):
        for out in cell.get("outputs", []):
            alt = out.get("metadata", {}).get("image/png", {}).get("alt")
            data = out.get("data", {}).get("image/png")
            if alt and data:
                raw = base64.b64decode("".join(data) if isinstance(data, list) else data)
                found[hashlib.sha256(raw).hexdigest()] = alt
    return found


def _give_alt(app, doctree) -> None:
    """Set the alt text of this page's notebook images that have one."""
    path = Path(app.env.doc2path(app.env.docname))
    if path.suffix != ".ipynb":
        return
    alts = alt_texts(json.loads(path.read_text(encoding="utf-8")))
    for node in doctree.findall(nodes.image):
        alt = alts.get(Path(node.get("uri", "")).stem)
        if alt:
            node["alt"] = alt


def setup(app):
    app.connect("doctree-read", _give_alt)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
