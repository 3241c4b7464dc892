"""Two hosts for real (issue #27 §8): two network namespaces joined by a veth pair stand in for two machines,
each with torchrun and 2 ranks; this machine's hostname resolves to 127.0.0.1, as on many laptops and clusters."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

from ddp_helpers import TrainResult

from _procs import wait_for

NODES = (("ddpt-node0", "ddpt-veth0", "10.77.0.1"), ("ddpt-node1", "ddpt-veth1", "10.77.0.2"))
TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable))
ENV = {**os.environ, "DDP_HELPERS_PROGRESS": "0"}
ENV.pop("GLOO_SOCKET_IFNAME", None)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture(scope="module")
def two_hosts():
    """Two namespaces, 10.77.0.1 and .2 on either end of one veth pair; removed afterwards."""
    if shutil.which("ip") is None or TORCHRUN is None:
        pytest.skip("needs iproute2's ip and torchrun")
    try:
        for ns, _, _ in NODES:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)  # a leftover of a killed run
            _ip("netns", "add", ns)
        _ip("link", "add", NODES[0][1], "type", "veth", "peer", "name", NODES[1][1])
        for ns, dev, addr in NODES:
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as e:
        for ns, _, _ in NODES:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        pytest.skip(f"can't make network namespaces here: {getattr(e, 'stderr', b'') or e}")
    yield NODES
    for ns, _, _ in NODES:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


def _start(node: int, out, ifname: dict, port: int, extra=(), nproc: int = 2) -> subprocess.Popen:
    ns = NODES[node][0]
    tmp = out.parent / f"tmp{node}"  # a temp dir of its own, as another machine has
    tmp.mkdir(exist_ok=True)
    env = {**ENV, "TMPDIR": str(tmp), **({"GLOO_SOCKET_IFNAME": ifname[node]} if node in ifname else {})}
    cmd = ["ip", "netns", "exec", ns, TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", str(nproc),
           "--master-addr", NODES[0][2], "--master-port", str(port), "-m", "ddp_helpers.train", "--dataset", "mnist-5k",
           "--max-steps", "3", "--threads-per-rank", "1", "--bind-cores", "false", "--no-plots", "--out", str(out),
           *extra]
    log = open(out.parent / f"node{node}.log", "w+")  # a file, not a pipe: nobody reads it while the node runs
    proc = subprocess.Popen(cmd, cwd=out.parent, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log = log
    return proc


def free_port_in(ns: str) -> int:
    """A port free on node 0's address, as ddp_helpers.ranks.checks.free_port picks one (bind to port 0), asked
    inside node 0's namespace, where its store will listen: a fixed port can be taken by anything running."""
    code = f"from ddp_helpers.ranks.checks import free_port; print(free_port({NODES[0][2]!r}))"
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, timeout=60, env=ENV)
    return int(out.stdout)


def _finish(procs, timeout_s: float):
    """Each node's output, once it ended (killed if it still runs timeout_s later)."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    logs = []
    for p in procs:
        p.log.seek(0)
        logs.append(p.log.read())
        p.log.close()
    return logs


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_two_hosts_train_with_the_interface_that_routes_to_the_master(two_hosts, tmp_path):
    """No GLOO_SOCKET_IFNAME: gloo would advertise 127.0.0.1 (the hostname's address); the ranks pick the veth.

    Each host has its own temp dir: node 1's ranks' rows reach global rank 0 over the group, not as files, and
    only global rank 0 writes, though node 1 has a LOCAL_RANK 0 too (nb06's two-agent cell shows the shards
    follow RANK)."""
    port = free_port_in(NODES[0][0])
    procs = [_start(n, tmp_path / f"node{n}", {}, port) for n in (0, 1)]
    logs = _finish(procs, 240)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert not (tmp_path / "node1").exists()  # only global rank 0 writes
    assert [list((tmp_path / f"tmp{n}").glob("ddp_helpers-ranks-*")) for n in (0, 1)] == [[], []]  # removed
    res = TrainResult.load(str(tmp_path / "node0" / "result.json"))
    assert res.world_size == 4 and res.fingerprints_agree()  # 4 ranks on 2 hosts, identical parameters
    assert [len(r.step) for r in res.ranks] == [3] * 4  # every rank's rows, node 1's over the group


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_ranks_waiting_for_a_host_that_cant_be_reached_give_up_at_timeout_and_say_why(two_hosts, tmp_path):
    """Every rank advertises loopback (GLOO_SOCKET_IFNAME=lo, what the hostname's 127.0.0.1 gave before the
    interface was chosen): node 1's ranks fail to connect, and node 0's ranks, which torch's gloo leaves waiting
    for them long past timeout_s (74 s with --timeout-s 10 here), end at timeout_s and a grace, saying why.
    --timeout-s 3: the bound is the same code at any value, and the test waits it out. One rank per host: the
    bound is each rank's own, and two more fresh interpreters importing torch would only slow the test.

    Timed from node 1's end: node 0's rank starts waiting for node 1's once both have met at the store, before
    node 1's rank fails, so it gives up at most timeout_s and a grace after that (however long both took to start)."""
    port = free_port_in(NODES[0][0])
    procs = [_start(n, tmp_path / f"node{n}", {0: "lo", 1: "lo"}, port, extra=("--timeout-s", "3"), nproc=1)
             for n in (0, 1)]
    logs = []
    try:
        assert wait_for(lambda: procs[1].poll() is not None, 200), "node 1 never ended"
        node1_ended = time.monotonic()
        assert wait_for(lambda: procs[0].poll() is not None, 200), "node 0 never gave up"
        took = time.monotonic() - node1_ended
    finally:
        logs = _finish(procs, 10)
    assert procs[0].returncode != 0
    # Either our bound ended the wait (it names the store, the interface and GLOO_SOCKET_IFNAME), or gloo's own
    # connect failed first on node 0 too (it names the address it couldn't reach); never a silent wait.
    said = ("no process group after" in logs[0] and "GLOO_SOCKET_IFNAME" in logs[0]) or "connectFullMesh" in logs[0]
    assert said, logs[0][-3000:]
    assert took < 30, f"node 0 gave up {took:.0f} s after node 1 ended (timeout_s=3)"
