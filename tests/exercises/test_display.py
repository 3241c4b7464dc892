"""How a verdict is shown: coloured HTML with a bold verdict in Jupyter, the plain line elsewhere; hints wrap
between words (in Chromium, under JupyterLab's own rule for printed output)."""
from __future__ import annotations

import os
import textwrap

import pytest

from ddp_helpers.exercises._display import VerdictView
from ddp_helpers.exercises._harness import NOT_DONE, CheckResult

CHROMIUM = os.environ.get("DDP_HELPERS_CHROMIUM", "/usr/bin/chromium")
LONG_HINT = ("the ranks returned different values: each rank must all_reduce its own local sum and count, "
             "then divide the summed total by the summed count, so that every rank ends with the same "
             "global mean of all the samples (print what each rank holds before and after the all_reduce)")


@pytest.mark.parametrize("result, verdict, color", [
    (CheckResult("global_mean", True, "every rank got the global mean"), "PASS", "#1a7f37"),
    (CheckResult("global_mean", False, "divide by the count", mistake="no_divide"), "TRY AGAIN", "#b42318"),
    (CheckResult("global_mean", False, "replace the line", mistake=NOT_DONE), "NOT DONE YET", "#9a6700"),
])
def test_each_verdict_has_its_colour_and_a_bold_word(result, verdict, color):
    view = result.view()
    assert repr(view) == result.message == f"{verdict}  global_mean: {result.hint}"  # the plain text is unchanged
    page = view._repr_html_()
    assert f'style="color: {color}; font-weight: 700; font-size: 1.2em' in page, page
    assert f">{verdict}</span> global_mean: {result.hint}</div>" in page
    assert f"border-left: 4px solid {color}" in page


def test_the_html_escapes_the_hint():
    page = VerdictView("TRY AGAIN", "x", "a <b> & `c`")._repr_html_()
    assert "a &lt;b&gt; &amp; `c`" in page and "<b>" not in page


def test_outside_ipython_the_check_prints_its_line(capsys):
    from ddp_helpers.exercises import EXERCISES

    def init_group(rank, world_size):
        pass  # an empty body: judged NOT DONE YET without starting a rank

    result = EXERCISES["init_group"](init_group)
    assert capsys.readouterr().out == result.message + "\n"


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_in_a_jupyter_kernel_the_verdict_is_html_with_the_line_as_its_text():
    from tests._kernel import cell_outputs

    outputs = cell_outputs(textwrap.dedent("""
        from ddp_helpers.exercises import EXERCISES

        def init_group(rank, world_size):
            pass

        result = EXERCISES["init_group"](init_group)
    """))
    assert [o["msg_type"] for o in outputs] == ["display_data"], outputs  # no stream: one rich output
    data = outputs[0]["data"]
    assert data["text/plain"].startswith("NOT DONE YET  init_group: the function body is still empty"), data
    assert '<div class="ddp-verdict"' in data["text/html"] and ">NOT DONE YET</span>" in data["text/html"]


def _browser():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing (Debian package chromium; run .ci/install_browser.sh)")
    return pytest.importorskip("playwright.sync_api", reason="the playwright package is missing (run "
                                                             ".ci/install_browser.sh)")


# JupyterLab 4's rule for printed output (jlab_core's .jp-OutputArea-output pre), and an HTML output's box.
LAB_CSS = """
body { font: 13px sans-serif; margin: 0 }
.jp-OutputArea-output { width: 330px }
.jp-OutputArea-output pre { white-space: pre-wrap; word-break: break-all; overflow-x: auto; margin: 0 }
"""
BREAKS = """el => {
    const text = el.textContent, range = document.createRange(), walker = document.createTreeWalker(el, 4);
    const breaks = [];
    let top = null, offset = 0;
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        for (let i = 0; i < node.length; i++) {
            range.setStart(node, i); range.setEnd(node, i + 1);
            const rect = range.getClientRects()[0];
            if (rect && top !== null && rect.top > top + 2) breaks.push(text.slice(offset + i - 1, offset + i + 1));
            if (rect) top = rect.top;
        }
        offset += node.length;
    }
    return breaks;
}"""


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_long_hint_wraps_between_words_where_a_printed_line_breaks_inside_them():
    sync_api = _browser()
    view = VerdictView("TRY AGAIN", "global_mean", LONG_HINT)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 400, "height": 600})
            page.set_content(f"<style>{LAB_CSS}</style><div class='jp-OutputArea-output' id='html'>"
                             f"{view._repr_html_()}</div><div class='jp-OutputArea-output'><pre id='pre'>"
                             f"{repr(view)}</pre></div>")
            html_breaks = page.eval_on_selector("#html .ddp-verdict", BREAKS)
            pre_breaks = page.eval_on_selector("#pre", BREAKS)
            word = page.eval_on_selector("#html .ddp-verdict-word", "e => [getComputedStyle(e).fontWeight, "
                                         "getComputedStyle(e).color]")
        finally:
            browser.close()
    assert len(html_breaks) >= 3, html_breaks  # the hint does wrap at this width
    assert all(" " in pair for pair in html_breaks), f"a line of the HTML verdict broke inside a word: {html_breaks}"
    assert any(" " not in pair for pair in pre_breaks), f"the control case should break inside words: {pre_breaks}"
    assert word == ["700", "rgb(180, 35, 24)"], word
