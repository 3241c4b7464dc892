"""The notebooks as a pip user gets them: build the wheel from this checkout, install it outside the repository,
copy the notebooks out with its console script, and run nbval over that copy (make test-notebooks).

    python tools/pip_user.py                                   # nbval over every copied notebook
    python tools/pip_user.py 04_two_process_mnist.ipynb        # some of them (paths inside notebooks/)
    python tools/pip_user.py -- -x                             # after --: more pytest options
    python tools/pip_user.py --again 03_ddp_gradient_sync.ipynb --again-env ATEN_CPU_CAPABILITY=default
                                                               # 03 a second time, that variable in its kernel

The copies are the stored notebooks byte for byte, so this is also the repository's nbval run; what it adds is
that each notebook runs in a folder outside the repository that holds only what the wheel ships, with the
installed package, not the checkout. Building, installing and copying take a few seconds, offline. Kernels
talk over Unix sockets, not TCP ports (tools/nbval_ipc.py says why).

The wheel is built once per state of its sources: build/wheel-cache/<hash of every file that goes into it>/,
shared with tests/project/test_packaging.py (make test builds it in its unit part and installs it here).

--again runs notebooks a second time in the same pytest session (one start of pytest and its xdist workers, one
collection), as copies in again/ whose kernels get --again-env's variables (tools/nbval_ipc.py): make test's
numeric notebooks with other CPU kernels. With --only-again those notebooks run only as the copies: make test's
numeric notebooks were recorded on their machine's own kernels, so their run under other kernels is the comparison
that can fail where a run with the recording's kernels could not (issue 52: each proof once). The notebooks go to
pytest longest first (SECONDS), so that with --dist loadfile no long notebook starts while the other worker has
nothing left to do.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from typing import Dict, List, Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
SKIPPED = ("__pycache__", ".ipynb_checkpoints")  # never copied into the build, so never part of its hash
CACHE = ROOT / "build" / "wheel-cache"
AGAIN = "again"  # the folder of the notebooks run a second time, with --again-env's variables in their kernels
KERNEL_ENV_FILE = "nbval_kernel_env.json"  # tools/nbval_ipc.py reads it in a notebook's folder
# Wall seconds of each notebook's nbval run (when and how measured: docs/benchmarks.md, "Figures behind the code's
# choices"): only their order counts. A notebook not listed goes after these.
SECONDS = {
    "04_two_process_mnist.ipynb": 125, "06_notebook_to_torchrun.ipynb": 105,
    "12_debugging_elastic_and_sharding.ipynb": 79, "again/03b_build_ddp_sync.ipynb": 77,
    "11_mixed_precision_and_compile.ipynb": 67, "again/04_two_process_mnist.ipynb": 64, "00_core_path.ipynb": 51,
    "13_when_it_breaks.ipynb": 62,
    "03b_build_ddp_sync.ipynb": 48, "07_buckets_and_overlap.ipynb": 43, "05_beyond_the_basics.ipynb": 41,
    "08_batch_size_and_lr.ipynb": 32, "again/05_beyond_the_basics.ipynb": 30, "10_uneven_inputs.ipynb": 27,
    "03_ddp_gradient_sync.ipynb": 26, "01_process_group.ipynb": 24, "again/03_ddp_gradient_sync.ipynb": 24,
    "appendix/A1_cpu_cores_and_quotas.ipynb": 22, "09_buffers_and_unused_parameters.ipynb": 21,
    "02_devices_and_data.ipynb": 20, "appendix/A2_control_panel.ipynb": 18, "exercises/exercises.ipynb": 12,
}


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


def notebooks_in(dest: pathlib.Path) -> List[str]:
    """Every notebook under dest by relative path, hidden folders (.ipynb_checkpoints/) and again/ left out."""
    names = [p.relative_to(dest) for p in dest.rglob("*.ipynb")]
    return sorted(n.as_posix() for n in names if n.parts[0] != AGAIN and not any(x.startswith(".") for x in n.parts))


def again_copies(dest: pathlib.Path, names: List[str], env: Dict[str, str]) -> List[str]:
    """Copies of the notebooks names (paths inside dest) in dest/again/, each folder telling nbval_ipc to start
    their kernels with env; the copies' relative paths. examples/ goes along, as the copy command puts it."""
    for name in names:
        copy = dest / AGAIN / name
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(dest / name, copy)
        (copy.parent / KERNEL_ENV_FILE).write_text(json.dumps(env))
    if names and (dest / "examples").is_dir():
        shutil.copytree(dest / "examples", dest / AGAIN / "examples")
    return [f"{AGAIN}/{name}" for name in names]


