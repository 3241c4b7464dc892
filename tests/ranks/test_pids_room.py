"""The process-limit check counts a launch's own dying processes as leaving (issue 61, N7).

After a rank forked to a pids cgroup's limit and failed, the next launch was refused ("only 6 more may start
here") until the killed children were gone; seconds later it worked. Now a rank collects what it killed before it
exits, the forkserver collects the orphans of a killed rank, and the check waits for the exit of what this
process's launches ended (a pidfd each: the event), or says precisely that they are still leaving.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid

import pytest

from ddp_helpers.common.errors import ConfigError
from ddp_helpers.ranks import checks, cores

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
V1_PIDS = "/sys/fs/cgroup/pids"


@pytest.fixture
def killed_child(monkeypatch):
    """A process leading its own group, noted as ended by a launch, killed and not yet collected (a zombie)."""
    monkeypatch.setattr(cores, "_ENDED_GROUPS", {})
    child = subprocess.Popen(["sleep", "60"], start_new_session=True)
    cores.note_ended([child.pid])
    os.kill(child.pid, signal.SIGKILL)
    yield child
    child.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/stat")
def test_the_check_waits_for_what_a_launch_ended_then_reads_the_room_again(killed_child, monkeypatch):
    """The room is short while the killed process counts; it is read again once its exit has come."""
    rooms = iter([[(5, "pids.max=120, 115 in use")], [(100, "pids.max=120, 20 in use")]])
    monkeypatch.setattr(cores, "room_limits", lambda: next(rooms))
    assert killed_child.pid in _eventually_leaving()
    checks.RankSizes.checked(2, 1, owner="launch()")  # refused before: the first reading was the only one


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/stat")
def test_a_refusal_says_how_many_in_use_are_leaving(killed_child, monkeypatch):
    monkeypatch.setattr(cores, "room_limits", lambda: [(5, "pids.max=120, 115 in use")])
    _eventually_leaving()
    with pytest.raises(ConfigError, match=r"only 5 more may start here \(pids.max=120, 115 in use; 1 of those in "
                                          r"use are processes a launch in this process ended that have exited"):
        checks.RankSizes.checked(2, 1, owner="launch()")


def _eventually_leaving() -> list:
    os.waitid(os.P_PID, _only(cores._ENDED_GROUPS), os.WEXITED | os.WNOWAIT)  # its exit, the child left unreaped
    return cores.leaving()


def _only(groups: dict) -> int:
    (group,) = groups
    return group


SCRIPT = textwrap.dedent('''
    import json, os, sys, time
    from ddp_helpers import RankFailedError, launch

    def fork_to_the_limit():
        n = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(120)
                    os._exit(0)
                n += 1
        except OSError:
            return n

    def fails_after_forking(rank, world_size):
        if rank == 0:
            raise RuntimeError(f"forked {fork_to_the_limit()} and failed")
        return rank

    def killed_with_its_children(rank, world_size, marker):
        if rank == 0:
            fork_to_the_limit()
            open(marker, "w").close()
            time.sleep(120)
        while not os.path.exists(marker):
            time.sleep(0.01)
        raise RuntimeError("rank 1 fails while rank 0 and its children live")

    def ok(rank, world_size):
        return rank

    if __name__ == "__main__":
        cgroup, marker = sys.argv[1], sys.argv[2]
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as fh:
            fh.write(str(os.getpid()))  # this launcher, its forkserver and its ranks: in the limited cgroup
        launch(ok, 2, quiet=True)  # the forkserver started
        with open(os.path.join(cgroup, "pids.current")) as fh:
            used = int(fh.read())
        with open(os.path.join(cgroup, "pids.max"), "w") as fh:
            fh.write(str(used + 120))
        outcomes = []
        for fn, args in ((fails_after_forking, ()), (killed_with_its_children, (marker,))):
            try:
                launch(fn, 2, args=args, quiet=True)
            except RankFailedError as e:
                with open(os.path.join(cgroup, "pids.current")) as fh:
                    at_once = int(fh.read())
                try:
                    outcomes.append([str(e).splitlines()[0], at_once, launch(ok, 2, quiet=True)])
                except Exception as again:
                    outcomes.append([str(e).splitlines()[0], at_once, str(again)])
        print(json.dumps({"used": used, "outcomes": outcomes}))
''')


def _pids_cgroup_we_can_make() -> str:
    if os.name != "posix" or os.geteuid() != 0 or not os.access(V1_PIDS, os.W_OK):
        return ""
    return V1_PIDS


@pytest.mark.slow
@pytest.mark.skipif(not _pids_cgroup_we_can_make(), reason="needs root and cgroup v1's pids hierarchy to make a "
                                                           "pids cgroup (the monkeypatched tests above run anywhere)")
def test_in_a_real_pids_cgroup_the_next_launch_starts_at_once(tmp_path):
    """A rank that forks to pids.max and fails, then a rank killed with its children: each time the next
    launch, started at once, runs."""
    cgroup = os.path.join(_pids_cgroup_we_can_make(), f"ddp-helpers-test-{uuid.uuid4().hex[:8]}")
    os.mkdir(cgroup)
    try:
        script = tmp_path / "fork_to_the_limit.py"
        script.write_text(SCRIPT)
        out = subprocess.run([sys.executable, str(script), cgroup, str(tmp_path / "marker")], capture_output=True,
                             text=True, timeout=600, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
        assert out.returncode == 0, out.stderr[-3000:]
        figures = json.loads(out.stdout.strip().splitlines()[-1])
        (first, _, after_first), (second, _, after_second) = figures["outcomes"]
        assert "failed" in first and after_first == [0, 1], figures  # was: "only 6 more may start here"
        assert second.startswith("rank 1 failed") and after_second == [0, 1], figures
    finally:
        _remove_cgroup(cgroup)


def _remove_cgroup(cgroup: str) -> None:
    from _procs import wait_for

    with open(os.path.join(cgroup, "cgroup.procs")) as fh:
        for pid in fh.read().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert wait_for(lambda: _removed(cgroup), 60), f"{cgroup} still holds tasks"


def _removed(cgroup: str) -> bool:
    try:
        os.rmdir(cgroup)
    except FileNotFoundError:
        return True
    except OSError:  # its last tasks still leaving
        return False
    return True


def test_a_rank_collects_what_it_killed_before_it_exits(monkeypatch):
    """end_descendants: a child and the grandchild it left behind (adopted: the subreaper) are killed and reaped,
    so none of them still holds a pid; on Windows only killed (os.waitpid(-1) would wait on the rank itself)."""
    from ddp_helpers.ranks import ending

    pid = os.fork()
    if pid == 0:  # a process of the test standing in for a rank: its child forks a grandchild and exits
        ending.become_subreaper()
        child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                                  "subprocess.Popen(['sleep', '60']); sys.exit(0)"])
        child.wait()  # the grandchild is now an orphan, ours
        ending.end_descendants()
        try:
            os.waitpid(-1, os.WNOHANG)
            os._exit(3)  # a child left to collect
        except ChildProcessError:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    calls = []
    monkeypatch.setattr(os, "name", "nt")
    monkeypatch.setattr(ending, "kill_descendants", lambda: calls.append("killed"))
    monkeypatch.setattr(os, "waitpid", lambda *a: calls.append("waited"))
    ending.end_descendants()
    assert calls == ["killed"]
