"""Shared fixtures: small real DDP runs, and a check that no test leaves a process behind."""
from __future__ import annotations

import os
import time

import psutil
import pytest

os.environ.setdefault("DDP_HELPERS_PROGRESS", "0")  # keep test logs free of progress bars


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
