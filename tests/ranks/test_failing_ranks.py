"""A rank that raises, is killed, hangs or ends without a result ends the job, is named, and the time it took is
measured from the failure itself (the ranks' rows carry CLOCK_MONOTONIC: one clock for every process here)."""
from __future__ import annotations

import datetime
import os
import signal
import socket
import threading
import time

import numpy as np
import psutil
import pytest
import torch
import torch.distributed as dist

from ddp_helpers import RankFailedError, TrainConfig, launch, run_training
from ddp_helpers.common.errors import ConfigError
from ddp_helpers.engine.faults import InjectedFault
from ddp_helpers.ranks.checks import free_port
from ddp_helpers.ranks.reports import Report, diagnose

from _procs import running

# multiprocessing's helpers by what they run: a forked rank's command line is pytest's, which may name a file
# such as test_forkserver_signals.py
MP_HELPERS = ("multiprocessing.resource_tracker import main", "multiprocessing.forkserver import main")

SMALL = TrainConfig(dataset="mnist-5k", max_steps=12, threads_per_rank=1)
DETECT_S = 10  # from a failure to run_training raising: the launcher polls, ends the others and reads the rows


def _last_row_end(records) -> float:
    """When this rank finished its last recorded step (CLOCK_MONOTONIC, the clock of every process here)."""
    return float(records.step_start_s[-1] + records.step_time_s[-1])


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.NoSuchProcess:
        return ""


@pytest.mark.parametrize("start_method", [pytest.param("spawn", marks=pytest.mark.slow), "fork"])
def test_rank_that_raises_ends_the_job_with_its_error(start_method, monkeypatch):
    # Rank 0 publishes its step 4 and then ends on its own (its step-5 all-reduce loses its peer): the wait for it
    # is ended by that exit, not by SETTLE_S's 0.3 s, which a loaded machine can outlast.
    monkeypatch.setenv("DDP_HELPERS_SETTLE_S", "120")
    port = free_port()
    with pytest.raises(RankFailedError) as e:
        run_training(SMALL.replace(fault_rank=1, fault_step=5, master_port=port), progress=False,
                     start_method=start_method)
    raised = time.monotonic()
    err = e.value
    assert err.rank == 1 and isinstance(err.original, InjectedFault) and err.__cause__ is err.original
    assert "inject_fault" in err.traceback_text and "rank 1 failed" in str(err)
    partial = err.partial_result
    assert not partial.complete and [len(r) for r in partial.ranks] == [5, 5]
    assert np.isfinite(partial.ranks[0].loss).all() and partial.fingerprints_agree()
    # The fault fires as rank 1 starts step 5, right after its step 4 ended: the job ends within DETECT_S of it
    # (however long the ranks took to start: spawn's import torch is not part of the promise).
    took = raised - _last_row_end(partial.ranks[1])
    assert took < DETECT_S, f"run_training raised {took:.1f} s after rank 1's fault"
    assert _port_is_free(port), "the rendezvous port must be free again"


def test_rank_killed_by_sigkill_is_detected():
    with pytest.raises(RankFailedError) as e:
        run_training(SMALL.replace(fault_rank=0, fault_step=3, fault_kind="kill"), progress=False,
                     start_method="fork")
    raised = time.monotonic()
    assert e.value.rank == 0 and "SIGKILL" in str(e.value)
    assert e.value.partial_result.n_steps == 3
    took = raised - _last_row_end(e.value.partial_result.ranks[0])  # rank 0 kills itself as it starts step 3
    assert took < DETECT_S, f"run_training raised {took:.1f} s after rank 0 was killed"


@pytest.mark.slow
def test_rank_killed_from_outside_is_detected():
    """A real external SIGKILL (as the OOM killer would send), once both ranks have trained 3 steps."""
    killed = {}

    def kill_a_rank(steps, total):
        assert min(steps) < 5000, "no rank was found to kill"  # raised here, it ends the run instead of hanging
        if killed or min(steps) < 3:
            return
        ranks = [p for p in psutil.Process().children() if running(p) and not any(
            s in _cmd(p) for s in MP_HELPERS)]  # forked: the ranks are this one's children, with pytest's command line
        if len(ranks) == 2:
            killed["at"] = time.monotonic()
            os.kill(ranks[1].pid, signal.SIGKILL)

    with pytest.raises(RankFailedError) as e:
        run_training(SMALL.replace(max_steps=None, epochs=1000), progress=False, start_method="fork",
                     on_progress=kill_a_rank)
    raised = time.monotonic()
    assert "at" in killed and "SIGKILL" in str(e.value)
    assert raised - killed["at"] < DETECT_S, f"run_training raised {raised - killed['at']:.1f} s after the kill"


