"""Runs side by side: two runs from two programs at once, two launches in one process on different ports, and no
socket of a single-machine run listening beyond its host's address."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from ddp_helpers import launch

ENV = {**os.environ, "DDP_HELPERS_PROGRESS": "0"}


def _hello(rank, world_size):
    return rank


@pytest.mark.slow
def test_two_runs_at_the_same_time_from_two_processes(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-m", "ddp_helpers.train", "--dataset", "mnist-5k", "--max-steps", "20",
                               "--threads-per-rank", "1", "--no-plots", "--out", str(tmp_path / f"run{i}")],
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = [p.communicate(timeout=180) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-2000:]
    from ddp_helpers import TrainResult

    a, b = (TrainResult.load(str(tmp_path / f"run{i}" / "result.json")) for i in range(2))
    assert a.ranks[0].param_fingerprint == b.ranks[0].param_fingerprint


def _master_port(rank, world_size):
    return os.environ["MASTER_PORT"]


def test_two_launches_in_one_process_get_different_ports():
    # The default start method: forking from a process with a second launch running in another thread could
    # copy that thread's locks into the children (what Python warns about for fork in threaded programs).
    seen = []
    th = threading.Thread(target=lambda: seen.append(launch(_master_port, 2)))
    th.start()
    seen.append(launch(_master_port, 2))
    th.join()
    assert len(seen) == 2 and all(len(set(ports)) == 1 for ports in seen) and seen[0][0] != seen[1][0]


# ------------------------------------------------------------------ the store listens on loopback only
def _talk_until_seen(rank: int, world_size: int, marks: str):
    open(os.path.join(marks, f"rank{rank}"), "w").close()  # in the group, every socket made
    while True:  # collectives keep the group's connections in use until the parent has looked
        flag = torch.tensor([float(os.path.exists(os.path.join(marks, "seen")))])
        dist.all_reduce(flag)  # summed: every rank leaves in the same round
        if flag.item() > 0:
            return rank
        time.sleep(0.01)  # pacing only: the loop ends on the parent's marker


def test_no_socket_of_a_single_machine_run_listens_on_a_wildcard_address(tmp_path):
    listening = []

    def record():  # once both ranks are in their function: the store's socket and every rank's
        if len(os.listdir(tmp_path)) < 2 or (tmp_path / "seen").exists():
            return
        for p in [psutil.Process()] + psutil.Process().children(recursive=True):
            try:
                listening.extend((p.pid, c.laddr.ip) for c in p.net_connections(kind="inet")
                                 if c.status == psutil.CONN_LISTEN)
            except psutil.Error:
                pass
        (tmp_path / "seen").touch()

    assert launch(_talk_until_seen, 2, args=(str(tmp_path),), on_poll=record) == [0, 1]
    assert listening, "no listening socket seen during the run"
    wild = [(pid, ip) for pid, ip in listening if ip in ("0.0.0.0", "::")]
    assert not wild, f"listening on every interface: {wild}"
