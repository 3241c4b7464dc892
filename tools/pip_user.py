"""The notebooks as a pip user gets them: build the wheel from this checkout, install it outside the repository,
copy the notebooks out with its console script, and run nbval over that copy (make test-notebooks).

    python tools/pip_user.py                                   # nbval over every copied notebook
    python tools/pip_user.py 04_two_process_mnist.ipynb        # some of them (paths inside notebooks/)
    python tools/pip_user.py -- -x                             # after --: more pytest options

The copies are the stored notebooks byte for byte, so this is also the repository's nbval run; what it adds is
that each notebook runs in a folder outside the repository that holds only what the wheel ships, with the
installed package, not the checkout. Building, installing and copying take a few seconds, offline. Kernels
talk over Unix sockets, not TCP ports (tools/nbval_ipc.py says why).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from typing import List, Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]


def _run(command: List[str], **kwargs) -> str:
    """Run a step; on failure raise with its own error output, not only its exit status."""
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:6])} ... failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def _sources() -> List[str]:
    """The top-level files and folders the wheel is built from, as pyproject.toml names them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setup = project["tool"]["setuptools"]
    return sorted({p.split(".")[0] for p in setup["packages"]} | set(setup.get("package-dir", {}).values())
                  | {"pyproject.toml", project["project"]["readme"]})


def build_wheel(out: pathlib.Path) -> pathlib.Path:
    """Build the wheel into out, from a clean copy of its sources (a stale build/lib can't leak into it)."""
    src = out / "src"
    src.mkdir(parents=True)
    for name in _sources():
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
        else:
            shutil.copyfile(ROOT / name, src / name)
    _run(PIP + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
         timeout=180)  # offline: the installed setuptools builds it
    (wheel,) = out.glob("ddp_helpers-*.whl")
    return wheel


def install(wheel: pathlib.Path, target: pathlib.Path) -> dict:
    """Install the wheel alone into target (its dependencies are this interpreter's); the environment to use it."""
    _run(PIP + ["install", "--no-deps", "--target", str(target), str(wheel)], timeout=120)
    return dict(os.environ, PYTHONPATH=str(target))  # the installed copy, not the checkout (kernels inherit it)


def console_script(target: pathlib.Path, name: str) -> List[str]:
    """The command that runs a console script pip wrote into target (Windows: Scripts/NAME.exe)."""
    script = target / "bin" / name
    return [sys.executable, str(script)] if script.exists() else [str(target / "Scripts" / f"{name}.exe")]


def installed_copy(work: pathlib.Path) -> tuple:
    """Wheel, install and copy under work: (the copied folder, the environment that uses the installed package)."""
    target, dest = work / "site-packages", work / "notebooks"
    env = install(build_wheel(work / "wheel"), target)
    _run(console_script(target, "ddp-helpers-notebooks") + [str(dest)], cwd=work, env=env, timeout=120)
    where = _run([sys.executable, "-c", "import ddp_helpers; print(ddp_helpers.__file__)"], cwd=dest, env=env).strip()
    if not pathlib.Path(where).resolve().is_relative_to(target.resolve()):  # e.g. a .pth that outranks PYTHONPATH
        raise RuntimeError(f"the copied notebooks would import ddp_helpers from {where}, not from {target}")
    return dest, env


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("notebooks", nargs="*", help="paths inside notebooks/ (default: all of them)")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    with tempfile.TemporaryDirectory(prefix="ddp_helpers_pip_user_") as work:
        start = time.perf_counter()
        dest, env = installed_copy(pathlib.Path(work))
        print(f"wheel built, installed outside the repository and its notebooks copied out in "
              f"{time.perf_counter() - start:.1f} s; nbval runs the copies", flush=True)
        paths = [str(dest / name) for name in args.notebooks] or [str(dest)]
        plugins = pathlib.Path(work) / "plugins"  # nbval_ipc alone, so the kernels can import nothing else of tools/
        plugins.mkdir()
        shutil.copyfile(ROOT / "tools" / "nbval_ipc.py", plugins / "nbval_ipc.py")
        if os.environ.get("SUITE_CPU_PLUGIN"):  # run under tools/suite_cpu.py: its plugin, which PYTEST_PLUGINS names
            shutil.copy(os.environ["SUITE_CPU_PLUGIN"], plugins)
        env = dict(env, PYTHONPATH=os.pathsep.join([env["PYTHONPATH"], str(plugins)]))
        command = [sys.executable, "-m", "pytest", "-p", "nbval_ipc", "--nbval", *paths, "--nbval-sanitize-with",
                   str(ROOT / "notebooks" / "nbval_sanitize.cfg"), "-c", str(ROOT / "pyproject.toml"),
                   "--rootdir", str(dest), *extra]
        return subprocess.run(command, cwd=dest, env=env).returncode  # cwd outside the repository too


if __name__ == "__main__":
    sys.exit(main())
