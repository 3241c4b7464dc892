"""The macOS and Windows branches, tested on Linux by monkeypatching; importing launch without torch, warm_up.
(Ranks that die with their parent: test_nothing_outlives.py.)"""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest
from _procs import without_torch_note

import ddp_helpers.ranks.cores as P
import ddp_helpers.ranks.starting as S
from ddp_helpers import TrainConfig
from ddp_helpers.engine import faults
from ddp_helpers.ranks.checks import check_start_method
from ddp_helpers.ranks.startmethod import resolve_start_method
from ddp_helpers.engine.runner import ProgressBar
from ddp_helpers.engine.telemetry import RunRows, TableShape, create_rank_tables


def test_auto_is_forkserver_where_the_platform_has_it_else_spawn(monkeypatch):
    assert resolve_start_method("auto") == "forkserver"  # Linux
    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])  # Windows
    assert resolve_start_method("auto") == "spawn" and check_start_method("auto") == "spawn"
    from ddp_helpers import LaunchError

    with pytest.raises(LaunchError, match="'fork' is not available"):
        check_start_method("fork")


def test_peak_memory_without_the_resource_module_comes_from_psutil(monkeypatch):
    monkeypatch.setattr(S, "resource", None)  # no resource module, as on Windows
    peak = S.peak_rss_bytes()
    assert peak >= psutil.Process().memory_info().rss * 0.5 and peak < 2**40


def test_peak_memory_on_macos_is_already_in_bytes(monkeypatch):
    import resource

    linux = S.peak_rss_bytes(children=False)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert S.peak_rss_bytes(children=False) == resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert linux == 1024 * resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def test_cores_without_sched_getaffinity(monkeypatch):
    monkeypatch.delattr(os, "sched_getaffinity")
    assert P.usable_cores() == list(range(os.cpu_count() or 1))


def test_kill_fault_without_sigkill_uses_sigterm(monkeypatch):
    sent = []
    monkeypatch.delattr(signal, "SIGKILL")
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(sig))
    with pytest.raises(faults.InjectedFault):  # os.kill is mocked, so the function goes on and raises
        faults.inject_fault(TrainConfig(fault_rank=0, fault_step=0, fault_kind="kill"), 0, 0)
    assert sent == [signal.SIGTERM]


def test_progress_bar_counts_from_the_first_step(tmp_path):
    rows = RunRows(str(tmp_path), 2)
    bar = ProgressBar(rows, 10, True, "2 ranks")
    try:
        bar()  # no rank has made its rows file yet
        assert bar.bar.desc.startswith("starting 2 ranks") and bar.bar.n == 0
        counts = [create_rank_tables(str(tmp_path), r, TableShape(10, 1, 0, 1))["count"] for r in range(2)]
        counts[0][0] = 1  # rank 0 finished its first step, rank 1 not yet
        bar()
        assert bar.bar.desc.startswith("training 2 ranks") and bar.bar.n == 0
        counts[0][0] = counts[1][0] = 4
        bar()
        assert bar.bar.n == 4
    finally:
        bar.close()
        rows.close()


def test_importing_launch_leaves_torch_unloaded():
    """A spawned rank re-imports its program's main module before boot.rank_main ties its life to the parent's: a
    script that imports only `launch` gets there in a fraction of a second, not after torch."""
    code = "import sys; from ddp_helpers import launch; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stdout + done.stderr


WARM_UP_THEN_LAUNCH = textwrap.dedent("""
    import operator, sys
    import multiprocessing.forkserver as fs
    import ddp_helpers

    ddp_helpers.warm_up()
    server = fs._forkserver._forkserver_pid
    print("torch before:", "torch" in sys.modules, "server:", server is not None, flush=True)
    print("ranks:", ddp_helpers.launch(operator.add, 2), "same server:", fs._forkserver._forkserver_pid == server)
    print("torch after:", "torch" in sys.modules)  # the ranks had it from the server: this process never needed it
""")


@pytest.mark.slow
def test_warm_up_starts_the_server_before_torch_is_imported_and_the_launch_uses_it():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", WARM_UP_THEN_LAUNCH], capture_output=True, text=True, cwd=root,
                         env=dict(os.environ, PYTHONPATH=root, DDP_HELPERS_PROGRESS="0"), timeout=120)
    lines = without_torch_note(out.stdout).splitlines()
    assert lines == ["torch before: False server: True", "ranks: [2, 3] same server: True", "torch after: False"], (
        out.stdout + out.stderr)


def test_warm_up_where_there_is_no_forkserver_starts_nothing(monkeypatch):
    import multiprocessing.forkserver as fs

    from ddp_helpers.ranks.startmethod import warm_up

    monkeypatch.setattr(multiprocessing, "get_all_start_methods", lambda: ["spawn"])  # Windows
    monkeypatch.setattr(fs, "ensure_running", lambda: pytest.fail("warm_up started a forkserver on Windows"))
    warm_up()
