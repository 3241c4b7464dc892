"""Reliability, round 3 (issue #27): blame named as what happened, nothing a rank starts outlives the launch,
signals end the process as they would have, nothing left by a killed launch survives the next one, large
captured arrays shared, the store on loopback only. Real processes, real signals, a real Jupyter kernel."""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest
import torch
import torch.distributed as dist

from ddp_helpers import RankFailedError, launch
from ddp_helpers.ranks import cleanup as C
from ddp_helpers.ranks.payload import dumps

from _procs import describe_and_kill, outliving, running

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------ a rank that ends without reporting
def _exits_silently(rank: int, world_size: int, collective: bool):
    if rank == 1:
        os._exit(0)
    if collective:
        dist.all_reduce(torch.ones(1))
    return rank


@pytest.mark.parametrize("collective", [False, True])
def test_a_rank_that_exits_without_a_result_is_named_as_such(collective):
    with pytest.raises(RankFailedError) as e:
        launch(_exits_silently, 2, args=(collective,), timeout_s=20)
    assert e.value.rank == 1
    assert "exited with code 0 without returning a result" in e.value.message
    assert "stopped responding" not in str(e.value)


def _waits_long(rank: int, world_size: int):
    time.sleep(60)


@pytest.mark.slow
def test_a_killed_forkserver_is_named_and_the_next_launch_starts_a_new_one():
    import multiprocessing.forkserver as fs

    launch(_hello, 2)  # the server is running

    def kill_server():
        if time.monotonic() - t0 > 1.0 and running(psutil.Process(fs._forkserver._forkserver_pid)):
            os.kill(fs._forkserver._forkserver_pid, signal.SIGKILL)

    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as e:
        launch(_waits_long, 2, on_poll=kill_server, init_group=False)
    assert "forkserver" in e.value.message and "the next launch starts a new one" in e.value.message
    assert launch(_hello, 2) == [0, 1]


def _hello(rank: int, world_size: int):
    return rank


# ------------------------------------------------------------------ nothing a rank starts outlives the launch
def _starts_a_sleeper(rank: int, world_size: int, fail: bool, detach: bool):
    p = subprocess.Popen(["sleep", "1000"], start_new_session=detach)  # detach: it leaves the rank's group too
    if fail and rank == 1:
        raise ValueError("fails after starting a process")
    return p.pid


@pytest.mark.parametrize("fail, detach", [(False, False), (True, False), (False, True)])
def test_processes_a_rank_started_end_with_the_launch(fail, detach):
    seen = []

    def watch():  # the sleepers while the ranks run
        for child in psutil.Process().children(recursive=True):
            try:
                if child.name() == "sleep":
                    seen.append(child)
            except psutil.NoSuchProcess:
                pass

    try:
        launch(_starts_a_sleeper, 2, args=(fail, detach), on_poll=watch)
        assert not fail
    except RankFailedError as e:
        assert fail and e.rank == 1
    sleepers = {p.pid: p for p in seen}
    left = outliving(list(sleepers.values()), timeout=3.0)
    names = describe_and_kill(left)
    assert not left, f"outlived the launch: {names}"


# ------------------------------------------------------------------ signals and what a killed launch left
KERNEL_CELL = textwrap.dedent("""
    from ddp_helpers import TrainConfig, run_training
    run_training(TrainConfig(dataset="mnist-5k", epochs=1000, threads_per_rank=1), progress=False)
""")


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_sigterm_to_a_jupyter_kernel_mid_run_ends_the_kernel_and_its_ranks(tmp_path):
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=ROOT, env={**os.environ, "TMPDIR": str(tmp_path), "DDP_HELPERS_PROGRESS": "0"})
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        kernel = psutil.Process(km.provisioner.process.pid)
        kc.execute(KERNEL_CELL)
        deadline = time.monotonic() + 90
        while not glob.glob(str(tmp_path / (C.RUN_DIR_PREFIX + "*", )[0])) and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(3.0)  # training by now
        family = kernel.children(recursive=True)
        assert any("rank" in " ".join(p.cmdline()) or p.name().startswith("python") for p in family)
        kernel.send_signal(signal.SIGTERM)
        try:
            code = kernel.wait(timeout=15)
        except psutil.TimeoutExpired:
            code = None
        alive = outliving(family, timeout=5.0)
        names = describe_and_kill(alive)
        assert code == -signal.SIGTERM, f"the kernel did not end on SIGTERM (exit status {code})"
        assert not alive, f"outlived the kernel: {names}"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


