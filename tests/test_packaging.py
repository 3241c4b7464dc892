"""Packaging: environment.yml and pyproject.toml list the same dependencies; the public API imports lazily."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

try:
    import tomllib
except ImportError:  # Python < 3.11
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _name(req: str) -> str:
    return re.split(r"[<>=!~ \[;]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _env_pip_requirements() -> dict:
    reqs = {}
    in_pip = False
    for line in (ROOT / "environment.yml").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("- pip:"):
            in_pip = True
            continue
        if in_pip and stripped.startswith("- ") and line.startswith("      "):
            req = stripped[2:].strip()
            if not req.startswith("-e"):
                reqs[_name(req)] = req.replace(" ", "")
        elif in_pip and stripped and not line.startswith("      "):
            in_pip = False
    return reqs


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {_name(r): r.replace(" ", "") for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        wanted.update({_name(r): r.replace(" ", "") for r in extra})
    env = _env_pip_requirements()
    missing = sorted(set(wanted) - set(env))
    extra = sorted(set(env) - set(wanted))
    assert not missing and not extra, f"environment.yml lacks {missing}, has extra {extra}"
    differ = {k: (wanted[k], env[k]) for k in wanted if wanted[k] != env[k]}
    assert not differ, f"version specifiers differ (pyproject, environment.yml): {differ}"
    assert "-e ." in (ROOT / "environment.yml").read_text(), "environment.yml must install the package itself"


def test_rank_import_stays_light():
    """A spawned rank imports ddp_helpers.worker: it must not drag in matplotlib, torchvision or widgets."""
    code = ("import sys, ddp_helpers.worker, ddp_helpers.launcher; "
            "print(sorted(m for m in ('matplotlib', 'torchvision', 'ipywidgets', 'mlxtend') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", f"worker import pulled in {out}"


def test_public_api_names_resolve():
    import ddp_helpers

    for name in ddp_helpers.__all__:
        assert getattr(ddp_helpers, name) is not None, name


def test_every_subpackage_is_listed_for_the_wheel():
    """[tool.setuptools] packages is an explicit list: a subpackage missing there is silently left out of the wheel."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "ddp_helpers").rglob("__init__.py")}
    assert found == listed, f"pyproject.toml [tool.setuptools] packages should be {sorted(found)}"
