"""Interrupts and signals: Ctrl-C in a notebook or a program, SIGTERM and SIGHUP to the parent or to a Jupyter
kernel end every rank (and the program as the signal would have); a forked rank keeps no handler of the launcher's.
Each test signals once the ranks are training (a marker the run writes), and times the ending from the signal."""
from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch

from ddp_helpers import TrainConfig, launch, run_training
from ddp_helpers.ranks import folders as C
from ddp_helpers.ranks import joining
from ddp_helpers.ranks import launcher as L

from _procs import ENDS_WITHIN_S, default_signals, describe_and_kill, outliving, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "DDP_HELPERS_PROGRESS": "0"}
SMALL = TrainConfig(dataset="mnist-5k", max_steps=12, threads_per_rank=1)
TRAINING = "lambda steps, total: min(steps) >= 5 and Path({marker!r}).touch()"  # run_training's on_progress


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.NoSuchProcess:  # a short-lived helper (torch's imports run a few) that ended just now
        return ""


def _ranks_of_this_process() -> list:
    # By what multiprocessing runs in its helpers, not a bare word: a forked rank's command line is pytest's, which
    # may name a file such as test_forkserver_signals.py.
    helpers = ("multiprocessing.resource_tracker import main", "multiprocessing.forkserver import main")
    return [p for p in psutil.Process().children() if not any(s in _cmd(p) for s in helpers)]


def _hello(rank, world_size):
    return rank


# ------------------------------------------------------------------------------------------ Ctrl-C in a notebook
def _barrier_forever(rank: int, world_size: int, marks: str):
    open(os.path.join(marks, f"rank{rank}"), "w").close()  # running fn: the test may interrupt now
    while True:
        torch.distributed.barrier()


@pytest.mark.slow
def test_keyboard_interrupt_in_the_notebook_ends_every_child(tmp_path):
    """Ctrl-C in a notebook is a KeyboardInterrupt in the launcher's poll: raised there once both ranks run fn."""
    ranks, interrupted = [], []

    def poll():
        if not interrupted and len(os.listdir(tmp_path)) == 2:
            ranks.extend(_ranks_of_this_process())
            interrupted.append(time.monotonic())
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        launch(_barrier_forever, 2, args=(str(tmp_path),), start_method="fork", on_poll=poll)
    returned = time.monotonic()
    assert len(ranks) == 2, [_cmd(p) for p in ranks]
    assert not outliving(ranks, timeout=0), "launch returned with ranks still running"
    assert returned - interrupted[0] < L.GRACE_S + 5, f"launch returned {returned - interrupted[0]:.1f} s after Ctrl-C"
    ok = run_training(SMALL.replace(max_steps=2), progress=False, start_method="fork")
    assert ok.n_steps == 2


def test_an_interrupt_while_the_ranks_start_ends_those_already_running(monkeypatch):
    # Ctrl-C (or any error) after a rank started but before the launcher watches them: those started must end
    # too, or they wait in the rendezvous and the program's exit hangs joining them.
    started, interrupted = [], []

    def interrupted_here(procs, *a, **k):
        started.extend(procs)
        interrupted.append(time.monotonic())
        raise KeyboardInterrupt

    monkeypatch.setattr(joining, "RankProcesses", interrupted_here)  # what watches them, once all have started
    with pytest.raises(KeyboardInterrupt):
        launch(_hello, 2, start_method="fork")
    returned = time.monotonic()
    assert len(started) == 2 and all(p.exitcode is not None for p in started)
    assert returned - interrupted[0] < L.GRACE_S + 5, f"launch returned {returned - interrupted[0]:.1f} s after Ctrl-C"


# ------------------------------------------------------------------------------------------ a program's parent
SIGINT_SCRIPT = textwrap.dedent("""
    import faulthandler, signal, sys
    from pathlib import Path
    from ddp_helpers import TrainConfig, run_training
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for a stack dump if the run hangs
    if __name__ == "__main__":
        try:
            run_training(TrainConfig(dataset="mnist-5k", epochs=1000, threads_per_rank=1), progress=False,
                         on_progress=lambda steps, total: min(steps) >= 5 and Path(sys.argv[1]).touch())
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            sys.exit(130)
""")


