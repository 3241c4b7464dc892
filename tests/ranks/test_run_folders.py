"""Run folders: a live one is never taken for a dead launch's (not even from another PID namespace), and a rank's
log is capped and read from its end."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import psutil
import pytest

from ddp_helpers import RankFailedError, launch
from ddp_helpers.ranks import folders as C
from ddp_helpers.ranks.output_log import LOG_CAP_BYTES, read_tail

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OWNER = textwrap.dedent("""
    import os, sys
    from ddp_helpers.ranks.folders import new_run_dir
    folder = new_run_dir()
    print(folder, os.getpid(), flush=True)
    sys.stdin.readline()  # until the test has run another launch's clean-up
    print("alive" if os.path.isdir(folder) else "gone", flush=True)
""")


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0, reason="needs unshare and root")
@pytest.mark.slow
def test_a_launch_in_another_pid_namespace_keeps_its_folder(tmp_path, monkeypatch):
    """Containers sharing /tmp: the owner's pid means nothing here (pid 1 or 2 there is init here)."""
    monkeypatch.setattr(C.tempfile, "tempdir", str(tmp_path))
    owner = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", OWNER],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                             env={**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": ROOT})
    try:
        folder, pid = owner.stdout.readline().split()
        assert int(pid) < 10, "not in a PID namespace of its own"
        C.remove_stale()  # what every launch does first
        owner.stdin.write("go\n")
        owner.stdin.flush()
        assert owner.stdout.readline().strip() == "alive"
    finally:
        owner.communicate(timeout=60)
    C.remove_stale()  # its owner is gone now: the folder is garbage
    assert not os.path.exists(folder)


def test_a_folder_whose_owner_file_names_a_dead_pid_is_kept_while_its_lock_is_held(tmp_path, monkeypatch):
    monkeypatch.setattr(C.tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    folder = C.owned_dir(C.RUN_DIR_PREFIX)  # held by this process
    with open(os.path.join(folder, "owner"), "w") as fh:  # as another namespace's owner would read from here
        fh.write(f"{dead.pid} 0")
    C.remove_stale()
    assert os.path.isdir(folder)
    C.release(folder)
    C.remove_stale()
    assert not os.path.exists(folder)


@pytest.mark.skipif(C.fcntl is None, reason="flock: POSIX only")
def test_the_lock_probe_tells_a_held_lock_from_a_free_one_and_holds_it_for_its_block(tmp_path):
    """The one flock probe (a dead launch's folder, a torchrun rank gone, the last rank out): held by a live
    process it is not free; free once that process ends; unknown for a missing file; held while the block runs."""
    lock = str(tmp_path / "owner.lock")
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | "
                               "os.O_CREAT); fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); "
                               "sys.stdin.readline()", lock], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with C.lock_free(lock) as free:
            assert free is False
    finally:
        holder.communicate("go\n", timeout=60)
    with C.lock_free(lock) as free:
        assert free is True
        fd = os.open(lock, os.O_RDONLY)
        try:
            with pytest.raises(OSError):  # another descriptor can't share it while the block holds it
                C.fcntl.flock(fd, C.fcntl.LOCK_SH | C.fcntl.LOCK_NB)
        finally:
            os.close(fd)
    with C.lock_free(str(tmp_path / "missing.lock")) as free:
        assert free is None


def _prints_a_lot_then_fails(rank: int, world_size: int, megabytes: int) -> None:
    line = "x" * 1023
    for _ in range(megabytes * 1024):
        print(line)
    print("the last line", flush=True)
    raise RuntimeError("printed without end")


def test_a_rank_that_prints_without_end_keeps_at_most_twice_the_cap():
    """Each log file stops at the cap however fast the rank prints (issue 61: the cap is kept as the log is
    written), and the newest output is what is kept."""
    run_dir = C.new_run_dir()
    try:
        with pytest.raises(RankFailedError) as e:
            launch(_prints_a_lot_then_fails, 2, args=(3 * LOG_CAP_BYTES // 2**20,), init_group=False,
                   start_method="fork", run_dir=run_dir, quiet=True)
        logs = [os.path.join(run_dir, f"rank{e.value.rank}.log{end}") for end in ("", ".1")]
        sizes = [os.path.getsize(p) for p in logs if os.path.exists(p)]
        assert len(sizes) == 2 and max(sizes) <= LOG_CAP_BYTES, sizes
        assert read_tail(logs[0], 100).endswith("the last line\n")
    finally:
        C.remove_run_dir(run_dir)


def test_a_huge_logs_tail_is_read_from_its_end(tmp_path):
    log = tmp_path / "rank0.log"
    with open(log, "wb") as fh:
        fh.truncate(2 * 2**30)  # 2 GiB (sparse): reading it all would take 2 GiB of memory
        fh.seek(0, os.SEEK_END)
        fh.write(b"the error at the end\n")
    rss = psutil.Process().memory_info().rss
    assert read_tail(str(log), 100).endswith("the error at the end\n")
    assert psutil.Process().memory_info().rss - rss < 50 * 2**20


def test_a_short_log_is_completed_from_the_one_set_aside(tmp_path):
    log = tmp_path / "rank0.log"
    (tmp_path / "rank0.log.1").write_text("older line\n")
    log.write_text("newest\n")
    assert read_tail(str(log), 100) == "older line\nnewest\n"
