"""Packaging: environment.yml and pyproject.toml list the same dependencies; the public API imports lazily;
a wheel installed outside the repository carries the notebooks and its console script copies them out."""
from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
ENV_FILES = ("environment.yml", "environment-cpu.yml")


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
    for extra in project["optional-dependencies"].values():
        wanted.update({_name(r): r.replace(" ", "") for r in extra})
    env = _env_pip_requirements(env_file)
    missing = sorted(set(wanted) - set(env))
    extra = sorted(set(env) - set(wanted))
    assert not missing and not extra, f"{env_file} lacks {missing}, has extra {extra}"
    differ = {k: (wanted[k], env[k]) for k in wanted if wanted[k] != env[k]}
    assert not differ, f"version specifiers differ (pyproject, {env_file}): {differ}"
    text = (ROOT / env_file).read_text()
    assert "-e ." in text, f"{env_file} must install the package itself"
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
    for wanted in ["nbgrader==0.9.6", "playwright>=1.45", "pytest>=8.0", "torch>=2.8", "setuptools>=77"]:
        assert wanted in reqs, wanted
    assert check.floor(PYPROJECT["project"]["requires-python"]) == "3.11"
    with pytest.raises(ValueError, match="requires-python"):
        check.floor(">=3.9,<4")


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


def test_every_subpackage_is_listed_for_the_wheel():
    """[tool.setuptools] packages is an explicit list: a subpackage missing there is silently left out of the wheel."""
    setup = PYPROJECT["tool"]["setuptools"]
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "ddp_helpers").rglob("__init__.py")}
    found |= set(setup.get("package-dir", {}))  # folders mapped in from elsewhere (the notebooks)
    assert found == set(setup["packages"]), f"pyproject.toml [tool.setuptools] packages should be {sorted(found)}"


def _repo_notebooks() -> dict:
    from ddp_helpers.copy_notebooks import list_notebooks

    return list_notebooks(ROOT / "notebooks")


def test_copy_notebooks_refuses_to_overwrite_without_force(tmp_path):
    from ddp_helpers.copy_notebooks import copy_notebooks, notebook_source

    assert notebook_source() == ROOT / "notebooks"  # a checkout (editable or PYTHONPATH): its own notebooks/
    written = copy_notebooks(tmp_path / "dest")
    assert sorted(p.relative_to(tmp_path / "dest").as_posix() for p in written) == sorted(_repo_notebooks())
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


@pytest.mark.timeout(240)
def test_wheel_installed_elsewhere_ships_the_notebooks(tmp_path):
    """Build the wheel, install it into a folder outside the repo, run its console script from there."""
    wheels, target, work = tmp_path / "wheels", tmp_path / "site-packages", tmp_path / "work"
    work.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(ROOT)],
                   check=True, capture_output=True, timeout=180)  # offline: the installed setuptools builds it
    (wheel,) = wheels.glob("ddp_helpers-*.whl")
    subprocess.run(pip + ["install", "--no-deps", "--target", str(target), str(wheel)], check=True,
                   capture_output=True, timeout=120)
    notebooks = _repo_notebooks()
    packaged = target / "ddp_helpers" / "notebooks"
    shipped = sorted(p.relative_to(packaged).as_posix() for p in packaged.rglob("*") if p.is_file())
    assert shipped == sorted(notebooks), "the wheel's notebooks differ from notebooks/ (README and config stay out)"

    env = dict(os.environ, PYTHONPATH=str(target))  # the installed copy, not the checkout (cwd is outside too)
    where = subprocess.run([sys.executable, "-c", "import ddp_helpers.copy_notebooks as m; print(m.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert pathlib.Path(where).resolve().is_relative_to(target.resolve()), where
    script = target / "bin" / "ddp-helpers-notebooks"  # the console script pip wrote (Windows: Scripts/*.exe)
    command = [sys.executable, str(script)] if script.exists() else [str(target / "Scripts" / f"{script.name}.exe")]
    run = subprocess.run(command + ["mine"], cwd=work, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    for rel, src in notebooks.items():
        assert (work / "mine" / rel).read_bytes() == src.read_bytes(), rel
    again = subprocess.run(command + ["mine"], cwd=work, env=env, capture_output=True, text=True)
    assert again.returncode == 2 and "--force" in again.stderr, (again.returncode, again.stderr)
    forced = subprocess.run([sys.executable, "-m", "ddp_helpers.copy_notebooks", "mine", "--force"], cwd=work,
                            env=env, capture_output=True, text=True)
    assert forced.returncode == 0 and f"copied {len(notebooks)} notebooks" in forced.stdout, forced.stderr
