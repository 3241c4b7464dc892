"""Where a launch's ranks meet, and who can reach it: the package's own groups through a store only this user can
open; addresses that would open it to the network, or aren't this machine's, refused before anything starts."""
from __future__ import annotations

import math
import os
import subprocess

import pytest

from ddp_helpers import ConfigError, TrainConfig, launch, run_training
from ddp_helpers.ranks import launcher as L

PROBE = """
import json, socket, sys
port, store = int(sys.argv[1]), sys.argv[2]
out = {}
try:
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    out["connect"] = "connected"
except OSError as e:
    out["connect"] = type(e).__name__
try:
    open(store, "rb").close()
    out["store file"] = "opened"
except OSError as e:
    out["store file"] = type(e).__name__
print(json.dumps(out))
"""


def _probe_as_nobody(rank: int, world_size: int) -> dict:
    """Run by rank 0 while the group exists: what another user of this machine can reach of it."""
    import json

    import torch.distributed as dist

    import tempfile

    from ddp_helpers.ranks.ending import LAUNCH_MARK

    run_dir = os.path.join(tempfile.gettempdir(), os.environ[LAUNCH_MARK])  # the mark is the run folder's name
    assert os.path.isfile(os.path.join(run_dir, "store")), run_dir
    result = {}
    if rank == 0:
        done = subprocess.run([SYSTEM_PYTHON, "-c", PROBE, os.environ["MASTER_PORT"], os.path.join(run_dir, "store")],
                              capture_output=True, text=True, user="nobody", timeout=60)
        result = json.loads(done.stdout)
    dist.barrier()  # the group stays up until the probe is done
    return result


SYSTEM_PYTHON = "/usr/bin/python3"  # the probe needs only the standard library, and a Python `nobody` may run


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0 or not os.path.exists("/proc/self/fd/1")
                    or not os.access(SYSTEM_PYTHON, os.X_OK),
                    reason="needs root (to run a probe as another user), Linux and /usr/bin/python3")
def test_another_user_cant_reach_the_store_of_a_launchs_group():
    seen = launch(_probe_as_nobody, 2, threads_per_rank=1)[0]
    assert seen == {"connect": "ConnectionRefusedError", "store file": "PermissionError"}, seen


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_wildcard_address_is_refused_before_any_process_starts(host, monkeypatch):
    started = []
    monkeypatch.setattr(L, "start_ranks", lambda *a, **k: started.append(1))
    with pytest.raises(ConfigError, match="every interface"):
        launch(lambda r, w: r, 2, host=host)
    with pytest.raises(ConfigError, match=r"TrainConfig\.master_addr=.* every interface"):
        run_training(TrainConfig(dataset="mnist-5k", master_addr=host), progress=False)
    assert not started


def test_an_address_that_isnt_this_machines_is_refused_before_the_data_loads(monkeypatch):
    import ddp_helpers.engine.runner as R

    loaded = []
    monkeypatch.setattr(R, "load_data", lambda *a, **k: loaded.append(1))
    with pytest.raises(ConfigError, match=r"master_addr='192\.0\.2\.1' is not accepted: an address of this machine"):
        run_training(TrainConfig(dataset="mnist-5k", master_addr="192.0.2.1"), progress=False)  # TEST-NET-1
    assert not loaded


@pytest.mark.parametrize("timeout_s", [0, -1, math.nan, math.inf, None, "60"])
def test_a_timeout_that_isnt_a_number_of_seconds_is_refused(timeout_s):
    with pytest.raises(ConfigError, match=r"launch\(timeout_s=.*\) is not accepted: seconds"):
        launch(lambda r, w: r, 2, timeout_s=timeout_s)


def _joins_itself(rank: int, world_size: int) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo")  # env://: the TCP store the launch serves for it
    dist.destroy_process_group()
    return rank


def test_a_function_that_joins_through_env_still_gets_a_tcp_store_on_loopback():
    assert launch(_joins_itself, 2, init_group=False, threads_per_rank=1) == [0, 1]


def test_the_readme_says_what_torchruns_store_exposes_next_to_its_command():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    readme = open(os.path.join(root, "README.md")).read()
    at = -1
    while (at := readme.find("torchrun --standalone", at + 1)) >= 0:  # every such command
        assert "every interface" in readme[at:at + 700], f"say next to the command that its store is open: {at}"
