"""Ctrl-C while a launch starts its ranks (issue 49, B6): a rank forked as the interrupt comes is ended with the
others, and a rank whose launch has already ended exits without a word (its traceback used to land in a later
notebook cell)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from ddp_helpers import launch
from ddp_helpers.ranks.launcher import LaunchInterrupted


def _sleepy(rank, world_size):
    time.sleep(60)
    return rank


def test_a_rank_forked_as_ctrl_c_comes_is_ended(monkeypatch):
    """The interrupt arrives right after the first rank's fork, before the launcher has noted it."""
    from multiprocessing.context import ForkProcess

    real_start, started = ForkProcess.start, []

    def start_then_interrupt(self):
        real_start(self)
        started.append(self.pid)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, as the notebook's stop button sends it

    monkeypatch.setattr(ForkProcess, "start", start_then_interrupt)
    with pytest.raises(LaunchInterrupted):
        launch(_sleepy, 2, start_method="fork")
    assert len(started) == 1
    deadline = time.monotonic() + 10
    while psutil.pid_exists(started[0]) and psutil.Process(started[0]).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the rank forked during the interrupt still runs"
        time.sleep(0.05)


RANK_AFTER_ITS_LAUNCH = """
import os, sys
from ddp_helpers.ranks.env import RankSpec
from ddp_helpers.ranks.rank import rank_entry
spec = RankSpec(dict(os.environ), {"WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
                sys.argv[1], "gloo", 5.0, 1, None, True)
rank_entry(0, spec, None)
"""


def test_a_rank_whose_launch_has_ended_exits_silently(tmp_path):
    gone = str(tmp_path / "removed-run-folder")
    proc = subprocess.run([sys.executable, "-c", RANK_AFTER_ITS_LAUNCH, gone], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 1 and proc.stderr == "" and proc.stdout == "", proc.stderr
