"""Ctrl-C while a launch starts its ranks (issue 49, B6): a rank forked as the interrupt comes is ended with the
others, and a rank whose launch has already ended exits without a word (its traceback used to land in a later
notebook cell)."""
from __future__ import annotations

import multiprocessing
import os
import signal
import time

import psutil
import pytest

from ddp_helpers import launch
from ddp_helpers.ranks.env import RankSpec
from ddp_helpers.ranks.launcher import LaunchInterrupted
from ddp_helpers.ranks.rank import rank_entry


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


def _rank_after_its_launch(run_dir: str) -> None:
    """A rank's entry (boot.rank_main's next step) whose launch removed its run folder before it got there."""
    spec = RankSpec(dict(os.environ), {"WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
                    run_dir, "gloo", 5.0, 1, None, True)
    rank_entry(0, spec, None)


def test_a_rank_whose_launch_has_ended_exits_silently(tmp_path, capfd):
    """Forked from this process, as the launcher and its forkserver fork ranks (a fresh interpreter importing
    torch would prove nothing more: the rank's entry is the same code); capfd holds what it wrote to fds 1 and 2."""
    rank = multiprocessing.get_context("fork").Process(target=_rank_after_its_launch,
                                                       args=(str(tmp_path / "removed-run-folder"),))
    rank.start()
    rank.join(120)
    out, err = capfd.readouterr()
    assert rank.exitcode == 1 and err == "" and out == "", (rank.exitcode, err)
