"""pytest plugin for tools/suite_cpu.py: each test's window and its pytest process's own CPU, one JSON line each.

Loaded through PYTEST_PLUGINS by every pytest process suite_cpu.py's command starts (xdist workers included);
it writes to the folder named by $SUITE_CPU_DIR and does nothing when that is unset.
"""
from __future__ import annotations

import json
import os
import time

import pytest

DIR_ENV = "SUITE_CPU_DIR"


def _clock() -> float:
    """Seconds since boot, the clock of /proc/<pid>/stat's start times (Linux)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    folder = os.environ.get(DIR_ENV)
    t0, cpu0 = _clock(), time.process_time()  # process_time: every thread of this process
    yield
    if folder:
        record = {"id": item.nodeid, "pid": os.getpid(), "t0": t0, "t1": _clock(), "cpu": time.process_time() - cpu0}
        with open(os.path.join(folder, f"tests-{os.getpid()}.jsonl"), "a") as fh:
            fh.write(json.dumps(record) + "\n")
