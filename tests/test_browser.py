"""Real-browser test: JupyterLab runs notebooks/07_control_panel.ipynb in headless Chromium, then we press Train.

Needs Debian's chromium (/usr/bin/chromium) and the Playwright Python package (never `playwright install`:
it would download a browser of its own); `.ci/install_browser.sh` installs both. Skips cleanly without them.
Screenshots go to $DDP_HELPERS_ARTIFACTS (default: <tmp>/ddp_helpers-artifacts); their paths are printed.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "07_control_panel.ipynb"
CHROMIUM = os.environ.get("DDP_HELPERS_CHROMIUM", "/usr/bin/chromium")  # Debian's package
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(os.environ.get("DDP_HELPERS_ARTIFACTS", Path(tempfile.gettempdir()) / "ddp_helpers-artifacts"))
# JupyterLab user settings for the test: nothing autosaves into the repository, every cell is in the DOM
# (no virtualized notebook), and no news or update toasts cover the page.
LAB_SETTINGS = {
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                        "checkForUpdates": False},
}

if not os.path.exists(CHROMIUM):
    pytest.skip(f"{CHROMIUM} is missing (Debian package chromium; run .ci/install_browser.sh)",
                allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is missing (run "
                                                             ".ci/install_browser.sh)")
pytest.importorskip("jupyterlab")
pytest.importorskip("ipywidgets")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.load(r)


def _stop_tree(proc: subprocess.Popen, children: List) -> None:
    """End the server and whatever it started (by pid: only processes this test started)."""
    import psutil

    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the server's own session (start_new_session=True), nothing else
        proc.wait(10)
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(children, timeout=5)


@contextmanager
def jupyterlab(tmp: Path) -> Iterator[str]:
    """A JupyterLab server on 127.0.0.1 serving notebooks/, with a token; yields its base URL with the token."""
    import psutil

    settings = tmp / "settings"
    for rel, value in LAB_SETTINGS.items():
        f = settings / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(value))
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
               JUPYTER_DATA_DIR=str(tmp / "data"), JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"), IPYTHONDIR=str(tmp / "ipython"))
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
           f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
           f"--ServerApp.root_dir={ROOT / 'notebooks'}"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")  # CI containers often run as root; Jupyter refuses that without the flag
    log_path = tmp / "jupyterlab.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    children: List = []
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited with code {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                _get(f"{base}/api/status?token={token}", timeout=2)
                break
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not answer within 90 s:\n{log_path.read_text()[-3000:]}")
                time.sleep(0.3)
        yield f"{base}|{token}"
    finally:
        try:
            children = psutil.Process(proc.pid).children(recursive=True)  # the kernel (and any rank it forked)
        except psutil.NoSuchProcess:
            children = []
        try:  # the clean way: the server shuts its kernels down, then exits
            urllib.request.urlopen(urllib.request.Request(f"{base}/api/shutdown?token={token}", method="POST"),
                                   timeout=5).close()
            proc.wait(20)
        except (urllib.error.URLError, OSError, subprocess.TimeoutExpired):
            pass
        _stop_tree(proc, children)
        log.close()


@contextmanager
def chromium(tmp: Path):
    """Debian's Chromium, headless, with a fresh profile, driven by Playwright; closed whatever happens."""
    pw = sync_api.sync_playwright().start()
    try:
        context = pw.chromium.launch_persistent_context(
            str(tmp / "chromium-profile"),  # a fresh --user-data-dir (Playwright passes it for us)
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS, viewport={"width": 1400, "height": 1000})
        try:
            yield context.pages[0] if context.pages else context.new_page()
        finally:
            context.close()
    finally:
        pw.stop()  # ends Playwright's driver process


def _menu(page, menu: str, item: str) -> None:
    page.click(f".lm-MenuBar-itemLabel:text-is('{menu}')")
    page.click(f".lm-Menu-itemLabel:text-is('{item}')")


def _prompts(page) -> List[str]:
    return page.eval_on_selector_all(".jp-CodeCell .jp-InputPrompt", "els => els.map(e => e.textContent.trim())")


def _kernels_idle(base: str, token: str) -> bool:
    kernels = _get(f"{base}/api/kernels?token={token}")
    return bool(kernels) and all(k["execution_state"] == "idle" for k in kernels)


def _wait(what: str, condition, timeout: float, page=None) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            if page is not None:
                page.screenshot(path=str(ARTIFACTS / "browser-timeout.png"))
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what} (screenshot: "
                        f"{ARTIFACTS / 'browser-timeout.png'})")
        time.sleep(0.5)


