"""Nothing a rank starts outlives the launch: not a process in a session of its own, not a double-fork daemon,
whether the rank returns, fails, or is killed; and a second Ctrl-C can't cut the launch's ending short."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from ddp_helpers import RankFailedError, launch
from ddp_helpers.ranks import ending as E
from ddp_helpers.ranks.launcher import LaunchInterrupted

from _procs import ENDS_WITHIN_S, describe_and_kill, outliving

DAEMON = ("import os, time\n"
          "if os.fork() == 0:\n"
          "    os.setsid()\n"
          "    if os.fork() == 0:\n"
          "        open({mark!r}, 'w').write(str(os.getpid()))\n"
          "        time.sleep(1000)\n"
          "    os._exit(0)\n")


def _starts_detached(rank: int, world_size: int, marks: str, then: str) -> int:
    """A sleeper in a session of its own and a double-fork daemon (its pid in a file: it left us), then `then`."""
    session = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    with open(os.path.join(marks, f"session{rank}"), "w") as fh:
        fh.write(str(session.pid))
    subprocess.run([sys.executable, "-c", DAEMON.format(mark=os.path.join(marks, f"daemon{rank}"))], check=True)
    while not os.path.exists(os.path.join(marks, f"daemon{rank}")):
        time.sleep(0.01)  # the daemon has written its pid: it runs
    if then == "raise" and rank == 1:
        raise ValueError("fails after starting detached processes")
    if then == "sigkill" and rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def _detached(marks) -> list:
    procs = []
    for mark in marks.iterdir():
        try:
            procs.append(psutil.Process(int(mark.read_text())))
        except psutil.NoSuchProcess:
            pass
    return procs


@pytest.mark.parametrize("then", ["return", "raise", "sigkill"])
def test_detached_processes_a_rank_started_end_with_the_launch(tmp_path, then):
    try:
        launch(_starts_detached, 2, args=(str(tmp_path), then), init_group=False)
        assert then == "return"
    except RankFailedError as e:
        assert then != "return" and e.rank == 1
    started = list(tmp_path.iterdir())
    assert len(started) == 4 if then != "sigkill" else len(started) >= 2
    # the launch returned: they must be gone (zombies at most)
    left = outliving(_detached(tmp_path), timeout=ENDS_WITHIN_S)
    names = describe_and_kill(left)
    assert not left, f"outlived the launch: {names}"


def _ignores_sigterm(rank: int, world_size: int, marks: str) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL ends it
    open(os.path.join(marks, f"rank{rank}"), "w").write(str(os.getpid()))
    time.sleep(1000)


def test_a_second_interrupt_during_the_grace_period_still_ends_every_rank(tmp_path, monkeypatch):
    def interrupt_when_both_run():
        if len(list(tmp_path.iterdir())) == 2:
            raise KeyboardInterrupt  # the first Ctrl-C

    real_stop = E.stop_processes

    def stop_with_a_second_interrupt(procs, grace_s=E.GRACE_S):
        os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C, while the ranks ignore SIGTERM
        real_stop(procs, grace_s)

    monkeypatch.setattr(E, "stop_processes", stop_with_a_second_interrupt)
    with pytest.raises(KeyboardInterrupt) as e:
        launch(_ignores_sigterm, 2, args=(str(tmp_path),), init_group=False, on_poll=interrupt_when_both_run,
               start_method="fork")
    assert isinstance(e.value, LaunchInterrupted)
    ranks = [psutil.Process(int(p.read_text())) for p in tmp_path.iterdir() if _exists(int(p.read_text()))]
    assert not outliving(ranks, timeout=0.5), "a rank outlived the launch"


def _exists(pid: int) -> bool:
    return psutil.pid_exists(pid)
