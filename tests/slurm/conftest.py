"""The SLURM test cluster (tools/slurm_cluster.py) for the tests in this folder: started once for the session,
shared by pytest-xdist's workers, stopped by the last one out; skipped, with the reason, where it can't run.

A test takes the `slurm` fixture (a `SlurmCluster`): `slurm.sbatch(script, "-N2", ...)`, `slurm.wait_job(id)`,
`slurm.run(["srun", ...])`, `slurm.run(["scancel", id])`, `slurm.env()` for a command of its own,
`slurm.node_tmpdir("n1")`. Jobs see the repository and /tmp (pytest's tmp_path) as every node's shared file system.
"""
from __future__ import annotations

import fcntl
import importlib.util
import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tool():
    """tools/slurm_cluster.py, a script rather than a module of the package."""
    spec = importlib.util.spec_from_file_location("slurm_cluster", ROOT / "tools" / "slurm_cluster.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("slurm_cluster", module)
    spec.loader.exec_module(module)
    return module


def _lock(path: str, how: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, how)
    except BaseException:
        os.close(fd)
        raise
    return fd


@pytest.fixture(scope="session")
def slurm_tool():
    """tools/slurm_cluster.py as a module."""
    return _tool()


@pytest.fixture(scope="session")
def slurm(slurm_tool):
    """The running test cluster. Each xdist worker holds a shared lock while it uses it; starting and stopping
    happen under an exclusive one, and the last worker out stops a cluster the tests started (one started by
    hand is left running)."""
    tool = slurm_tool
    why = tool.unavailable()
    if why:
        pytest.skip(why)
    cluster = tool.SlurmCluster()
    gate = _lock(cluster.lock_path("start"), fcntl.LOCK_EX)
    users = None
    try:
        # another session's cluster is never restarted under it (a slow sinfo); ours is taken once it runs
        if not cluster.in_use() and not cluster.status():
            cluster.start()
            open(os.path.join(cluster.state, "started-by-tests"), "w").close()
        users = _lock(cluster.lock_path("users"), fcntl.LOCK_SH)
    except BaseException as e:
        if users is not None:
            os.close(users)
        if isinstance(e, tool.Unavailable):
            pytest.skip(str(e))
        raise
    finally:
        fcntl.flock(gate, fcntl.LOCK_UN)
    yield cluster
    fcntl.flock(gate, fcntl.LOCK_EX)
    try:
        os.close(users)  # our shared lock goes; an exclusive one now means no other worker uses the cluster
        last = _lock(cluster.lock_path("users"), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        last = None
    try:
        if last is not None and os.path.exists(os.path.join(cluster.state, "started-by-tests")):
            cluster.stop()
    finally:
        if last is not None:
            os.close(last)
        os.close(gate)
