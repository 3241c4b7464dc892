"""Nothing outlives a launch: the processes a rank starts end with it, ranks die with a parent killed at any
moment (a forkserver still preloading too), and what a hard-killed launch left is removed by the next one.
Each test kills at a moment it waits for (a marker the code writes, a process appearing), not after a sleep."""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from ddp_helpers import RankFailedError, launch
from ddp_helpers.ranks import folders as C

from _procs import ENDS_WITHIN_S, describe_and_kill, outliving, running, survivors_of_killed, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.NoSuchProcess:
        return ""


def _hello(rank: int, world_size: int) -> int:
    return rank


# ------------------------------------------------------------------ what a rank starts
def _starts_a_sleeper(rank: int, world_size: int, fail: bool, detach: bool, marks: str):
    p = subprocess.Popen(["sleep", "1000"], start_new_session=detach)  # detach: it leaves the rank's group too
    with open(os.path.join(marks, f"rank{rank}"), "w") as fh:
        fh.write(f"{p.pid} {psutil.Process(p.pid).create_time()}")  # which process it is, even once reaped
    if fail and rank == 1:
        raise ValueError("fails after starting a process")
    return p.pid


def _still_running(pid: int, created: float) -> list:
    try:
        p = psutil.Process(pid)
        return [p] if p.create_time() == created and running(p) else []  # not another process given the pid
    except psutil.NoSuchProcess:
        return []


@pytest.mark.parametrize("fail, detach", [(False, False), (True, False), (False, True)])
def test_processes_a_rank_started_end_with_the_launch(fail, detach, tmp_path):
    try:
        launch(_starts_a_sleeper, 2, args=(fail, detach, str(tmp_path)))
        assert not fail
    except RankFailedError as e:
        assert fail and e.rank == 1
    sleepers = [line.split() for line in (f.read_text() for f in sorted(tmp_path.iterdir()))]
    assert len(sleepers) == 2, sleepers
    started = [p for pid, created in sleepers for p in _still_running(int(pid), float(created))]
    left = outliving(started, timeout=3.0)  # from the launch's return
    names = describe_and_kill(left)
    assert not left, f"outlived the launch: {names}"


# ------------------------------------------------------------------ a parent killed at any moment
PARENT = textwrap.dedent("""
    import os, sys, time
    from ddp_helpers import launch

    def sleepy(rank, world_size, marks):
        open(os.path.join(marks, f"rank{rank}"), "w").close()  # running fn: the test kills the parent now
        time.sleep(60)

    if __name__ == "__main__":
        print("launching", flush=True)
        launch(sleepy, 2, args=(sys.argv[2],), start_method=sys.argv[1])
""")


