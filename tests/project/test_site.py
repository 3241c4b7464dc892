"""The static site: Sphinx + myst-nb build it from the executed notebooks, offline, with warnings as errors.

One build per test session (into a temporary folder, the same command as `make site`), then: every notebook
has a page in name order; every relative link and image resolves (anchors included); nothing is loaded from the
network; widget outputs are static HTML; and headless Chromium draws a notebook page with its figures, loads
nothing from outside the site and clips no code line (the screenshot goes to $DDP_HELPERS_ARTIFACTS).
"""
from __future__ import annotations

import html.parser
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Set, Tuple
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
CHROMIUM = os.environ.get("DDP_HELPERS_CHROMIUM", "/usr/bin/chromium")  # as in tests/project/test_browser.py
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(os.environ.get("DDP_HELPERS_ARTIFACTS", Path(tempfile.gettempdir()) / "ddp_helpers-artifacts"))


def _notebooks() -> List[str]:
    """The notebooks' paths relative to notebooks/, without .ipynb, skipping hidden folders."""
    return sorted(p.relative_to(NOTEBOOKS).with_suffix("").as_posix() for p in NOTEBOOKS.rglob("*.ipynb")
                  if not any(part.startswith(".") for part in p.relative_to(NOTEBOOKS).parts))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The built site's folder (docs/_build/html's equivalent)."""
    out = tmp_path_factory.mktemp("site")
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html",
           "-d", str(out / "doctrees"), str(ROOT / "docs"), str(out / "html")]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"sphinx failed ({' '.join(cmd)}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    print(f"site built in {time.monotonic() - started:.1f} s")
    return out / "html"


class _Page(html.parser.HTMLParser):
    """Collects a page's links (tag, attribute, value), its element ids and its <script>/<link> resources."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: List[Tuple[str, str, str]] = []
        self.ids: Set[str] = set()
        self.text: List[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for key in ("id", "name"):
            if a.get(key):
                self.ids.add(a[key])
        for key in ("href", "src"):
            if a.get(key) is not None:
                self.refs.append((tag, key, a[key]))

    def handle_data(self, data):
        self.text.append(data)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def _pages(site: Path) -> Dict[Path, _Page]:
    return {p: _parse(p) for p in sorted(site.rglob("*.html"))}


@pytest.mark.slow
def test_every_notebook_has_a_page_in_name_order(site):
    names = _notebooks()
    assert names, "no notebooks found"
    for name in names:
        assert (site / "notebooks" / f"{name}.html").is_file(), f"no page for notebooks/{name}.ipynb"
    index = _parse(site / "index.html")
    linked = [v[len("notebooks/"):-len(".html")] for tag, key, v in index.refs
              if tag == "a" and v.startswith("notebooks/") and v.endswith(".html")]
    linked = list(dict.fromkeys(linked))  # the sidebar repeats the table of contents
    top = [n for n in names if "/" not in n]
    assert linked[:len(top)] == top, f"the index should list the notebooks in name order first: {linked}"
    assert set(linked) == set(names), f"notebooks missing from the index: {sorted(set(names) - set(linked))}"
    assert "benchmarks.html" in [v for _, _, v in index.refs], "docs/benchmarks.md is not in the site"


@pytest.mark.slow
def test_every_internal_link_and_image_resolves(site):
    pages = _pages(site)
    broken, checked = [], 0
    for path, page in pages.items():
        for tag, key, value in page.refs:
            parts = urlsplit(value)
            if parts.scheme or value.startswith("//") or (not parts.path and not parts.fragment):
                continue  # external (checked below not to be loaded), data: URIs, or an empty href
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            checked += 1
            if not target.is_file():
                broken.append(f"{path.relative_to(site)}: <{tag} {key}={value!r}> -> missing file")
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                if unquote(parts.fragment) not in ids:
                    broken.append(f"{path.relative_to(site)}: <{tag} {key}={value!r}> -> no such anchor")
    assert checked > 50, f"only {checked} internal links found: is the site empty?"
    assert not broken, f"{len(broken)} broken internal links:\n" + "\n".join(broken[:30])


class _Images(html.parser.HTMLParser):
    """Collects a page's <img> tags as (src, alt)."""

    def __init__(self) -> None:
        super().__init__()
        self.images: List[Tuple[str, str]] = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            a = dict(attrs)
            self.images.append((a.get("src") or "", a.get("alt") or ""))


def _figure_alt():
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    import figure_alt

    return figure_alt


def test_alt_texts_are_read_from_the_outputs_metadata():
    """figure_alt maps each PNG output's SHA-256 to the alt text its metadata holds; outputs without one are left."""
    import base64
    import hashlib

    png = b"\x89PNG fake bytes"
    data = base64.b64encode(png).decode()
    nb = {"cells": [{"outputs": [{"data": {"image/png": data}, "metadata": {"image/png": {"alt": "a ring"}}},
                                 {"data": {"image/png": data[:8]}, "metadata": {}}]},
                    {"cell_type": "markdown"}]}
    assert _figure_alt().alt_texts(nb) == {hashlib.sha256(png).hexdigest(): "a ring"}


@pytest.mark.slow
def test_every_diagram_keeps_its_alt_text_on_the_site(site):
    """Each notebook output whose metadata carries alt text (a ddp_helpers Diagram) is an <img> with that alt."""
    import json

    checked, missing = 0, []
    for name in _notebooks():
        alts = _figure_alt().alt_texts(json.loads((NOTEBOOKS / f"{name}.ipynb").read_text(encoding="utf-8")))
        parser = _Images()
        parser.feed((site / "notebooks" / f"{name}.html").read_text(encoding="utf-8"))
        for digest, alt in alts.items():
            checked += 1
            if not any(digest in src and a == " ".join(alt.split()) for src, a in parser.images):
                missing.append(f"{name}: {alt[:60]}...")
    assert checked >= 6, f"only {checked} diagrams with alt text found in the notebooks"
    assert not missing, "diagrams without their alt text on the site:\n" + "\n".join(missing)


@pytest.mark.slow
def test_nothing_is_loaded_from_the_network(site):
    """Scripts, style sheets, images and fonts all come from the site's own files (it works offline)."""
    remote = []
    for path, page in _pages(site).items():
        for tag, key, value in page.refs:
            if tag != "a" and re.match(r"(https?:)?//", value):
                remote.append(f"{path.relative_to(site)}: <{tag} {key}={value}>")
    for css in site.rglob("*.css"):
        for m in re.finditer(r"(@import\s+(url\()?|url\()\s*['\"]?((https?:)?//[^'\")\s]+)", css.read_text()):
            remote.append(f"{css.relative_to(site)}: {m.group(3)}")
    assert not remote, "the site loads from the network:\n" + "\n".join(remote)


@pytest.mark.slow
def test_widget_outputs_are_drawn_without_javascript(site):
    """Notebooks that store widget state show it as static HTML: no CDN bundle, no unrendered widget script."""
    pages = [site / "notebooks" / f"{n}.html" for n in _notebooks()
             if '"application/vnd.jupyter.widget-view+json"' in (NOTEBOOKS / f"{n}.ipynb").read_text()]
    assert pages, "no notebook stores a widget output (then this test has nothing to check)"
    for page in pages:
        text = page.read_text(encoding="utf-8")
        assert "application/vnd.jupyter.widget" not in text, f"{page.name}: a widget script is left in the page"
        assert text.count('class="static-widget"') >= 1, f"{page.name}: no static widget snapshot"
        assert "sw-unknown" not in text, f"{page.name}: a widget type the snapshot cannot draw"
        assert re.search(r'<progress class="sw-progress"[^>]*max="\d+(\.\d+)?" value="\d', text), page.name


def _browser_modules():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (Debian package chromium; run .ci/install_browser.sh)")
    return pytest.importorskip("playwright.sync_api", reason="the playwright package is missing (run "
                                                             ".ci/install_browser.sh)")


def _figure_page(site: Path) -> Path:
    """The first notebook page with an image output (a matplotlib figure)."""
    for name in _notebooks():
        page = site / "notebooks" / f"{name}.html"
        if re.search(r'<img [^>]*src="[^"]*_images/', page.read_text(encoding="utf-8")):
            return page
    pytest.fail("no notebook page has a figure")


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_a_page_in_headless_chromium(site, capsys):
    """A notebook page drawn by Chromium from file://: its figures load, it is not blank, no line is clipped."""
    sync_api = _browser_modules()
    from PIL import Image, ImageStat

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "site.png"
    page_path = _figure_page(site)
    outside: List[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})

            def only_files(route):  # offline: anything not from the site's own files is refused and recorded
                if route.request.url.startswith(("file://", "data:")):
                    route.continue_()
                else:
                    outside.append(route.request.url)
                    route.abort()

            page.route("**/*", only_files)
            page.goto(page_path.as_uri(), wait_until="load")
            images = page.eval_on_selector_all("div.cell_output img", "els => els.map(e => [e.naturalWidth, "
                                               "e.naturalHeight, e.getBoundingClientRect().width])")
            page.locator("div.cell_output img").first.scroll_into_view_if_needed()
            page.screenshot(path=str(shot))
            clipped, overflowing = [], []
            for width in (1280, 760):  # a laptop and a narrow window: long lines wrap in both
                page.set_viewport_size({"width": width, "height": 900})
                clipped += page.eval_on_selector_all(
                    "pre", "els => els.filter(e => e.scrollWidth > e.clientWidth + 1)"
                           ".map(e => e.textContent.slice(0, 80))")
                if page.evaluate("document.documentElement.scrollWidth > window.innerWidth + 1"):
                    overflowing.append(width)
        finally:
            browser.close()
    assert not outside, f"the page asked the network for {outside}"
    assert images and all(w > 100 and h > 100 and shown > 100 for w, h, shown in images), images
    assert not clipped, f"code or output lines cut off: {clipped}"
    assert not overflowing, f"the page is wider than a window {overflowing} px wide (something pushes it sideways)"
    pixels = Image.open(shot).convert("L")
    assert pixels.size == (1280, 900)
    stat = ImageStat.Stat(pixels)
    assert stat.stddev[0] > 20, f"the screenshot looks blank (grey-level spread {stat.stddev[0]:.1f})"
    colours = Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 20) or []
    assert len(colours) > 50, f"only {len(colours)} colours in the screenshot: no figure drawn?"
    with capsys.disabled():
        print(f"\nscreenshot: {shot} ({page_path.relative_to(site)})")


