"""The notebooks as a pip user gets them: build the wheel from this checkout, install it outside the repository,
copy the notebooks out with its console script, and run nbval over that copy (make test-notebooks).

    python tools/pip_user.py                                   # nbval over every copied notebook
    python tools/pip_user.py 04_two_process_mnist.ipynb        # some of them (paths inside notebooks/)
    python tools/pip_user.py -- -x                             # after --: more pytest options

The copies are the stored notebooks byte for byte, so this is also the repository's nbval run; what it adds is
that each notebook runs in a folder outside the repository that holds only what the wheel ships, with the
installed package, not the checkout. Building, installing and copying take a few seconds, offline. Kernels
talk over Unix sockets, not TCP ports (tools/nbval_ipc.py says why).

The wheel is built once per state of its sources: build/wheel-cache/<hash of every file that goes into it>/,
shared with tests/project/test_packaging.py (make test builds it in its unit part and installs it here).
"""
from __future__ import annotations

import argparse
import hashlib
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
SKIPPED = ("__pycache__", ".ipynb_checkpoints")  # never copied into the build, so never part of its hash
CACHE = ROOT / "build" / "wheel-cache"


def _run(command: List[str], **kwargs) -> str:
    """Run a step; on failure raise with its own error output, not only its exit status."""
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:6])} ... failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def _sources(root: pathlib.Path = ROOT) -> List[str]:
    """The top-level files and folders the wheel is built from, as pyproject.toml names them."""
    project = tomllib.loads((root / "pyproject.toml").read_text())
    setup = project["tool"]["setuptools"]
    return sorted({p.split(".")[0] for p in setup["packages"]} | set(setup.get("package-dir", {}).values())
                  | {"pyproject.toml", project["project"]["readme"]})


def _source_files(root: pathlib.Path) -> List[pathlib.Path]:
    """Every file the wheel's build copies, sorted."""
    files = []
    for name in _sources(root):
        path = root / name
        files += [p for p in path.rglob("*") if p.is_file() and not set(SKIPPED) & set(p.relative_to(root).parts)] \
            if path.is_dir() else [path]
    return sorted(files)


def sources_key(root: pathlib.Path = ROOT) -> str:
    """A hash of the wheel's sources: every copied file's path and bytes."""
    digest = hashlib.sha256()
    for path in _source_files(root):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


def build_wheel(out: pathlib.Path) -> pathlib.Path:
    """Build the wheel into out, from a clean copy of its sources (a stale build/lib can't leak into it)."""
    src = out / "src"
    src.mkdir(parents=True)
    for name in _sources():
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns(*SKIPPED))
        else:
            shutil.copyfile(ROOT / name, src / name)
    _run(PIP + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
         timeout=180)  # offline: the installed setuptools builds it
    (wheel,) = out.glob("ddp_helpers-*.whl")
    return wheel


def cached_wheel(cache: pathlib.Path = CACHE) -> pathlib.Path:
    """The wheel of the sources as they are now: built on the first call, then taken from cache/<sources_key>/.

    A build goes to a folder of its own and is renamed into place, so a reader never sees half a wheel and two
    builders at once leave one; the wheels of earlier source states are removed.
    """
    key = sources_key()
    found = sorted((cache / key).glob("ddp_helpers-*.whl"))
    if found:
        return found[0]
    cache.mkdir(parents=True, exist_ok=True)
    work = pathlib.Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=cache))
    try:
        wheel = build_wheel(work / "build")
        key = sources_key(work / "build" / "src")  # what was built, should a file have changed meanwhile
        (work / key).mkdir()
        wheel.rename(work / key / wheel.name)
        try:
            (work / key).rename(cache / key)
        except OSError:  # another build of the same sources got there first: use it
            pass
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for old in cache.iterdir():
        if old.name != key and not old.name.startswith("."):
            shutil.rmtree(old, ignore_errors=True)
    return next((cache / key).glob("ddp_helpers-*.whl"))


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
    env = install(cached_wheel(), target)
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
        print(f"wheel built (or taken from {CACHE.relative_to(ROOT)}), installed outside the repository and its "
              f"notebooks copied out in "
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
