"""The test cluster is what the other tests here take it for (two nodes with their own hostname, address and
TMPDIR, one shared file system, srun's tasks spread one per node), and says why where it can't run."""
from __future__ import annotations

import pytest


def test_where_it_cannot_run_it_says_why(slurm_tool, monkeypatch):
    """The reason the fixture skips with: not root, or a program missing (named, with the packages to install)."""
    monkeypatch.setattr(slurm_tool.os, "geteuid", lambda: 1000)
    assert "needs root" in slurm_tool.unavailable()
    monkeypatch.setattr(slurm_tool.os, "geteuid", lambda: 0)
    monkeypatch.setattr(slurm_tool.shutil, "which", lambda cmd, path=None: None if cmd == "slurmd" else cmd)
    assert slurm_tool.unavailable() == ("the SLURM test cluster needs slurmd (apt-get install slurm-wlm munge "
                                        "iproute2 util-linux)")


@pytest.mark.slow
def test_two_nodes_with_their_own_host_address_and_tmpdir(slurm, tmp_path):
    shared = tmp_path / "seen"
    shared.mkdir()
    script = ('echo "$(hostname) $(hostname -I) $TMPDIR $SLURM_PROCID" > ' f'{shared}/$SLURM_PROCID')
    slurm.run(["srun", "-N2", "--ntasks-per-node=1", "sh", "-c", script], timeout=30)
    seen = sorted((shared / str(r)).read_text().split() for r in range(2))
    hosts, addrs, tmpdirs = ([row[i] for row in seen] for i in range(3))
    assert hosts == ["n1", "n2"]
    assert addrs == [slurm.addrs["n1"], slurm.addrs["n2"]]
    assert tmpdirs == [slurm.node_tmpdir("n1"), slurm.node_tmpdir("n2")]