def longest_first(names: List[str]) -> List[str]:
    """names by SECONDS, longest first; those not in it after them, by name."""
    return sorted(names, key=lambda name: (-SECONDS.get(name, 0.0), name))


def as_they_are(names: List[str], again: List[str], only_again: bool) -> List[str]:
    """The notebooks that run as they are: names, less those that run only as again/ copies."""
    return [name for name in names if not (only_again and name in again)]


def _variables(pairs: List[str], p: argparse.ArgumentParser) -> Dict[str, str]:
    """--again-env's NAME=VALUE pairs as a dict; a usage error for one without a name or '='."""
    env = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not name:
            p.error(f"--again-env {pair!r}: give NAME=VALUE, e.g. ATEN_CPU_CAPABILITY=default")
        env[name] = value
    return env


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("notebooks", nargs="*", help="paths inside notebooks/ (default: all of them)")
    p.add_argument("--again", action="append", default=[], metavar="NOTEBOOK",
                   help="run this notebook (a path inside notebooks/) a second time, as a copy in again/ whose "
                        "kernel gets --again-env's variables (repeat for more)")
    p.add_argument("--again-env", action="append", default=[], metavar="NAME=VALUE",
                   help="a variable for the kernels of --again's copies (repeat for more)")
    p.add_argument("--only-again", action="store_true",
                   help="run --again's notebooks only as their copies, not also as they are")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    again_env = _variables(args.again_env, p)
    if args.again_env and not args.again:
        p.error("--again-env without --again: name the notebooks to run again with those variables")
    if args.only_again and not args.again:
        p.error("--only-again without --again: name the notebooks to run only as copies")
    missing = [name for name in args.notebooks + args.again if not (ROOT / "notebooks" / name).is_file()]
    if missing:  # the copies are the stored notebooks: what isn't in notebooks/ won't be among them
        p.error(f"not in notebooks/: {', '.join(missing)} (give paths inside notebooks/)")
    with tempfile.TemporaryDirectory(prefix="ddp_helpers_pip_user_") as work:
        start = time.perf_counter()
        dest, env = installed_copy(pathlib.Path(work))
        print(f"wheel built (or taken from {CACHE.relative_to(ROOT)}), installed outside the repository and its "
              f"notebooks copied out in "
              f"{time.perf_counter() - start:.1f} s; nbval runs the copies", flush=True)
        names = as_they_are(args.notebooks or notebooks_in(dest), args.again, args.only_again)
        names += again_copies(dest, args.again, again_env)
        if args.again:
            how = "only" if args.only_again else "again"
            print(f"{AGAIN}/ runs {len(args.again)} of them {how}, their kernels with "
                  f"{' '.join(f'{k}={v}' for k, v in again_env.items()) or 'no other variable'}", flush=True)
        paths = [str(dest / name) for name in longest_first(names)]
        plugins = pathlib.Path(work) / "plugins"  # nbval_ipc alone, so the kernels can import nothing else of tools/
        plugins.mkdir()
        shutil.copyfile(ROOT / "tools" / "nbval_ipc.py", plugins / "nbval_ipc.py")
        if os.environ.get("SUITE_CPU_PLUGIN"):  # run under tools/suite_cpu.py: its plugin, which PYTEST_PLUGINS names
            shutil.copy(os.environ["SUITE_CPU_PLUGIN"], plugins)
        env = dict(env, PYTHONPATH=os.pathsep.join([env["PYTHONPATH"], str(plugins)]))
        # xdist would hand out the notebooks with the most cells first: keep ours, longest first.
        keep_order = ["--no-loadscope-reorder"] if importlib.util.find_spec("xdist") else []
        command = [sys.executable, "-m", "pytest", "-p", "nbval_ipc", "--nbval", *paths, "--nbval-sanitize-with",
                   str(ROOT / "notebooks" / "nbval_sanitize.cfg"), "-c", str(ROOT / "pyproject.toml"),
                   "--rootdir", str(dest), *keep_order, *extra]
        return subprocess.run(command, cwd=dest, env=env).returncode  # cwd outside the repository too


if __name__ == "__main__":
    sys.exit(main())
