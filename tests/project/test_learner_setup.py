"""The learner's own set-up: the recorded torch pinned in one file that make env and the package agree on, an
install that keeps a torch satisfying the floor, make env's visible progress, make lab as root, and a notebook
opened without the package stopping at its first cell with the install line."""
from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import threading
import tomllib
import zipfile
from pathlib import Path
from typing import List

import nbformat
import pytest

from ddp_helpers.common import recorded

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PINS = dict(re.findall(r"^([a-z_-]+)==(\S+)$", (ROOT / "requirements-recorded.txt").read_text(), re.M))
NOTEBOOKS = sorted((ROOT / "notebooks").rglob("*.ipynb")) + [
    ROOT / "teacher" / "nbgrader" / "source" / "ddp_exercises" / "exercises.ipynb"]


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _floor(name: str) -> str:
    reqs = PYPROJECT["project"]["dependencies"] + PYPROJECT["project"]["optional-dependencies"]["vision"]
    return next(r.split(">=")[1].split(",")[0].strip() for r in reqs if r.startswith(f"{name}>="))


def _version(text: str) -> tuple:
    return tuple(int(x) for x in text.split("+")[0].split("."))


def test_the_recorded_torch_is_pinned_once_and_the_package_reads_the_same():
    assert PINS["torch"] == recorded.RECORDED_TORCH, "requirements-recorded.txt and common/recorded.py differ"
    assert _version(_floor("torch")) <= _version(PINS["torch"]), "the floor is above the recorded torch"
    assert _version(_floor("torchvision")) <= _version(PINS["torchvision"])
    assert f"torch>={_floor('torch')}" in recorded.torch_differs_note("2.0.0"), "the note names another floor"
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"install -e \"\.\[test,teacher,vision\]\" -c requirements-recorded\.txt", make), "no -c"
    assert "pyproject.toml requirements-recorded.txt" in make, "make env isn't re-done when the pins change"


def test_the_note_names_a_torch_other_than_the_recorded_one():
    assert recorded.torch_differs_note(recorded.RECORDED_TORCH) is None
    assert recorded.torch_differs_note(recorded.RECORDED_TORCH + "+cpu") is None  # a local build tag is the same
    note = recorded.torch_differs_note("2.13.0+cpu")
    assert note.count("\n") == 0 and "2.13.0+cpu" in note and recorded.RECORDED_TORCH in note, note


def test_no_note_on_a_torch_the_outputs_were_checked_on_and_the_sanitizer_drops_it_elsewhere():
    """Issue 62: on torch 2.15.0 the note failed 18 cells of a learner's nbval run, whose outputs otherwise held.
    On a checked torch there is no line; on any other nbval's sanitizer (the documented command's) removes it
    and compares the rest of the cell."""
    from nbval.plugin import get_sanitize_patterns

    assert all(recorded.torch_differs_note(v) is None for v in recorded.CHECKED_TORCH)
    assert recorded.torch_differs_note("2.15.0+cpu") is None
    make = (ROOT / "Makefile").read_text()
    ceiling = re.search(r"^CEILING_TORCH \?= torch==(\S+)$", make, re.M)
    assert ceiling and ceiling[1] in recorded.CHECKED_TORCH, "make test-ceiling runs a torch the note doesn't know"
    note = recorded.torch_differs_note("2.16.0")
    assert note.startswith(recorded.NOTE_START), note
    rules = get_sanitize_patterns((ROOT / "notebooks" / "nbval_sanitize.cfg").read_text())
    def sanitized(text: str) -> str:
        for regex, replace in rules:
            text = re.sub(regex, replace, text)
        return text
    stored = "Setting up, once per kernel.\ndataset=mnist-5k backend=gloo\n"
    assert sanitized(note + "\n" + stored) == sanitized(stored), sanitized(note + "\n" + stored)
    assert sanitized(stored.replace("gloo", "nccl")) != sanitized(stored), "the rest is still compared"


def test_warm_up_prints_one_line_for_another_torch(monkeypatch, capsys):
    from ddp_helpers.ranks import startmethod

    monkeypatch.setattr(recorded, "installed_torch", lambda: "2.13.0+cpu")
    monkeypatch.setattr(startmethod, "resolve_start_method", lambda _: "spawn")  # no forkserver: only the note
    startmethod.warm_up()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and "torch 2.13.0+cpu here" in lines[0], lines
    monkeypatch.setattr(recorded, "installed_torch", lambda: recorded.RECORDED_TORCH)
    startmethod.warm_up()
    assert capsys.readouterr().out == ""