@pytest.mark.timeout(600)
def test_control_panel_notebook_in_jupyterlab(tmp_path, capsys):
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    n_code = sum(1 for c in nb["cells"] if c["cell_type"] == "code")
    original = NOTEBOOK.read_bytes()
    checkpoints = NOTEBOOK.parent / ".ipynb_checkpoints"  # JupyterLab writes one when it opens a notebook
    had_checkpoints = set(checkpoints.iterdir()) if checkpoints.is_dir() else None
    try:
        with jupyterlab(tmp_path) as server, chromium(tmp_path) as page:
            base, token = server.split("|")
            page.set_default_timeout(60_000)
            page.goto(f"{base}/lab/tree/{NOTEBOOK.name}?token={token}")
            page.wait_for_selector(".jp-NotebookPanel .jp-CodeCell")
            _wait("the kernel to start", lambda: _kernels_idle(base, token), 120, page)
            assert len(_prompts(page)) == n_code

            # Clear the stored outputs first, so everything checked below comes from this run.
            _menu(page, "Edit", "Clear Outputs of All Cells")
            _wait("cleared prompts", lambda: not any(re.search(r"\d", p) for p in _prompts(page)), 30, page)
            _menu(page, "Run", "Run All Cells")
            _wait("every code cell to run", lambda: all(re.fullmatch(r"\[\d+\]:", p) for p in _prompts(page))
                  and _kernels_idle(base, token), 300, page)
            assert [int(p[1:-2]) for p in _prompts(page)] == list(range(1, n_code + 1))

            errors = page.locator('[data-mime-type="application/vnd.jupyter.error"]').count()
            stderr = page.eval_on_selector_all('.jp-RenderedText[data-mime-type="application/vnd.jupyter.stderr"]',
                                               "els => els.map(e => e.textContent)")
            assert errors == 0, "a cell produced an error output"
            assert not [t for t in stderr if "Traceback" in t], f"a traceback on stderr: {stderr}"

            # plot_losses and plot_grad_norms as images, then the same two in the panel's Output widget.
            widths = page.eval_on_selector_all(".jp-RenderedImage img", "els => els.map(e => e.naturalWidth)")
            assert len(widths) >= 4 and all(w > 100 for w in widths), widths

            text = page.inner_text(".jp-NotebookPanel")
            assert "Loading widget" not in text and "Error displaying widget" not in text
            assert page.locator(".jp-NotebookPanel .jupyter-widgets").count() >= 10
            train = page.locator(".jp-NotebookPanel button.widget-button:has-text('Train')")
            assert train.count() == 1
            for label in ("world size", "backend", "dataset", "batch size", "lr", "epochs"):
                assert page.locator(f".jp-NotebookPanel .widget-label:text-is('{label}')").count() == 1, label
            assert page.locator(".jp-NotebookPanel .widget-hprogress").count() == 2  # the notebook's run: 2 ranks
            assert "run 2 finished: 32 steps per rank on 2 rank(s)" in text

            # Now press Train in the browser: the kernel trains again and the bars and plots are redrawn.
            train.scroll_into_view_if_needed()
            train.click()
            status = page.locator(".jp-NotebookPanel .widget-html:has-text('run 3 ')")
            status.wait_for(timeout=120_000)
            _wait("the browser-started run to finish",
                  lambda: "finished" in status.inner_text() or "failed" in status.inner_text(), 120, page)
            assert "run 3 finished: 32 steps per rank on 2 rank(s)" in status.inner_text()
            labels = page.eval_on_selector_all(".jp-NotebookPanel .widget-hprogress + .widget-label",
                                               "els => els.map(e => e.textContent)")
            assert labels == ["32/32 steps", "32/32 steps"], labels
            _wait("the panel's plots", lambda: page.locator(".jp-NotebookPanel .jupyter-widgets "
                                                            ".jp-RenderedImage img").count() == 2, 30, page)

            page.locator(".jp-NotebookPanel .widget-html:has-text('DDP training control panel')").evaluate(
                "e => e.scrollIntoView({block: 'start'})")  # the whole panel: settings, bars, plots
            page.screenshot(path=str(ARTIFACTS / "browser.png"))
            page.locator(".jp-RenderedImage img").first.scroll_into_view_if_needed()
            page.screenshot(path=str(ARTIFACTS / "browser-plots.png"))
            with capsys.disabled():
                print(f"\nscreenshots: {ARTIFACTS / 'browser.png'} {ARTIFACTS / 'browser-plots.png'}")
    finally:
        if checkpoints.is_dir():  # leave notebooks/ as we found it
            for f in set(checkpoints.iterdir()) - (had_checkpoints or set()):
                f.unlink()
            if had_checkpoints is None and not any(checkpoints.iterdir()):
                checkpoints.rmdir()
        if NOTEBOOK.read_bytes() != original:  # autosave is off; this guards the committed notebook anyway
            NOTEBOOK.write_bytes(original)
            pytest.fail(f"{NOTEBOOK.name} was modified by the browser session (restored)")
