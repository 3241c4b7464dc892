"""The test cluster is what the other tests here take it for: two nodes with their own hostname, address and
TMPDIR, one shared file system, and srun's tasks spread one per node."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


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