def test_table_of_contents_follows_the_notebooks_folder(tmp_path):
    """New notebooks, an appendix/ and removed notebooks need no edit in docs/: the mirror and the toc follow."""
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        from site_notebooks import mirror_notebooks, toc_markdown
    finally:
        sys.path.remove(str(ROOT / "docs" / "_ext"))
    src, dest = tmp_path / "notebooks", tmp_path / "docs" / "notebooks"
    for rel in ("10_last.ipynb", "02_b.ipynb", "appendix/a_panel.ipynb", "exercises/exercises.ipynb",
                ".ipynb_checkpoints/02_b-checkpoint.ipynb"):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text("{}")
    (dest / "gone").mkdir(parents=True)
    (dest / "gone" / "old.ipynb").write_text("{}")  # a notebook since removed from notebooks/
    names = mirror_notebooks(src, dest)
    assert names == ["02_b.ipynb", "10_last.ipynb", "appendix/a_panel.ipynb", "exercises/exercises.ipynb"]
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*")) == [
        "02_b.ipynb", "10_last.ipynb", "appendix", "appendix/a_panel.ipynb", "exercises", "exercises/exercises.ipynb"]
    toc = toc_markdown(names)
    order = [toc.index(s) for s in (":caption: Notebooks", "notebooks/02_b\n", "notebooks/10_last\n",
                                    ":caption: Appendix", "notebooks/appendix/a_panel\n", ":caption: Exercises",
                                    "notebooks/exercises/exercises\n")]
    assert order == sorted(order), toc
    assert ":caption: Appendix" not in toc_markdown(["01_a.ipynb"]), "an empty section must not be listed"