def _fake_wheel(folder: Path, name: str, version: str, requires: str = "") -> None:
    """A wheel of `name` that pip would take over the installed one if it upgraded it (it never installs here)."""
    dist = f"{name}-{version}"
    needs = f"Requires-Dist: {requires}\n" if requires else ""
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as zf:
        zf.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{needs}")
        zf.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: "
                                                "py3-none-any\n")
        zf.writestr(f"{dist}.dist-info/RECORD", "")


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_an_install_keeps_a_torch_that_satisfies_the_floor(tmp_path):
    """pip's resolution of the package's wheel's requirements in this environment (make test-floor: torch
    2.13.0+cpu), offered newer torch and torchvision: it installs neither (--dry-run --report lists what it would)."""
    wheel = _tool("pip_user").cached_wheel()
    links = tmp_path / "links"
    links.mkdir()
    _fake_wheel(links, "torch", "99.0")
    _fake_wheel(links, "torchvision", "99.0", "torch==99.0")  # as PyPI's newest torchvision pins the newest torch
    def would_install(*requirements: str) -> list:
        report = tmp_path / "report.json"
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links",
                               str(links), "--report", str(report), "-q", *requirements], capture_output=True,
                              text=True, env={**os.environ, "PIP_CONSTRAINT": os.devnull})  # no machine-wide cap
        assert proc.returncode == 0, proc.stderr[-3000:]
        return sorted(item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"])

    with zipfile.ZipFile(wheel) as zf:  # the wheel's own requirements (this environment may hold the package)
        metadata = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    needs = [r for r in re.findall(r"^Requires-Dist: (.+)$", metadata, re.M) if "extra ==" not in r]
    assert any(r.startswith("torch>=") for r in needs), needs
    assert not any(r.startswith("torchvision") for r in needs), "a required torchvision brings its own torch"
    assert would_install("torch>=99") == ["torch"], "pip doesn't see the newer torch offered: the test proves nothing"
    assert would_install(*needs) == [], "installing the package would replace torch or torchvision"


@pytest.mark.slow
def test_make_test_ceiling_stops_with_its_reason_where_pip_refuses_the_torch(tmp_path):
    """Where pip can't install the ceiling's torch the target says so and exits 77 (skipped), running nothing."""
    venv = tmp_path / "ceiling"
    proc = subprocess.run(["make", "test-ceiling", f"CEILING_VENV={venv}", "CEILING_TORCH=torch==0.0.0.dev0",
                           f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PIP_NO_INDEX": "1"})  # offline, and at once: no index to ask
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Error 77" in out, out
    assert "SKIPPED, nothing was run: pip here can't install torch==0.0.0.dev0" in out, out
    assert "No matching distribution" in out, "pip's own reason is shown"
    assert "test-ceiling: torch" not in out and not (venv / "ceiling.txt").exists(), "it went on"


def test_make_env_says_what_it_downloads_and_how_much():
    progress = _tool("pip_progress")
    fresh = progress.torch_estimate(None, "Linux", "x86_64")
    assert "4.5 GB" in fresh and "CUDA" in fresh, fresh
    assert "GB" in progress.torch_estimate(None, "Darwin", "arm64")
    assert "2.13.0+cpu is already installed" in progress.torch_estimate("2.13.0+cpu", "Linux", "x86_64")


class _Terminal(io.StringIO):
    """The terminal make env prints to; leaves a marker file for each status line, so the fake pip goes on."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder, self.lines = folder, 0

    def write(self, text: str) -> int:
        if text.startswith("  ... "):
            self.lines += 1
            (self.folder / f"status{self.lines}").touch()
        return super().write(text)


def test_a_quiet_pip_gets_status_lines_naming_the_file_and_the_bytes_so_far(tmp_path):
    """While pip fetches a large file and prints nothing, a line names the file and how much of it has come, and
    the next says more (issue 62: the same line had repeated for 10 minutes)."""
    progress = _tool("pip_progress")
    log = tmp_path / "install.log"
    wait = ("def wait(name):\n    deadline = time.monotonic() + 60\n"
            f"    while not os.path.exists(os.path.join({str(tmp_path)!r}, name)):\n"
            "        time.sleep(0.02)\n        if time.monotonic() > deadline: sys.exit(3)\n")
    fake_pip = ("import os, sys, time\n" + wait + "print('Collecting torch', flush=True)\nprint('noise', flush=True)\n"
                "print('  Downloading torch-2.15.0-cp311-cp311-manylinux_2_28_x86_64.whl (900.0 MB)', flush=True)\n"
                "print('Progress 300000000 of 900000000', flush=True)\nwait('status1')\n"
                "print('Progress 600000000 of 900000000', flush=True)\nwait('status2')\n"
                "print('Successfully installed torch-2.15.0', flush=True)\n")
    out = _Terminal(tmp_path)
    status = progress.run(log, [sys.executable, "-c", fake_pip], status_s=0.2, out=out, site_packages=tmp_path)
    shown = out.getvalue()
    assert status == 0, shown
    assert "Collecting torch" in shown and "noise" not in shown and "Successfully installed" in shown, shown
    first, second = [line for line in shown.splitlines() if line.startswith("  ... ")][:2]
    assert "torch-2.15.0-cp311" in first and "300.0 MB of 900.0 MB (33%)" in first, first
    assert "600.0 MB of 900.0 MB (67%)" in second, second
    assert "noise" in log.read_text() and "Progress" not in log.read_text(), "the log keeps pip's lines, not counts"


def test_the_status_line_says_the_phase_and_how_much_so_far(tmp_path):
    progress = _tool("pip_progress").Progress(tmp_path)
    for line in ("Collecting torch", "Collecting numpy"):
        progress.read(line)
    assert "resolving: 2 packages collected" in progress.status(65), progress.status(65)
    assert "1 min 05 s" in progress.status(65)
    progress.read("  Downloading numpy-2.4.6-cp311.whl (16.0 MB)")
    progress.read("Progress 16000000 of 16000000")
    progress.read("Installing collected packages: numpy")
    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "core.so").write_bytes(b"x" * 2_500_000)
    assert "installing: 2.5 MB written into the venv" in progress.status(70), progress.status(70)


def test_make_env_asks_pip_for_byte_counts_where_it_has_them(monkeypatch):
    progress = _tool("pip_progress")
    monkeypatch.setattr(progress, "pip_version", lambda python: (26, 3))
    assert progress.with_raw_progress(["py", "-m", "pip", "install", "-e", "."])[3:6] == [
        "install", "--progress-bar", "raw"]
    monkeypatch.setattr(progress, "pip_version", lambda python: (23, 2))  # no raw bar: pip's own lines only
    assert progress.with_raw_progress(["py", "-m", "pip", "install", "."]) == ["py", "-m", "pip", "install", "."]


def _fake_id(tmp_path: Path, uid: int) -> dict:
    bin_dir = tmp_path / f"uid{uid}"
    bin_dir.mkdir()
    (bin_dir / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    (bin_dir / "id").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


@pytest.mark.parametrize("uid", [0, 1000])
def test_make_lab_allows_root_in_a_container(tmp_path, uid):
    dry = subprocess.run(["make", "-n", "-o", "env", "lab"], cwd=ROOT, env=_fake_id(tmp_path, uid),
                         capture_output=True, text=True, check=True).stdout
    line = next(x for x in dry.splitlines() if "jupyter lab" in x)
    assert (("--allow-root" in line and "--no-browser" in line) if uid == 0 else "--allow-root" not in line), line


def _first_lines(source: str) -> str:
    """A first cell's import guard: its lines up to the first blank line."""
    return source.split("\n\n", 1)[0]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_a_notebook_without_the_package_stops_at_its_first_cell_with_the_install_line(path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert "Recorded with torch " + recorded.RECORDED_TORCH in nb.cells[0].source, "the first markdown cell"
    monkeypatch.setitem(sys.modules, "ddp_helpers", None)  # `import ddp_helpers` raises ImportError
    with pytest.raises(RuntimeError, match=r"not installed: download ddp-tutorial\.zip .*`pip install \"\.\[vision\]\"`") as e:
        exec(compile(_first_lines(first.source), str(path), "exec"), {})
    assert e.value.__cause__ is None and e.value.__suppress_context__, "the ImportError would be shown too"
    monkeypatch.delitem(sys.modules, "ddp_helpers")
    exec(compile(_first_lines(first.source), str(path), "exec"), {})  # with the package: nothing happens


def test_the_agent_store_flag_is_kept_from_another_endpoint_before_torch_2_14(monkeypatch):
    """torch < 2.14 (no rendezvous._agent_store_serves): a rank's own tcp:// store is made without the flag, the
    launcher's MASTER_ADDR:MASTER_PORT with it, and the flag is back afterwards."""
    import types

    from ddp_helpers.ranks.env import gate_agent_store_flag

    seen = []
    old = types.ModuleType("torch.distributed.rendezvous")  # 2.13's: _create_c10d_store reads the flag itself
    old._create_c10d_store = lambda host, port, *a, **k: seen.append(os.environ.get("TORCHELASTIC_USE_AGENT_STORE"))
    monkeypatch.setitem(sys.modules, "torch.distributed.rendezvous", old)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29400")
    gate_agent_store_flag()
    gate_agent_store_flag()  # once only
    old._create_c10d_store("127.0.0.1", 29401, 0, 2, None)
    old._create_c10d_store("127.0.0.1", 29400, 0, 2, None)
    assert seen == [None, "True"] and os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True", seen
    new = types.ModuleType("torch.distributed.rendezvous")  # 2.14's checks the endpoint itself: left alone
    new._agent_store_serves = new._create_c10d_store = object()
    monkeypatch.setitem(sys.modules, "torch.distributed.rendezvous", new)
    gate_agent_store_flag()
    assert new._create_c10d_store is new._agent_store_serves


# Run by the venv's own python: each notebook top to bottom in its own folder, as `jupyter lab notebooks` would run
# it (the kernel is the venv's: ipykernel's own spec for the interpreter running this), over Unix sockets (no port
# to race for beside the other tests' kernels; tools/nbval_ipc.py says why).
_EXECUTE = """
import os, sys, tempfile, uuid
import nbformat
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient
for path in sys.argv[1:]:
    nb = nbformat.read(path, as_version=4)
    km = KernelManager(kernel_name="python3", transport="ipc",
                       ip=os.path.join(tempfile.gettempdir(), f"zip-{uuid.uuid4().hex[:12]}-ipc"))
    NotebookClient(nb, km=km, timeout=600, resources={"metadata": {"path": os.path.dirname(path)}}).execute()
    print("ran", os.path.basename(path), "cells:", sum(c.cell_type == "code" for c in nb.cells), flush=True)
"""


def _documented_install(readme: str) -> List[str]:
    """The commands of the first shell block under the zip README's "Install and open"."""
    section = readme.split("## Install and open", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


@pytest.mark.timeout(900)
@pytest.mark.slow
def test_the_zips_documented_install_runs_notebooks_00_and_04_in_an_empty_folder(tmp_path):
    """Issue 62: the zip's `pip install .` left the listing's script cells failing, and its README was the
    repository's (make targets). Here: the zip unpacked into an empty folder, its README's install line run in a
    fresh venv, then notebooks 00 and 04 top to bottom with that venv's kernel. Offline: the venv sees this test
    environment's packages (a .pth line naming its site-packages: torch, torchvision, jupyter, ...), pip gets
    --no-index and --no-build-isolation (this environment's setuptools builds the package), so only the package
    itself is installed, from the unpacked folder."""
    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    import site_archive

    empty = tmp_path / "empty"
    empty.mkdir()
    archive = site_archive.write_archive(ROOT, tmp_path / site_archive.ARCHIVE)
    with zipfile.ZipFile(archive) as zf:
        zf.extractall(empty)
    folder = empty / site_archive.TOP
    readme = (folder / "README.md").read_text()
    assert "make " not in readme and "pins.txt" not in readme, "the zip's README names what it doesn't carry"
    install, opens = _documented_install(readme)
    assert install == site_archive.INSTALL == 'pip install ".[vision]"' and opens == "jupyter lab notebooks"

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "test_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_CONSTRAINT")}
    env["JUPYTER_PATH"] = env["JUPYTER_DATA_DIR"] = str(tmp_path / "jupyter")  # no kernel spec but the venv's own
    pip_args = shlex.split(install)[1:] + ["--no-index", "--no-build-isolation", "-q"]
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), *pip_args], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    where = subprocess.run([str(python), "-c", "import ddp_helpers, torchvision; print(ddp_helpers.__file__)"],
                           cwd=empty, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(venv), f"the kernel would import ddp_helpers from {where}"
    notebooks = [str(folder / "notebooks" / name) for name in ("00_core_path.ipynb", "04_two_process_mnist.ipynb")]
    proc = subprocess.run([str(python), "-c", _EXECUTE, *notebooks], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=840)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    assert proc.stdout.count("ran ") == 2, proc.stdout