@pytest.mark.slow
def test_stuck_rank_is_named_after_the_collective_timeout():
    with pytest.raises(RankFailedError) as e:
        run_training(SMALL.replace(fault_rank=1, fault_step=2, fault_kind="hang", timeout_s=2), progress=False,
                     start_method="fork")
    raised = time.monotonic()
    partial = e.value.partial_result
    assert e.value.rank == 1 and "stopped responding" in str(e.value)
    assert partial.n_steps == 2
    # Rank 0's step-2 all-reduce starts after its step 1 ended and times out timeout_s later; rank 1 hangs as it
    # starts step 2, right after its step 1 ended.
    assert raised - _last_row_end(partial.ranks[0]) >= 2, "named before timeout_s ran out"
    took = raised - _last_row_end(partial.ranks[1])
    assert took < 2 + DETECT_S, f"run_training raised {took:.1f} s after rank 1 hung (timeout_s=2)"


def _some_ranks_never_arrive(rank: int, world_size: int, asleep: int):
    if 0 < rank <= asleep:
        threading.Event().wait()  # busy elsewhere: never reaches the barrier (the launcher ends it)
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=2), wait_all_ranks=True)
    return rank


@pytest.mark.parametrize("asleep", [1, 2])
def test_every_rank_the_others_waited_for_is_named(asleep):
    # rank 0's own error names the ranks that never came; the launcher's diagnosis names each of them too
    with pytest.raises(RankFailedError) as e:
        launch(_some_ranks_never_arrive, 3, args=(asleep,), threads_per_rank=1, quiet=True)
    missing = list(range(1, asleep + 1))
    said = next(t for t in [e.value.message, *e.value.others] if "monitoredBarrier" in t)
    assert f"Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier" in said
    assert e.value.rank == 1 and e.value.message.startswith("stopped responding")
    assert ("as did rank 2" in e.value.message) == (asleep == 2)
    assert ("waiting for them" if asleep == 2 else "waiting for it") in e.value.message


@pytest.mark.parametrize("launched", [True, False])
@pytest.mark.parametrize("silent", [[1], [1, 3], [1, 2, 3]])
def test_the_diagnosis_names_every_silent_rank_it_can_see(tmp_path, silent, launched):
    # rank 0 timed out in a collective; the others reported nothing. launch() started every rank here, so each
    # silent one is named; a torchrun rank reads only its node's folder (a rank silent there may have reported on
    # its own node), so it names the lowest only, as before
    timed_out = Report(False, text="DistBackendError: timed out", in_collective=True)
    reports = {r: timed_out for r in range(4) if r not in silent}
    codes = [1 if r in reports else -15 for r in range(4)] if launched else None
    err = diagnose(reports, str(tmp_path), 4, first=0, codes=codes)
    also = {1: "", 2: ", as did rank 3", 3: ", as did ranks 2 and 3"}[len(silent)]
    expected = (f"stopped responding{also}:" if launched
                else "reported nothing while the others failed in a collective with it: it was killed")
    assert err.rank == 1 and err.message.startswith(expected), err.message
    assert ("them" in err.message) == (launched and len(silent) > 1)


@pytest.mark.slow
def test_next_run_works_right_after_a_failure():
    with pytest.raises(RankFailedError):
        run_training(SMALL.replace(fault_rank=0, fault_step=1), progress=False, start_method="fork")
    ok = run_training(SMALL.replace(max_steps=3), progress=False, start_method="fork")
    assert ok.complete and ok.n_steps == 3


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


def _hello(rank: int, world_size: int):
    return rank


def _waits_long(rank: int, world_size: int, marks: str):
    open(os.path.join(marks, f"rank{rank}"), "w").close()  # running: the test may kill the server now
    time.sleep(60)


@pytest.mark.slow
def test_a_killed_forkserver_is_named_and_the_next_launch_starts_a_new_one(tmp_path, monkeypatch):
    import multiprocessing.forkserver as fs

    monkeypatch.setenv("DDP_HELPERS_SERVER_EXIT_S", "120")  # seen dead when it is a zombie or gone, not by a clock

    launch(_hello, 2)  # the server is running

    killed = []

    def kill_server():  # once, when both ranks run their function
        if not killed and len(os.listdir(tmp_path)) == 2:
            killed.append(fs._forkserver._forkserver_pid)
            os.kill(killed[0], signal.SIGKILL)

    with pytest.raises(RankFailedError) as e:
        launch(_waits_long, 2, args=(str(tmp_path),), on_poll=kill_server, init_group=False)
    assert killed and "forkserver" in e.value.message and "the next launch starts a new one" in e.value.message
    assert launch(_hello, 2) == [0, 1]


@pytest.mark.parametrize("name", ["SERVER_EXIT_S", "SETTLE_S"])
def test_a_failure_window_is_a_setting_the_environment_overrides(name, monkeypatch):
    from ddp_helpers.ranks import launcher

    assert launcher.window_s(name) == getattr(launcher, name)
    monkeypatch.setenv(f"DDP_HELPERS_{name}", "7.5")
    assert launcher.window_s(name) == 7.5
    for bad in ("0", "-1", "soon", "inf", "nan"):
        monkeypatch.setenv(f"DDP_HELPERS_{name}", bad)
        with pytest.raises(ConfigError, match=f"DDP_HELPERS_{name}=.*unset it"):
            launcher.launch(_hello, 2, start_method="fork")  # refused before any process starts (LaunchPlan.checked)
