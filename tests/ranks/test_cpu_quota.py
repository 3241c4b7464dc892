"""CPU quotas (containers, JupyterHub/Binder pods): they size the ranks' threads though every host core is visible."""
from __future__ import annotations

import pytest

import ddp_helpers.ranks.cores as P
import ddp_helpers.ranks.checks as C


def _tree(tmp_path, cgroup_lines, files):
    """A fake /proc/self/cgroup and /sys/fs/cgroup: files maps paths under the fake root to their text."""
    (tmp_path / "cgroup").write_text("\n".join(cgroup_lines) + "\n")
    root = tmp_path / "fs"
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return str(tmp_path / "cgroup"), str(root)


def test_cgroup_v2_quota_of_the_process_cgroup(tmp_path):
    cg, fs = _tree(tmp_path, ["0::/kubepods/pod1"], {"kubepods/pod1/cpu.max": "200000 100000\n"})
    assert P.cpu_quota(cg, fs) == 2.0


def test_cgroup_v2_tightest_limit_up_the_tree_wins(tmp_path):
    cg, fs = _tree(tmp_path, ["0::/a/b"], {"a/cpu.max": "150000 100000\n", "a/b/cpu.max": "max 100000\n",
                                             "cpu.max": "800000 100000\n"})
    assert P.cpu_quota(cg, fs) == 1.5


def test_cgroup_v2_unlimited(tmp_path):
    cg, fs = _tree(tmp_path, ["0::/user.slice"], {"user.slice/cpu.max": "max 100000\n"})
    assert P.cpu_quota(cg, fs) is None


def test_inside_a_container_the_mount_is_the_cgroup(tmp_path):
    # /proc/self/cgroup names a host path that the container's mount doesn't have: read the mount itself.
    cg, fs = _tree(tmp_path, ["0::/docker/0123abcd"], {"cpu.max": "100000 100000\n"})
    assert P.cpu_quota(cg, fs) == 1.0


def test_cgroup_v1_cfs_quota(tmp_path):
    cg, fs = _tree(tmp_path, ["4:memory:/x", "2:cpu,cpuacct:/docker/abc", "0::/"],
                   {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n",
                    "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
                    "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert P.cpu_quota(cg, fs) == 3.0


def test_cgroup_v1_unlimited_and_missing_files(tmp_path):
    cg, fs = _tree(tmp_path, ["1:cpu:/"], {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert P.cpu_quota(cg, fs) is None
    assert P.cpu_quota(str(tmp_path / "no-such-file"), fs) is None


def test_this_machine_reads_without_error():
    q = P.cpu_quota()
    assert q is None or q > 0
    assert 1 <= P.cpu_budget() <= len(P.usable_cores())


@pytest.fixture
def sixteen_cores_two_cpus(monkeypatch):
    """A pod on a 16-core host with a 2-CPU limit (docker --cpus=2, a Kubernetes CPU limit)."""
    monkeypatch.setattr(P, "usable_cores", lambda: list(range(16)))
    monkeypatch.setattr(P, "cpu_quota", lambda: 2.0)


def test_quota_caps_threads_per_rank(sixteen_cores_two_cpus):
    assert P.cpu_budget() == 2
    assert C.default_threads(2) == 1  # not 8: 16 threads on 2 CPUs' worth of time would thrash


def test_fractional_quota_rounds_down_but_keeps_one(monkeypatch):
    monkeypatch.setattr(P, "usable_cores", lambda: list(range(8)))
    monkeypatch.setattr(P, "cpu_quota", lambda: 2.5)
    assert P.cpu_budget() == 2
    monkeypatch.setattr(P, "cpu_quota", lambda: 0.5)
    assert P.cpu_budget() == 1


def test_quota_turns_automatic_binding_off(sixteen_cores_two_cpus):
    # Which of the host's cores are free is the host's business: pinning could land the ranks on busy ones.
    assert P.binding_plan(2, 1, "gloo", None) is None
    assert P.binding_plan(2, 1, "gloo", True) == [[0], [1]]  # asked for: bound within the quota's cores


def test_forced_binding_beyond_the_quota_is_refused_naming_it(sixteen_cores_two_cpus):
    with pytest.raises(ValueError, match="4 ranks x 1 thread need 4 cores of their own, and there are 16 usable "
                                         "cores, 2 of them allowed by the CPU quota"):
        P.binding_plan(4, 1, "gloo", True)


def test_no_quota_binds_automatically_as_before(monkeypatch):
    monkeypatch.setattr(P, "usable_cores", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(P, "cpu_quota", lambda: None)
    assert P.binding_plan(2, 2, "gloo", None) == [[0, 1], [2, 3]]
