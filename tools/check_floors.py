"""Does what `make env` installs resolve on the lowest Python that pyproject.toml claims? (CI runs it; needs PyPI.)

    python tools/check_floors.py                 # requires-python's floor, every dependency and extra
    python tools/check_floors.py --python 3.12   # another version

Asks pip to resolve the package's dependencies, all its extras and its build requirements for that Python from
the package indexes' metadata alone (`pip install --dry-run --ignore-installed --python-version X
--only-binary=:all:`: nothing is built or installed, so it works for a Python this machine doesn't have), and
prints the versions a few key packages resolve to. Exits non-zero, with pip's reason, when they don't resolve.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import tomllib
from typing import List, Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHOWN = ("torch", "torchvision", "numpy", "jupyterlab", "nbgrader", "sphinx", "myst-nb")


def floor(requires_python: str) -> str:
    """'>=3.11' -> '3.11': the lowest version a requires-python of the form >=X.Y admits."""
    match = re.fullmatch(r"\s*>=\s*(\d+\.\d+)\s*", requires_python)
    if not match:
        raise ValueError(f"requires-python {requires_python!r}: expected the form '>=X.Y'")
    return match.group(1)


def requirements(pyproject: dict) -> List[str]:
    """What make env asks pip for: the dependencies, every extra and the build requirements."""
    project = pyproject["project"]
    reqs = list(project["dependencies"]) + list(pyproject["build-system"]["requires"])
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    return reqs


def resolve(python: str, reqs: List[str]) -> dict:
    """pip's resolution of reqs for that Python, from the indexes' metadata: name -> version."""
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "report.json"
        run = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                              "--disable-pip-version-check", "--python-version", python, "--only-binary=:all:",
                              "--report", str(report), *reqs], capture_output=True, text=True, timeout=900)
        if run.returncode != 0:
            errors = [line for line in run.stderr.splitlines() if not line.startswith("WARNING: Location")]
            raise RuntimeError(f"Python {python}: pip can't resolve what make env installs:\n" + "\n".join(errors))
        return {item["metadata"]["name"].lower(): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--python", help="a Python version such as 3.12 (default: requires-python's floor)")
    args = p.parse_args(argv)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    python = args.python or floor(pyproject["project"]["requires-python"])
    try:
        found = resolve(python, requirements(pyproject))
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    shown = ", ".join(f"{name} {found[name]}" for name in SHOWN if name in found)
    print(f"Python {python}: the dependencies, extras and build requirements resolve ({len(found)} packages: {shown})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
