"""Shared fixtures: small real DDP runs, and a check that no test leaves a process behind; how make test's two
pytest-xdist workers share the tests."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from collections import Counter

import psutil
import pytest

os.environ.setdefault("DDP_HELPERS_PROGRESS", "0")  # keep test logs free of progress bars
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # the shared helpers here (_procs.py) import from test files in any folder below
    sys.path.insert(0, _HERE)


# ------------------------------------------------------------------ make test: pytest -n 2 (pytest-xdist)
# Each test file runs on one worker, so a module's shared fixture (a generated course, a built site, two network
# namespaces with fixed names) is made once and never twice at the same time. (--dist loadgroup would do it per
# mark, but pytest 9.2 drops its groups: pytest-dev/pytest-xdist#1386.) The files with the most slow tests go
# first, so that no long file starts last while the other worker has nothing left to do.
@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """-n N with the default --dist load: whole files to the workers (tests/slurm/ whole), in the order the
    workers collected them."""
    if config.getvalue("dist") != "load":
        return None  # a --dist the caller chose
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            """tests/slurm/ as one scope: its files share one SLURM test cluster and assert what its nodes hold."""
            return "tests/slurm" if nodeid.startswith("tests/slurm/") else super()._split_scope(nodeid)

    config.option.loadscopereorder = False  # xdist would put the files with the most tests first
    return Scheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """On an xdist worker: the files with more slow tests first, each file's tests in their own order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a plain run keeps pytest's order
    slow = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.path])  # stable: each file's tests keep their order


@pytest.hookimpl(tryfirst=True)  # before pytest reads the base folder
def pytest_configure(config):
    """Under xdist, temporary folders that are no longer than a plain run's.

    Workers put theirs one level deeper (popen-gw0/); tests that point TMPDIR into tmp_path start forkservers
    whose socket path must stay under AF_UNIX's ~107 bytes.
    """
    if getattr(config.option, "numprocesses", None) and not config.option.basetemp and \
            not hasattr(config, "workerinput"):
        config.option.basetemp = config._short_basetemp = tempfile.mkdtemp(prefix="pt-")


def pytest_unconfigure(config):
    """The short base folder goes once every test passed (pytest keeps its own numbered ones for a while)."""
    base = getattr(config, "_short_basetemp", None)
    if base and getattr(config, "_all_passed", False):
        shutil.rmtree(base, ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
    session.config._all_passed = exitstatus == 0


@pytest.hookimpl(tryfirst=True)  # before any fixture of the test is set up
def pytest_runtest_setup(item):
    """A test marked needs_torchvision skips, naming why, where torchvision doesn't import (asked only then)."""
    if item.get_closest_marker("needs_torchvision") is None:
        return
    from _torchvision import torchvision_problem

    problem = torchvision_problem()
    if problem:
        pytest.skip(f"needs a torchvision that loads: {problem}")


# Python's own per-process helpers (one each for the whole session, they exit with pytest): not leftover ranks.
# The forkserver's ranks are its children, so they are still found (children(recursive=True)).
_SINGLETONS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver import main")


def _live_children():
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and not any(s in " ".join(p.cmdline()) for s in _SINGLETONS):
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture(autouse=True)
def no_orphan_processes():
    """Every test must end with all its child processes gone (after a short grace period for reaping)."""
    yield
    deadline = time.monotonic() + 5.0
    left = _live_children()
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = _live_children()
    if left:
        desc = [f"{p.pid} {p.name()} {' '.join(p.cmdline()[:4])}" for p in left]
        for p in left:
            p.kill()
        pytest.fail(f"test left {len(left)} child process(es) behind: {desc}")


@pytest.fixture(scope="session")
def small_cfg():
    """A tiny, deterministic CPU configuration: 2 ranks, gloo, offline digits, 8 steps, every gradient kept."""
    from ddp_helpers import TrainConfig

    return TrainConfig(dataset="mnist-5k", backend="gloo", max_steps=8, threads_per_rank=1,
                       capture_grad_steps=tuple(range(8)), seed=0)


@pytest.fixture(scope="session")
def small_run(small_cfg):
    """One real 2-rank DDP run shared by the read-only tests."""
    from ddp_helpers import run_training

    return run_training(small_cfg, progress=False, start_method="fork")
