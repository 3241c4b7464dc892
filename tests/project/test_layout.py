"""The package's shape: no import circle, no module over 400 lines, one init_process_group call, no import-time threads."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "ddp_helpers"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set:
    """Every ddp_helpers module this file imports, at the top or inside a function."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.startswith("ddp_helpers"):
                for alias in node.names:  # `from . import worker` imports a module; `from .x import f` imports x
                    candidate = f"{base}.{alias.name}"
                    found.add(candidate if (PACKAGE.parent / (candidate.replace(".", "/") + ".py")).exists() else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("ddp_helpers"))
    return found


def _graph() -> dict:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}


def _cycle(graph: dict):
    state = {}

    def visit(m, path):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n, path + [n])
                if found:
                    return found
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m, [m])
            if found:
                return found
    return None


def test_no_import_circle_between_modules():
    graph = {m: {i for i in deps if not m.startswith(i + ".")} for m, deps in _graph().items()}  # a package's own
    cycle = _cycle(graph)  # __init__ is loaded before its modules by Python itself: not a circle of ours
    assert cycle is None, "import circle: " + " -> ".join(cycle)


# Which folders of the package each folder may import: the layers, bottom to top. Nothing imports upwards, so
# a rank never loads plotting or widget code, and ranks/ (the launcher) and data/ can be read and tested alone.
LAYERS = {
    "common": set(),
    "ranks": {"common"},
    "data": {"common"},
    "engine": {"common", "ranks", "data"},
    "lesson": {"common", "ranks", "data", "engine"},
    "exercises": {"common", "ranks", "data", "engine", "lesson"},
    "cli": {"common", "ranks", "data", "engine", "lesson"},
}


def _folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else "<top>"


def back_edges(graph: dict) -> list:
    """Every import from a folder into one it may not use (LAYERS); the top level (__init__, train) may use all."""
    bad = []
    for module, deps in sorted(graph.items()):
        here = _folder(module)
        if here == "<top>":
            continue
        for dep in sorted(deps):
            there = _folder(dep)
            if there not in (here, "<top>") and there not in LAYERS[here] or (there == "<top>" and dep != "ddp_helpers"):
                bad.append(f"{module} -> {dep}")
    return bad


def test_every_folder_of_the_package_is_a_layer():
    assert {p.parent.name for p in PACKAGE.glob("*/__init__.py")} - {"notebooks", "examples"} == set(LAYERS)


def test_layers_import_one_way():
    assert back_edges(_graph()) == []


def test_the_back_edge_finder_finds_one():
    assert back_edges({"ddp_helpers.ranks.launcher": {"ddp_helpers.engine.config"},
                       "ddp_helpers.engine.config": {"ddp_helpers.ranks.checks"},
                       "ddp_helpers.data.sources": {"ddp_helpers.cli.train"}}) == [
        "ddp_helpers.data.sources -> ddp_helpers.cli.train", "ddp_helpers.ranks.launcher -> ddp_helpers.engine.config"]


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_module_over_400_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"modules over 400 lines: {long}"


def test_one_init_process_group_call_in_the_package():
    calls = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "init_process_group":
                calls.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert len(calls) == 1 and calls[0].startswith("ranks/rank.py:"), calls


@pytest.mark.slow
def test_importing_every_module_starts_no_thread():
    modules = sorted(m for m in _graph() if not m.endswith("__main__"))
    code = ("import importlib, threading, sys\n"
            f"for m in {modules!r}:\n"
            "    importlib.import_module(m)\n"
            "print(sorted(t.name for t in threading.enumerate() if t is not threading.main_thread()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


# tests/ is grouped like the package: one folder per part of it, and those of its own.
TEST_GROUPS_OF_OUR_OWN = {"project": "the repository as a whole: docs, layout, packaging, site, notebooks, benchmarks",
                         "slurm": "runs on the SLURM test cluster (tools/slurm_cluster.py) that its conftest starts"}


def test_tests_are_grouped_like_the_package():
    tests = PACKAGE.parent / "tests"
    parts = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    folders = {p.name for p in tests.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    assert folders == parts | set(TEST_GROUPS_OF_OUR_OWN), (folders, parts)
    assert not list(tests.glob("test_*.py")), "a test file belongs in the folder of the part it tests"
    names = [p.name for p in tests.rglob("test_*.py")]
    assert len(names) == len(set(names)), "test file names must stay unique (pytest's default import mode)"


def test_the_slow_marker_is_registered_and_used():
    """`pytest -m "not slow"` is the quick loop: the marker must exist, or -m would silently select nothing new."""
    import tomllib

    config = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert any(m.startswith("slow:") for m in config["markers"])
    assert "--strict-markers" in config["addopts"]  # a mistyped @pytest.mark.slwo is an error, not a new mark
    used = sum(p.read_text().count("@pytest.mark.slow") for p in (PACKAGE.parent / "tests").rglob("test_*.py"))
    assert used >= 50, used


def test_ranks_holds_at_most_16_files():
    # issue 60: ranks/ by subject, one module a job; a new subject there first looks for the module it belongs in
    files = sorted(p.name for p in (PACKAGE / "ranks").glob("*.py"))
    assert len(files) <= 16, f"ranks/ holds {len(files)} files: {files}"
