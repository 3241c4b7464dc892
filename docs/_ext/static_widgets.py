"""Draw a notebook's stored ipywidgets state as plain HTML at build time, so widget outputs need no JavaScript.

myst-nb writes each widget output as a `<script type="application/vnd.jupyter.widget-view+json">` that only the
@jupyter-widgets/html-manager bundle (from a CDN) can draw. The site must work offline, so this extension
replaces those scripts with a static snapshot of the widget as the notebook last stored it: boxes, HTML, labels,
progress bars, buttons and inputs (shown disabled), and Output widgets' images and text. A model it does not
know is shown by name, so a new widget type is visible instead of silently blank.
"""
from __future__ import annotations

import html
import json
import re
from pathlib import Path
from typing import Dict

from docutils import nodes

VIEW_MIME = "application/vnd.jupyter.widget-view+json"
STATE_MIME = "application/vnd.jupyter.widget-state+json"
_VIEW_SCRIPT = re.compile(rf'^<script type="{re.escape(VIEW_MIME)}">(.*)</script>$', re.S)
_REF = "IPY_MODEL_"
_BAR_COLOURS = {"success": "#5cb85c", "info": "#5bc0de", "warning": "#f0ad4e", "danger": "#d9534f", "": "#2196f3"}


def widget_state(notebook: Path) -> Dict[str, dict]:
    """The notebook's stored widget models by id ({} when it stores none)."""
    meta = json.loads(notebook.read_text(encoding="utf-8")).get("metadata", {})
    return meta.get("widgets", {}).get(STATE_MIME, {}).get("state", {})


def _model(models: Dict[str, dict], ref: str) -> dict:
    return models.get(ref[len(_REF):] if ref.startswith(_REF) else ref, {})


def _description(models: Dict[str, dict], s: dict) -> str:
    text = s.get("description") or ""
    if not text:
        return ""
    width = _model(models, s.get("style") or "").get("state", {}).get("description_width") or ""
    style = f' style="width:{html.escape(width)}"' if width else ""
    return f'<span class="sw-description"{style}>{html.escape(text)}</span>'


def _output_html(out: dict) -> str:
    """One stored output of an Output widget: an image, or its text."""
    data = out.get("data", {})
    if "image/png" in data:
        alt = out.get("metadata", {}).get("image/png", {}).get("alt") or "a figure (no description was stored)"
        return (f'<img class="sw-image" alt="{html.escape(" ".join(alt.split()))}" '
                f'src="data:image/png;base64,{"".join(data["image/png"]).strip()}">')
    if out.get("output_type") == "stream":
        return f'<pre class="sw-text">{html.escape("".join(out.get("text", "")))}</pre>'
    if "text/plain" in data:
        return f'<pre class="sw-text">{html.escape("".join(data["text/plain"]))}</pre>'
    if out.get("output_type") == "error":
        return f'<pre class="sw-text">{html.escape(out.get("ename", ""))}: {html.escape(out.get("evalue", ""))}</pre>'
    return ""


def _name(name: str, s: dict) -> str:
    """A control's accessible name: its description, else its tooltip or placeholder, else what kind it is."""
    text = s.get("description") or s.get("tooltip") or s.get("description_tooltip") or s.get("placeholder")
    return html.escape(str(text or name.replace("Model", "").lower()), quote=True)


def render_widget(models: Dict[str, dict], model_id: str) -> str:
    """HTML for the stored widget `model_id` and its children."""
    model = _model(models, model_id)
    name, s = model.get("model_name", ""), model.get("state", {})
    desc = _description(models, s)
    if name in ("HBoxModel", "VBoxModel", "BoxModel", "GridBoxModel"):
        kids = "".join(render_widget(models, c) for c in s.get("children", []))
        kind = "sw-hbox" if name == "HBoxModel" else "sw-vbox"
        return f'<div class="sw-box {kind}">{kids}</div>'
    if name in ("HTMLModel", "HTMLMathModel"):
        return f'<div class="sw-row">{desc}<div class="sw-html">{s.get("value", "")}</div></div>'
    if name == "LabelModel":
        return f'<div class="sw-row">{desc}<span class="sw-label">{html.escape(str(s.get("value", "")))}</span></div>'
    if name in ("IntProgressModel", "FloatProgressModel"):
        lo, hi, value = s.get("min", 0), s.get("max", 100), s.get("value", 0)
        colour = _BAR_COLOURS.get(s.get("bar_style") or "", _BAR_COLOURS[""])
        return (f'<div class="sw-row">{desc}<progress class="sw-progress" style="accent-color:{colour}" '
                f'aria-label="{_name(name, s)}" max="{hi - lo}" value="{value - lo}">{value}/{hi}</progress></div>')
    if name in ("ButtonModel", "ToggleButtonModel"):
        return (f'<button class="sw-button sw-{html.escape(s.get("button_style") or "default")}" disabled '
                f'title="a snapshot: run the notebook to use it">{html.escape(s.get("description", ""))}</button>')
    if name in ("DropdownModel", "SelectModel", "RadioButtonsModel", "ToggleButtonsModel"):
        labels, index = s.get("_options_labels", []), s.get("index")
        opts = "".join(f'<option{" selected" if i == index else ""}>{html.escape(str(t))}</option>'
                       for i, t in enumerate(labels))
        return (f'<div class="sw-row">{desc}<select class="sw-input" aria-label="{_name(name, s)}" disabled>'
                f'{opts}</select></div>')
    if name.endswith("TextModel") or name.endswith("SliderModel") or name == "CheckboxModel":
        value = html.escape(str(s.get("value", "")))
        kind = ' type="checkbox"' + (" checked" if s.get("value") else "") if name == "CheckboxModel" else ""
        return (f'<div class="sw-row">{desc}<input class="sw-input"{kind} aria-label="{_name(name, s)}" disabled '
                f'value="{value}"></div>')
    if name == "OutputModel":
        return f'<div class="sw-output">{"".join(_output_html(o) for o in s.get("outputs", []))}</div>'
    return f'<div class="sw-unknown">[{html.escape(name or "missing widget")}]</div>'


def _replace_views(app, doctree: nodes.document, docname: str) -> None:
    """Swap each widget-view script of this page for the static snapshot of its widget."""
    views = [n for n in doctree.findall(nodes.raw) if _VIEW_SCRIPT.match(n.astext().strip())]
    if not views:
        return
    models = widget_state(Path(app.env.doc2path(docname)))
    for node in views:
        view = json.loads(_VIEW_SCRIPT.match(node.astext().strip()).group(1))
        snapshot = render_widget(models, view["model_id"])
        node.replace_self(nodes.raw("", f'<div class="static-widget">{snapshot}</div>', format="html"))


def _drop_state_script(app, pagename, templatename, context, doctree) -> None:
    """The stored state only feeds the widget JavaScript, which the site does not load: leave it out."""
    script_files = context.get("script_files")
    if script_files:
        context["script_files"] = [s for s in script_files
                                   if getattr(s, "attributes", {}).get("type") != STATE_MIME]


def setup(app):
    app.connect("doctree-resolved", _replace_views)
    app.connect("html-page-context", _drop_state_script, priority=900)  # after myst-nb adds its scripts
    return {"parallel_read_safe": True, "parallel_write_safe": True}
