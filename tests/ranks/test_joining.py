"""RankProcesses.join, the launcher's watch over its ranks (torch's ProcessContext.join without torch): all exit
with 0, or the first to fail is named once the others have been given their grace, then SIGTERM, then SIGKILL."""
from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import time

import pytest

from ddp_helpers.ranks.joining import RankExited, RankProcesses

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="fork and signals: Linux and macOS")
FORK = multiprocessing.get_context("fork")


def _exit_with(code: int, after_s: float = 0.0) -> None:
    time.sleep(after_s)
    os._exit(code)


def _exit_when(event, code: int) -> None:
    event.wait(120)
    os._exit(code)


def _ignore_sigterm_then_wait(ignoring) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ignoring.set()
    time.sleep(300)


def _started(*targets) -> RankProcesses:
    procs = [FORK.Process(target=t, args=a) for t, a in targets]
    for p in procs:
        p.start()
    return RankProcesses(procs)


def _join_until_done(ranks: RankProcesses, grace_s: float = 5.0) -> bool:
    deadline = time.monotonic() + 120
    while not ranks.join(timeout=0.05, grace_s=grace_s):
        assert time.monotonic() < deadline, "the ranks never ended"
    return True


def test_every_rank_exiting_with_0_ends_the_join():
    go = FORK.Event()
    ranks = _started((_exit_with, (0,)), (_exit_when, (go, 0)))
    assert ranks.join(timeout=0.0, grace_s=5.0) is False  # rank 1 still running: not done yet
    go.set()
    assert _join_until_done(ranks) and ranks.join(timeout=0.0, grace_s=5.0) is True  # asked again: still done
    assert [p.exitcode for p in ranks.processes] == [0, 0]


def test_the_first_rank_to_fail_is_named_and_a_peer_that_waits_is_terminated():
    ranks = _started((time.sleep, (300,)), (_exit_with, (3,)))
    with pytest.raises(RankExited) as failed:
        _join_until_done(ranks, grace_s=0.1)
    assert (failed.value.index, failed.value.exitcode) == (1, 3)
    assert ranks.processes[0].exitcode == -signal.SIGTERM  # ended after its grace, not left running


def test_a_peer_that_ignores_sigterm_is_killed():
    ignoring = FORK.Event()
    ranks = _started((_ignore_sigterm_then_wait, (ignoring,)), (_exit_when, (ignoring, 1)))
    with pytest.raises(RankExited) as failed:
        _join_until_done(ranks, grace_s=0.1)
    assert failed.value.index == 1 and ranks.processes[0].exitcode == -signal.SIGKILL


def test_a_peer_that_ends_within_its_grace_is_not_signalled():
    ranks = _started((_exit_with, (0, 0.3)), (_exit_with, (2,)))
    with pytest.raises(RankExited):
        _join_until_done(ranks, grace_s=60.0)
    assert ranks.processes[0].exitcode == 0  # it reported its side and exited by itself