HARD_KILLED = textwrap.dedent("""
    import multiprocessing.synchronize, os
    from ddp_helpers import launch

    made = multiprocessing.synchronize.SemLock.__init__

    def noted(self, *args, **kwargs):  # a named semaphore is what a SIGKILL leaves in /dev/shm
        with open("semaphores.txt", "a") as fh:
            fh.write("one\\n")
        made(self, *args, **kwargs)

    multiprocessing.synchronize.SemLock.__init__ = noted

    def wait(rank, world_size):
        import time
        time.sleep(600)

    if __name__ == "__main__":
        os.setpgrp()
        print("launching", flush=True)
        launch(wait, 2)
""")


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_what_a_hard_killed_launch_left_is_gone_after_the_next_launch(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    script = tmp_path / "parent.py"
    script.write_text(HARD_KILLED)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                              env={**env, "PYTHONPATH": ROOT})
    assert parent.stdout.readline().strip() == "launching"
    deadline = time.monotonic() + 60
    while len(glob.glob(str(tmp_path / "ddp_helpers-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(2.0)
    family = psutil.Process(parent.pid).children(recursive=True)
    os.killpg(parent.pid, signal.SIGKILL)  # what Jupyter's hard kill does to a kernel's process group
    parent.wait()
    describe_and_kill(outliving(family, timeout=5.0))
    assert not (tmp_path / "semaphores.txt").exists(), "the launch made named semaphores (SIGKILL leaves them)"
    left = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "*")))
    assert any(n.startswith(C.MP_DIR_PREFIX) for n in left) and any(n.startswith(C.RUN_DIR_PREFIX) for n in left)
    assert not [n for n in left if n.startswith("pymp-")], left  # multiprocessing's own folder: nothing knows it
    after = subprocess.run([sys.executable, "-c", "from ddp_helpers import launch\n"
                            "def f(r, w): return r\n"
                            "if __name__ == '__main__': print(launch(f, 2))"],
                           capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert after.stdout.strip() == "[0, 1]", after.stderr[-2000:]
    assert glob.glob(str(tmp_path / "ddp_helpers-*")) == [], os.listdir(tmp_path)


# ------------------------------------------------------------------ large values captured by a cell's function
def test_a_large_captured_array_travels_once_through_shared_memory():
    big = np.arange(8 * 2**20, dtype=np.float32)  # 32 MiB

    def rank_sees(rank, world_size):
        return float(big[-1]), big.flags.writeable

    assert len(dumps(rank_sees)) < 2**20, "the array was pickled by value"
    assert launch(rank_sees, 2, start_method="forkserver") == [(float(big[-1]), False)] * 2
    small = np.arange(10)
    assert len(dumps(lambda: small)) < 2**16


# ------------------------------------------------------------------ the store listens on loopback only
def test_no_socket_of_a_single_machine_run_listens_on_a_wildcard_address():
    listening = []

    def record():
        procs = [psutil.Process()] + psutil.Process().children(recursive=True)
        for p in procs:
            try:
                listening.extend((p.pid, c.laddr.ip) for c in p.net_connections(kind="inet")
                                 if c.status == psutil.CONN_LISTEN)
            except psutil.Error:
                pass

    def step(rank, world_size):
        for _ in range(5):
            dist.all_reduce(torch.ones(1))
            time.sleep(0.1)
        return rank

    launch(step, 2, on_poll=record)
    assert listening, "no listening socket seen during the run"
    wild = [(pid, ip) for pid, ip in listening if ip in ("0.0.0.0", "::")]
    assert not wild, f"listening on every interface: {wild}"
