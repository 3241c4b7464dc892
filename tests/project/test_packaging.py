"""Packaging: environment.yml and pyproject.toml list the same dependencies; the public API imports lazily;
a wheel installed outside the repository carries the notebooks and the scripts they read, and its console
script copies them out (make test's nbval step then runs those copies: tools/pip_user.py)."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
ENV_FILES = ("environment.yml", "environment-cpu.yml", "environment-teacher.yml")
LEARNER_EXTRAS = ("test", "vision")  # make env's learner set-up: nbgrader (its Lab menus) and Playwright only for teachers


def _tool(name: str):
    """A maintainers' script under tools/, imported as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _name(req: str) -> str:
    return re.split(r"[<>=!~ \[;]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _env_pip_requirements(env_file: str) -> dict:
    reqs = {}
    in_pip = False
    for line in (ROOT / env_file).read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("- pip:"):
            in_pip = True
            continue
        if in_pip and stripped.startswith("- ") and line.startswith("      "):
            req = stripped[2:].strip()
            if not req.startswith("-"):  # -e . and pip options such as --extra-index-url
                reqs[_name(req)] = req.replace(" ", "")
        elif in_pip and stripped and not line.startswith("      "):
            in_pip = False
    return reqs


@pytest.mark.parametrize("env_file", ENV_FILES)
def test_environment_yml_matches_pyproject(env_file):
    project = PYPROJECT["project"]
    wanted = {_name(r): r.replace(" ", "") for r in project["dependencies"]}
    for name, extra in project["optional-dependencies"].items():
        if name in LEARNER_EXTRAS or env_file == "environment-teacher.yml":
            wanted.update({_name(r): r.replace(" ", "") for r in extra})
    env = _env_pip_requirements(env_file)
    missing = sorted(set(wanted) - set(env))
    extra = sorted(set(env) - set(wanted))
    assert not missing and not extra, f"{env_file} lacks {missing}, has extra {extra}"
    differ = {k: (wanted[k], env[k]) for k in wanted if wanted[k] != env[k]}
    assert not differ, f"version specifiers differ (pyproject, {env_file}): {differ}"
    text = (ROOT / env_file).read_text()
    assert "-e ." in text, f"{env_file} must install the package itself"
    assert "      - -c requirements-recorded.txt\n" in text, f"{env_file}: the recorded torch, as make env"
    python = f"  - python{project['requires-python']}\n"
    assert python in text, f"{env_file} should ask conda for {python.strip()[2:]}, pyproject's requires-python"


def test_environment_cpu_yml_is_environment_yml_with_the_readmes_cpu_index():
    """The conda path offers the README's CPU-wheel choice, and the two files can't drift apart."""
    url = re.search(r"--index-url (https://\S+/cpu)\b", (ROOT / "README.md").read_text()).group(1)
    index = f"      - --extra-index-url {url}"
    body = [line for line in (ROOT / "environment.yml").read_text().splitlines() if not line.startswith("#")]
    cpu = [line for line in (ROOT / "environment-cpu.yml").read_text().splitlines() if not line.startswith("#")]
    assert index in cpu and index not in body, f"environment-cpu.yml should have {index.strip()!r}, environment.yml not"
    assert [line for line in cpu if line != index] == body, "environment-cpu.yml differs from environment.yml by more"
    assert cpu.index(index) == cpu.index("  - pip:") + 1, "the index line opens the pip list"


def test_floor_check_asks_for_everything_make_env_installs():
    """tools/check_floors.py (run by CI against the index) resolves the dependencies, every extra and the build."""
    check = _tool("check_floors")
    reqs = check.requirements(PYPROJECT)
    for wanted in ["nbgrader==0.9.6", "playwright>=1.45", "pytest>=8.0", "torch>=2.13", "setuptools>=77"]:
        assert wanted in reqs, wanted
    assert check.floor(PYPROJECT["project"]["requires-python"]) == "3.11"
    with pytest.raises(ValueError, match="requires-python"):
        check.floor(">=3.9,<4")


@pytest.mark.slow
def test_rank_import_stays_light():
    """A spawned rank imports ddp_helpers.engine.worker: it must not drag in matplotlib, torchvision or widgets."""
    code = ("import sys, ddp_helpers.engine.worker, ddp_helpers.ranks.launcher; "
            "print(sorted(m for m in ('matplotlib', 'torchvision', 'ipywidgets', 'mlxtend') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"worker import pulled in {out}"


def test_public_api_names_resolve():
    import ddp_helpers

    for name in ddp_helpers.__all__:
        assert getattr(ddp_helpers, name) is not None, name


def test_the_lesson_namespaces_resolve():
    """`lesson.X` and `figures.X` in a notebook: every name their tables list is found where the table says."""
    from ddp_helpers import lesson
    from ddp_helpers.lesson import figures

    for namespace in (lesson, figures):
        for name in namespace.__all__:
            assert getattr(namespace, name) is not None, (namespace.__name__, name)


def test_every_subpackage_is_listed_for_the_wheel():
    """[tool.setuptools] packages is an explicit list: a subpackage missing there is silently left out of the wheel."""
    setup = PYPROJECT["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "ddp_helpers").rglob("__init__.py")}
    found |= set(setup.get("package-dir", {}))  # folders mapped in from elsewhere (the notebooks)
    assert found == set(setup["packages"]), f"pyproject.toml [tool.setuptools] packages should be {sorted(found)}"


def _repo_files() -> dict:
    """What a copy should hold, by relative path: the repository's notebooks, and its examples/ beside them."""
    from ddp_helpers.common.shipped import list_examples, list_notebooks

    return {**list_notebooks(ROOT / "notebooks"), **list_examples(ROOT / "examples")}


def test_copy_notebooks_refuses_to_overwrite_without_force(tmp_path):
    from ddp_helpers.cli.copy_notebooks import copy_notebooks
    from ddp_helpers.common.shipped import examples_source, notebook_source

    assert notebook_source() == ROOT / "notebooks"  # a checkout (editable or PYTHONPATH): its own notebooks/
    assert examples_source() == ROOT / "examples"
    written = copy_notebooks(tmp_path / "dest")
    assert sorted(p.relative_to(tmp_path / "dest").as_posix() for p in written) == sorted(_repo_files())
    assert "examples/ddp_mnist.py" in _repo_files() and "examples/listing_7_2.py" in _repo_files()
    first = written[0]
    first.write_text("my edits")
    with pytest.raises(FileExistsError, match="--force"):
        copy_notebooks(tmp_path / "dest")
    assert first.read_text() == "my edits"  # refused before anything was copied
    copy_notebooks(tmp_path / "dest", force=True)
    assert first.read_bytes() == (ROOT / "notebooks" / first.relative_to(tmp_path / "dest")).read_bytes()
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="DEST"):
        copy_notebooks(tmp_path / "file")


def test_example_file_takes_the_copy_beside_the_notebook(tmp_path, monkeypatch):
    """A notebook's kernel runs in the notebook's folder: examples/ there (a copy) first, else the package's."""
    from ddp_helpers.common.shipped import example_file

    monkeypatch.chdir(tmp_path)  # like notebooks/ in the repository: no examples/ beside it
    assert example_file("ddp_mnist.py") == ROOT / "examples" / "ddp_mnist.py"
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "ddp_mnist.py").write_text("# a learner's edit")
    assert example_file("ddp_mnist.py").read_text() == "# a learner's edit"
    with pytest.raises(FileNotFoundError, match="listing_7_2.py"):
        example_file("no_such_script.py")


def test_no_notebook_cell_reads_above_its_folder():
    """A copied folder has nothing above the notebooks: a '../' path in a code cell fails for a pip user."""
    above = re.compile(r"[\"'](\.\./)+[\w.-]|Path\([\"']\.\.[\"']\)")
    hits = []
    for rel, path in _repo_files().items():
        if path.suffix == ".ipynb":
            cells = json.loads(path.read_text())["cells"]
            hits += [f"{rel} cell {i}" for i, c in enumerate(cells)
                     if c["cell_type"] == "code" and above.search("".join(c["source"]))]
    assert not hits, f"cells that read files above their notebook's folder: {hits}"


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_wheel_installed_elsewhere_ships_the_notebooks(tmp_path):
    """Build the wheel, install it into a folder outside the repo, run its console script from there.

    make test then runs nbval over such a copy (tools/pip_user.py, the same wheel, built once per state of its
    sources, and the same install), so every copied notebook is executed from its own folder with the installed
    package; this test checks what the copy holds.
    """
    pip_user = _tool("pip_user")
    target, work = tmp_path / "site-packages", tmp_path / "work"
    work.mkdir()
    env = pip_user.install(pip_user.cached_wheel(), target)
    files = _repo_files()
    package = target / "ddp_helpers"
    shipped = sorted(p.relative_to(package).as_posix() for folder in ("notebooks", "examples")
                     for p in (package / folder).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    expected = sorted(rel if rel.startswith("examples/") else f"notebooks/{rel}" for rel in files)
    assert shipped == expected, "the wheel's notebooks and examples differ from the repository's (README, cfg stay out)"

    where = subprocess.run([sys.executable, "-c", "import ddp_helpers.cli.copy_notebooks as m; print(m.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert pathlib.Path(where).resolve().is_relative_to(target.resolve()), where
    command = pip_user.console_script(target, "ddp-helpers-notebooks")
    run = subprocess.run(command + ["mine"], cwd=work, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    for rel, src in files.items():
        assert (work / "mine" / rel).read_bytes() == src.read_bytes(), rel
    again = subprocess.run(command + ["mine"], cwd=work, env=env, capture_output=True, text=True)
    assert again.returncode == 2 and "--force" in again.stderr, (again.returncode, again.stderr)
    forced = subprocess.run([sys.executable, "-m", "ddp_helpers.cli.copy_notebooks", "mine", "--force"], cwd=work,
                            env=env, capture_output=True, text=True)
    notebooks = sum(rel.endswith(".ipynb") for rel in files)
    assert forced.returncode == 0 and f"copied {notebooks} notebooks and the 2 scripts" in forced.stdout, forced.stderr


def test_the_wheel_cache_is_keyed_by_every_file_that_goes_into_the_wheel(tmp_path):
    """build/wheel-cache/<key>: a changed notebook or module is a new key (a new build); a byte-code cache isn't."""
    pip_user = _tool("pip_user")
    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "nb").mkdir()
    (tmp_path / "pyproject.toml").write_text('[project]\nreadme = "README.md"\n[tool.setuptools]\npackages = ["pkg", '
                                             '"pkg.nb"]\n[tool.setuptools.package-dir]\n"pkg.nb" = "nb"\n')
    for name, text in (("README.md", "read me"), ("pkg/__init__.py", ""), ("nb/a.ipynb", "{}")):
        (tmp_path / name).write_text(text)
    key = pip_user.sources_key(tmp_path)
    (tmp_path / "pkg" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert pip_user.sources_key(tmp_path) == key
    (tmp_path / "nb" / "a.ipynb").write_text("{ }")
    assert pip_user.sources_key(tmp_path) != key
    assert pip_user.sources_key() == pip_user.sources_key(ROOT) and len(key) == 16


def test_pip_user_runs_notebooks_again_as_copies_whose_folder_names_their_kernels_variables(tmp_path, monkeypatch):
    """make test-notebooks' one session (tools/pip_user.py --again): the numeric notebooks a second time, as copies
    in again/ (examples/ beside them, as the copy command puts it) whose folder gives their kernels the other
    kernels' variables (tools/nbval_ipc.py reads them); every notebook handed to pytest longest first."""
    pip_user, ipc = _tool("pip_user"), _tool("nbval_ipc")
    assert pip_user.KERNEL_ENV_FILE == ipc.KERNEL_ENV_FILE
    dest = tmp_path / "copy"
    for name in ("03_a.ipynb", "04_b.ipynb", "appendix/A1.ipynb", ".ipynb_checkpoints/03_a.ipynb", "examples/s.py"):
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        (dest / name).write_text(name)
    variables = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
    again = pip_user.again_copies(dest, ["04_b.ipynb", "appendix/A1.ipynb"], variables)
    assert again == ["again/04_b.ipynb", "again/appendix/A1.ipynb"]
    assert [(dest / name).read_text() for name in again] == ["04_b.ipynb", "appendix/A1.ipynb"]
    assert (dest / "again" / "examples" / "s.py").read_text() == "examples/s.py"
    assert ipc.folder_env(str(dest / "again")) == ipc.folder_env(str(dest / "again" / "appendix")) == variables
    assert ipc.folder_env(str(dest)) == {} and ipc.folder_env(str(dest / "appendix")) == {}
    assert pip_user.notebooks_in(dest) == ["03_a.ipynb", "04_b.ipynb", "appendix/A1.ipynb"]  # not again/ or hidden
    monkeypatch.setattr(pip_user, "SECONDS", {"03_a.ipynb": 10.0, "04_b.ipynb": 50.0, "again/04_b.ipynb": 40.0})
    assert pip_user.longest_first(pip_user.notebooks_in(dest) + again) == [
        "04_b.ipynb", "again/04_b.ipynb", "03_a.ipynb", "again/appendix/A1.ipynb", "appendix/A1.ipynb"]
    names, twice = pip_user.notebooks_in(dest), ["04_b.ipynb", "appendix/A1.ipynb"]
    assert pip_user.as_they_are(names, twice, only_again=False) == names
    assert pip_user.as_they_are(names, twice, only_again=True) == ["03_a.ipynb"]  # --only-again: as copies only
    (dest / "again" / ipc.KERNEL_ENV_FILE).write_text('{"ATEN_CPU_CAPABILITY": 0}')
    with pytest.raises(ValueError, match="JSON object of variable names to strings"):
        ipc.folder_env(str(dest / "again"))


@pytest.mark.parametrize("argv, says", [
    (["--again", "03_ddp_gradient_sync.ipynb", "--again-env", "ATEN_CPU_CAPABILITY"], "give NAME=VALUE"),
    (["--again-env", "MKL_CBWR=COMPATIBLE"], "--again-env without --again"),
    (["--only-again"], "--only-again without --again"),
    (["--again", "03_ddp_gradient_sync"], "not in notebooks/: 03_ddp_gradient_sync "),
])
def test_pip_user_refuses_what_it_cant_run_again_before_building_anything(argv, says, capsys, monkeypatch):
    pip_user = _tool("pip_user")
    monkeypatch.setattr(pip_user, "installed_copy", lambda work: pytest.fail("built and installed before refusing"))
    with pytest.raises(SystemExit) as exit_:
        pip_user.main(argv)
    assert exit_.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.skipif(__import__("os").name == "nt", reason="no ipc transport on Windows (the plugin does nothing)")
@pytest.mark.slow
def test_nbval_kernels_talk_over_unix_sockets_with_a_prefix_each(monkeypatch, tmp_path):
    """tools/nbval_ipc.py (make test's nbval runs): no TCP port to lose to another process before the kernel binds
    it; each kernel's socket files under a prefix of its own, removed when nbval ends the kernel. The kernel of a
    notebook whose folder has nbval_kernel_env.json gets its variables (make test's other CPU kernels)."""
    import os

    import nbval.kernel

    monkeypatch.setattr(nbval.kernel, "KernelManager", nbval.kernel.KernelManager)  # put back after the test
    ipc = _tool("nbval_ipc")
    ipc.pytest_configure(None)
    managers = [nbval.kernel.KernelManager(kernel_name="python3") for _ in range(2)]
    assert [m.transport for m in managers] == ["ipc", "ipc"] and managers[0].ip != managers[1].ip
    (tmp_path / ipc.KERNEL_ENV_FILE).write_text(json.dumps({"DDP_HELPERS_KERNEL_PROBE": "other kernels"}))
    km, kc = nbval.kernel.start_new_kernel(kernel_name="python3", cwd=str(tmp_path))  # as nbval starts each kernel
    printed = []
    try:
        sockets = [f"{km.ip}-{km.shell_port}", f"{km.ip}-{km.iopub_port}"]
        assert km.transport == "ipc" and all(os.path.exists(s) for s in sockets), sockets
        kc.execute_interactive("import os; print(os.environ.get('DDP_HELPERS_KERNEL_PROBE'))", timeout=60,
                               output_hook=lambda msg: printed.append(msg["content"].get("text", "")))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert not any(os.path.exists(s) for s in sockets)
    assert "".join(printed).strip() == "other kernels"  # the kernel answered over the sockets, with the variable
    assert "DDP_HELPERS_KERNEL_PROBE" not in os.environ  # set for that kernel only