def _hung(proc: subprocess.Popen, left: list, what: str) -> str:
    """What still runs (the parent's stack included), all of it killed: the failure message."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGUSR1)  # faulthandler writes every thread's stack to stderr
        time.sleep(1)  # a moment to write it (the failure's message only: no moment of the run is waited for)
    names = describe_and_kill(left + [psutil.Process(proc.pid)] if proc.poll() is None else left)
    _, err = proc.communicate()
    return f"{what}: {names}; the parent's stderr: {err[-4000:]}"


@pytest.mark.slow
def test_sigint_to_the_parent_ends_every_child(tmp_path):
    """Ctrl-C to a program: its ranks end after the SIGINT, the program runs its own handler and exits
    130, and the forkserver, which ends when its launcher does, after the program's exit (each promise
    timed from its own event: the program's exit, an interpreter holding torch, is slow on a loaded machine)."""
    script, trained = tmp_path / "long_run.py", tmp_path / "trained"
    script.write_text(SIGINT_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(trained)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)
    # until both ranks have trained 5 steps: the signal lands in training, not in start-up
    if not wait_for(trained.exists, 120, proc):
        pytest.fail(proc.communicate(timeout=10)[1][-2000:] if proc.poll() is not None else "no step in 120 s")
    server = [p for p in psutil.Process(proc.pid).children() if "forkserver" in _cmd(p)]
    ranks = [r for s in server for r in s.children(recursive=True)]  # forked from the server, its command line
    assert len(server) == 1 and len(ranks) >= 2, [_cmd(p) for p in server + ranks]
    proc.send_signal(signal.SIGINT)
    # outliving, not psutil.wait_procs: an orphan's zombie (reaped by PID 1 when it gets to it) has exited.
    left = outliving(ranks, timeout=ENDS_WITHIN_S)
    assert not left, _hung(proc, left, f"ranks still running {ENDS_WITHIN_S:.0f} s after SIGINT")
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(_hung(proc, [], "the program still running 60 s after SIGINT"))
    assert proc.returncode == 130 and "interrupted" in out, err[-2000:]
    left = outliving(server, timeout=ENDS_WITHIN_S)
    assert not left, _hung(proc, left, f"the forkserver still running {ENDS_WITHIN_S:.0f} s after its launcher's exit")


PARENT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from ddp_helpers import TrainConfig, run_training

    if __name__ == "__main__":
        run_training(TrainConfig(dataset="mnist-5k", epochs=1000, threads_per_rank=1), progress=False,
                     on_progress=lambda steps, total: min(steps) >= 5 and Path(sys.argv[1]).touch())
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
@pytest.mark.slow
def test_a_signal_to_the_parent_stops_the_ranks_and_removes_the_log_folder(tmp_path, sig):
    script, trained = tmp_path / "parent.py", tmp_path / "trained"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), str(trained)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env={**ENV, "TMPDIR": str(tmp_path)},  # its log folder lands here
                              preexec_fn=default_signals)
    if not wait_for(trained.exists, 120, parent):  # the ranks are in the training loop
        pytest.fail(parent.communicate(timeout=10)[1][-2000:] if parent.poll() is not None else "no step in 120 s")
    family = psutil.Process(parent.pid).children(recursive=True)
    parent.send_signal(sig)
    _, stderr = parent.communicate(timeout=15)
    alive = outliving(family, timeout=ENDS_WITHIN_S)
    names = describe_and_kill(alive)
    assert parent.returncode == -sig, stderr[-2000:]  # it ended as the signal would have ended it
    assert not alive, f"{len(alive)} process(es) outlived the parent: {names}"
    assert glob.glob(str(tmp_path / (C.RUN_DIR_PREFIX + "*"))) == [], "the run's log folder was left behind"
    assert "leaked semaphore" not in stderr


KERNEL_CELL = """
from pathlib import Path
from ddp_helpers import TrainConfig, run_training
run_training(TrainConfig(dataset="mnist-5k", epochs=1000, threads_per_rank=1), progress=False,
             on_progress={training})
"""


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_sigterm_to_a_jupyter_kernel_mid_run_ends_the_kernel_and_its_ranks(tmp_path):
    from jupyter_client.manager import KernelManager

    trained = tmp_path / "trained"
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=ROOT, env={**ENV, "TMPDIR": str(tmp_path)})
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        kernel = psutil.Process(km.provisioner.process.pid)
        kc.execute(KERNEL_CELL.format(training=TRAINING.format(marker=str(trained))))
        assert wait_for(trained.exists, 120), "the kernel's ranks trained no 5 steps in 120 s"
        family = kernel.children(recursive=True)
        assert any("rank" in " ".join(p.cmdline()) or p.name().startswith("python") for p in family)
        kernel.send_signal(signal.SIGTERM)
        try:
            code = kernel.wait(timeout=15)
        except psutil.TimeoutExpired:
            code = None
        alive = outliving(family, timeout=ENDS_WITHIN_S)
        names = describe_and_kill(alive)
        assert code == -signal.SIGTERM, f"the kernel did not end on SIGTERM (exit status {code})"
        assert not alive, f"outlived the kernel: {names}"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


# ------------------------------------------------------------------------------------------ inside a rank
def _sigterm_is_default(rank: int, world_size: int) -> bool:
    return signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_forked_rank_does_not_inherit_the_launchers_signal_handlers():
    # While launching, the parent turns SIGTERM into a clean exit; a forked copy of that handler in a rank would
    # report torch's termination of a stuck rank as the rank's own error ("SystemExit: 143").
    saved = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        assert launch(_sigterm_is_default, 2, start_method="fork") == [True, True]
    finally:
        signal.signal(signal.SIGTERM, saved)