def _starting(parent: subprocess.Popen, method: str) -> bool:
    """The launch's first processes exist: the forkserver (auto), or both spawned ranks (importing torch)."""
    try:
        kids = [_cmd(p) for p in psutil.Process(parent.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    if method == "spawn":
        return sum("--multiprocessing-fork" in c for c in kids) == 2
    return any("forkserver" in c for c in kids)


@pytest.mark.parametrize("method, moment", [("auto", "starting"), ("auto", "running"), ("spawn", "starting"),
                                            ("spawn", "running")])
@pytest.mark.slow
def test_ranks_die_with_a_parent_killed_at_any_moment(tmp_path, method, moment):
    script, marks = tmp_path / "parent.py", tmp_path / "marks"
    script.write_text(PARENT)
    marks.mkdir()
    parent = subprocess.Popen([sys.executable, str(script), method, str(marks)], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT)
    assert parent.stdout.readline().strip() == "launching"
    if moment == "starting":  # the server is preloading torch (auto), or the spawned ranks import it
        assert wait_for(lambda: _starting(parent, method), 60, parent), f"no rank process (exit {parent.poll()})"
        assert not list(marks.iterdir()), "the ranks ran fn already: the moment to test was missed"
    else:  # both ranks run fn (each has written its mark)
        assert wait_for(lambda: len(list(marks.iterdir())) == 2, 120, parent), \
            f"the ranks never ran fn (parent exit code {parent.poll()})"
    names = survivors_of_killed(parent)
    assert not names, f"{len(names)} process(es) outlived their parent by {ENDS_WITHIN_S:.0f} s: {names}"


SLOW_PRELOAD_PARENT = textwrap.dedent("""
    import os
    from ddp_helpers import launch

    def hello(rank, world_size):
        return rank

    if __name__ == "__main__":
        os.environ["DDP_HELPERS_PRELOAD"] = "slow_preload"  # inside the server's watch: a server still preloading
        print("launching", flush=True)
        launch(hello, 2, start_method="forkserver")
""")


@pytest.mark.slow
def test_a_forkserver_still_preloading_ends_with_its_killed_launcher(tmp_path):
    preloading = tmp_path / "preloading"
    (tmp_path / "slow_preload.py").write_text(f"open({str(preloading)!r}, 'w').close()\n"
                                              "import time\ntime.sleep(30)\n")
    script = tmp_path / "parent.py"
    script.write_text(SLOW_PRELOAD_PARENT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    assert parent.stdout.readline().strip() == "launching"
    assert wait_for(preloading.exists, 60, parent), "the forkserver never reached its preload"  # inside the 30 s
    names = survivors_of_killed(parent)
    assert not names, f"{len(names)} process(es) outlived their launcher by {ENDS_WITHIN_S:.0f} s: {names}"


# ------------------------------------------------------------------ what a killed launch left
def test_log_folders_of_dead_owners_are_removed_at_the_next_launch(tmp_path, monkeypatch):
    monkeypatch.setattr(C.tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(dead.pid).create_time()
    dead.wait()
    folders = {name: tmp_path / (C.RUN_DIR_PREFIX + name) for name in ("dead", "mine", "reused", "foreign")}
    for folder in folders.values():
        folder.mkdir()
    (folders["dead"] / "owner").write_text(f"{dead.pid} {started}")
    (folders["mine"] / "owner").write_text(f"{os.getpid()} {psutil.Process().create_time()}")
    (folders["reused"] / "owner").write_text(f"{os.getpid()} {psutil.Process().create_time() - 100}")
    assert launch(_hello, 2) == [0, 1]
    assert sorted(p.name for p in tmp_path.glob(C.RUN_DIR_PREFIX + "*")) == sorted(
        C.RUN_DIR_PREFIX + n for n in ("mine", "foreign"))  # a folder without an owner file is not ours


HARD_KILLED = textwrap.dedent("""
    import multiprocessing.synchronize, os
    from ddp_helpers import launch

    made = multiprocessing.synchronize.SemLock.__init__

    def noted(self, *args, **kwargs):  # a named semaphore is what a SIGKILL leaves in /dev/shm
        with open("semaphores.txt", "a") as fh:
            fh.write("one\\n")
        made(self, *args, **kwargs)

    multiprocessing.synchronize.SemLock.__init__ = noted

    def wait(rank, world_size, here):
        import time
        open(os.path.join(here, f"running{rank}"), "w").close()  # all the launch makes exists: the test kills now
        time.sleep(600)

    if __name__ == "__main__":
        os.setpgrp()
        print("launching", flush=True)
        launch(wait, 2, args=(os.getcwd(),))
""")


@pytest.mark.slow
def test_what_a_hard_killed_launch_left_is_gone_after_the_next_launch(tmp_path, monkeypatch):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    script = tmp_path / "parent.py"
    script.write_text(HARD_KILLED)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                              env={**env, "PYTHONPATH": ROOT})
    assert parent.stdout.readline().strip() == "launching"
    assert wait_for(lambda: len(glob.glob(str(tmp_path / "running*"))) == 2, 120, parent), \
        f"the ranks never ran (parent exit code {parent.poll()})"
    family = psutil.Process(parent.pid).children(recursive=True)
    os.killpg(parent.pid, signal.SIGKILL)  # what Jupyter's hard kill does to a kernel's process group
    parent.wait()
    describe_and_kill(outliving(family, timeout=ENDS_WITHIN_S))
    assert not (tmp_path / "semaphores.txt").exists(), "the launch made named semaphores (SIGKILL leaves them)"
    left = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "*")))
    assert any(n.startswith(C.MP_DIR_PREFIX) for n in left) and any(n.startswith(C.RUN_DIR_PREFIX) for n in left)
    assert not [n for n in left if n.startswith("pymp-")], left  # multiprocessing's own folder: nothing knows it
    # The next launch, here (a fresh interpreter would prove nothing more): fork, no server to start
    monkeypatch.setattr(C.tempfile, "tempdir", str(tmp_path))
    assert launch(_hello, 2, start_method="fork") == [0, 1]
    assert glob.glob(str(tmp_path / "ddp_helpers-*")) == [], os.listdir(tmp_path)
