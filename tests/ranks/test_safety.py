"""Launching safely: bad settings refused up front, failing/killed/stuck ranks end the job, interrupts, resume."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest
import torch

from ddp_helpers import ConfigError, LaunchError, RankFailedError, TrainConfig, launch, run_training
from ddp_helpers.ranks import launcher as L
from ddp_helpers.ranks.placement import free_port
from ddp_helpers.engine.faults import InjectedFault

from _procs import default_signals, describe_and_kill, outliving, running

ENV = {**os.environ, "DDP_HELPERS_PROGRESS": "0"}
SMALL = TrainConfig(dataset="mnist-5k", max_steps=12, threads_per_rank=1)


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


# ------------------------------------------------------------------------------------------ 1. bad settings
_taken = socket.socket()
_taken.bind(("127.0.0.1", 0))
_taken.listen(1)
TAKEN_PORT = _taken.getsockname()[1]

BAD = [
    ("world_size", dict(world_size=0)),
    ("world_size", dict(world_size=-2)),
    ("world_size", dict(world_size="2")),
    ("world_size", dict(world_size=2.0)),
    ("world_size", dict(world_size=True)),
    ("backend", dict(backend="mpi")),
    ("dataset", dict(dataset="cifar10")),
    ("batch_size", dict(batch_size=0)),
    ("batch_size", dict(batch_size=10**7)),
    ("batch_size", dict(batch_size=64.0)),
    ("lr", dict(lr=0)),
    ("lr", dict(lr=-0.1)),
    ("lr", dict(lr=float("nan"))),
    ("lr", dict(lr=float("inf"))),
    ("lr", dict(lr="0.01")),
    ("epochs", dict(epochs=0)),
    ("epochs", dict(epochs=1.5)),
    ("max_steps", dict(max_steps=0)),
    ("momentum", dict(momentum=1.0)),
    ("seed", dict(seed=-1)),
    ("pipeline", dict(pipeline="fast")),
    ("accumulation_steps", dict(accumulation_steps=0)),
    ("comm_hook", dict(comm_hook="bf16")),
    ("capture_grad_steps", dict(capture_grad_steps=[0])),
    ("threads_per_rank", dict(threads_per_rank=0)),
    ("bind_cores", dict(bind_cores="yes")),
    ("master_port", dict(master_port=70000)),
    ("master_port", dict(master_port=-1)),
    ("master_port", dict(master_port=TAKEN_PORT)),
    ("master_addr", dict(master_addr="no-such-host.invalid")),
    ("master_addr", dict(master_addr="")),
    ("timeout_s", dict(timeout_s=0)),
    ("checkpoint_every", dict(checkpoint_every=5)),
    ("checkpoint_dir", dict(checkpoint_dir=os.path.join(__file__, "ckpt"))),  # under a file
    ("resume_from", dict(resume_from="/nonexistent/ckpt-0000010.pt")),
    ("fault_rank", dict(fault_rank=2)),
    ("fault_kind", dict(fault_kind="explode")),
    ("num_workers", dict(num_workers=-1)),
]
if not torch.cuda.is_available():
    BAD.append(("backend", dict(backend="nccl")))


# Test ids name the value, except the OS-chosen taken port: every pytest-xdist worker must collect the same ids.
@pytest.mark.parametrize("setting,kwargs", BAD, ids=[f"{s}=taken" if k.get("master_port") == TAKEN_PORT
                                                     else f"{s}={list(k.values())[0]!r}" for s, k in BAD])
def test_bad_setting_is_refused_before_any_process_starts(setting, kwargs, monkeypatch):
    started = []
    monkeypatch.setattr(L, "_start_ranks", lambda *a, **k: started.append(1))
    before = len(psutil.Process().children(recursive=True))
    with pytest.raises(ConfigError) as e:
        run_training(SMALL.replace(**kwargs), progress=False)
    msg = str(e.value)
    assert setting in msg, f"message does not name the setting: {msg}"
    value = list(kwargs.values())[0]
    assert repr(value) in msg or str(value) in msg, f"message does not show the value: {msg}"
    assert "accepted" in msg or "use" in msg or "needs" in msg, f"message does not say what to do: {msg}"
    assert not started and len(psutil.Process().children(recursive=True)) == before


def test_at_least_fifteen_bad_inputs_are_covered():
    assert len(BAD) >= 15


def test_unwritable_data_root_when_a_download_is_needed(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user that can write anywhere (root): permissions can't be tested")
        with pytest.raises(ConfigError, match="data_root"):
            run_training(SMALL.replace(dataset="fashion-mnist", data_root=str(ro / "x")), progress=False)
    finally:
        ro.chmod(0o700)


def test_unreadable_data_root_is_refused(tmp_path):
    root = tmp_path / "file-not-dir"
    root.write_text("x")
    from ddp_helpers.data import sources as D

    D.clear_cache()
    with pytest.raises(ConfigError, match="data_root"):
        run_training(SMALL.replace(dataset="fashion-mnist", data_root=str(root)), progress=False)


def test_not_a_config_is_refused():
    with pytest.raises(ConfigError, match="TrainConfig"):
        run_training({"world_size": 2}, progress=False)  # type: ignore[arg-type]


def test_too_many_nccl_ranks_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="one GPU per rank"):
        run_training(SMALL.replace(backend="nccl", world_size=2), progress=False)


def test_auto_backend_picks_gloo_without_enough_gpus(monkeypatch):
    from ddp_helpers.ranks.placement import resolve_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_backend("auto", 2) == "gloo"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_backend("auto", 2) == "nccl"


def test_fork_refused_when_cuda_is_initialized(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(LaunchError, match="CUDA is already initialized"):
        launch(_hello, 2, start_method="fork")


@pytest.mark.slow
def test_spawn_from_a_program_on_stdin_is_refused_before_anything_starts(tmp_path):
    """`python - <<EOF`: spawn can't re-import a main program that has no file; say so instead of a dead rank."""
    code = textwrap.dedent("""
        import ddp_helpers.engine.runner as R
        from ddp_helpers import TrainConfig, run_training
        real_load = R.load_data
        R.load_data = lambda *a, **k: print("data loaded") or real_load(*a, **k)
        try:
            run_training(TrainConfig(dataset="mnist-5k", max_steps=2), progress=False)
        except Exception as e:
            print(type(e).__name__, e)
    """)
    p = subprocess.run([sys.executable, "-"], input=code, cwd=tmp_path, env=ENV, capture_output=True, text=True,
                       timeout=120)
    assert p.stdout.startswith("LaunchError"), p.stdout + p.stderr
    assert "read from <stdin>" in p.stdout and "Save the code to a file" in p.stdout
    assert "data loaded" not in p.stdout  # refused before the data set is loaded, not after a failed launch


@pytest.mark.slow
def test_a_script_without_main_guard_gets_the_idiom_in_the_error(tmp_path):
    """Under spawn each rank re-imports the script; unguarded, it tries to launch again and dies before training."""
    script = tmp_path / "unguarded.py"
    script.write_text("from ddp_helpers import run_training, TrainConfig\n"
                      "run_training(TrainConfig(dataset='mnist-5k', max_steps=2, threads_per_rank=1), progress=False)\n")
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert "RankFailedError" in last and "before it reached the training function" in last, p.stderr[-3000:]
    assert 'if __name__ == "__main__":' in last


def test_unknown_start_method_refused():
    with pytest.raises(ConfigError, match="start_method"):
        launch(_hello, 2, start_method="threads")


def _hello(rank, world_size):
    return rank


# ------------------------------------------------------------------------------------------ 2./3. failures
@pytest.mark.parametrize("start_method", [pytest.param("spawn", marks=pytest.mark.slow), "fork"])
def test_rank_that_raises_ends_the_job_with_its_error(start_method):
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as e:
        run_training(SMALL.replace(fault_rank=1, fault_step=5, master_port=port), progress=False,
                     start_method=start_method)
    elapsed = time.monotonic() - t0
    err = e.value
    assert err.rank == 1 and isinstance(err.original, InjectedFault) and err.__cause__ is err.original
    assert "inject_fault" in err.traceback_text and "rank 1 failed" in str(err)
    partial = err.partial_result
    # Ended within 10 s of the ranks' start: their start-up (spawn: each imports torch, 3-9 s with the machine's
    # load) is not part of the promise.
    assert elapsed - partial.startup_s < 10, f"took {elapsed:.1f} s, {partial.startup_s:.1f} s of them starting"
    assert not partial.complete and [len(r) for r in partial.ranks] == [5, 5]
    assert np.isfinite(partial.ranks[0].loss).all() and partial.fingerprints_agree()
    assert _port_is_free(port), "the rendezvous port must be free again"


def test_rank_killed_by_sigkill_is_detected():
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as e:
        run_training(SMALL.replace(fault_rank=0, fault_step=3, fault_kind="kill"), progress=False,
                     start_method="fork")
    assert time.monotonic() - t0 < 10
    assert e.value.rank == 0 and "SIGKILL" in str(e.value)
    assert e.value.partial_result.n_steps == 3


@pytest.mark.slow
def test_rank_killed_from_outside_is_detected():
    """A real external SIGKILL (as the OOM killer would send), while the ranks train."""
    me = psutil.Process()
    victim = {}

    def killer():
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            kids = [p for p in me.children() if running(p) and not any(s in _cmd(p)
                                                                        for s in ("resource_tracker", "forkserver"))]
            if len(kids) == 2:
                time.sleep(0.5)
                victim["pid"] = kids[1].pid
                os.kill(kids[1].pid, signal.SIGKILL)
                return
            time.sleep(0.05)

    th = threading.Thread(target=killer, daemon=True)
    th.start()
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as e:
        run_training(SMALL.replace(max_steps=None, epochs=1000), progress=False, start_method="fork")
    th.join()
    assert "pid" in victim and "SIGKILL" in str(e.value)
    assert time.monotonic() - t0 < 15


@pytest.mark.slow
def test_stuck_rank_is_named_after_the_collective_timeout():
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as e:
        run_training(SMALL.replace(fault_rank=1, fault_step=2, fault_kind="hang", timeout_s=2), progress=False,
                     start_method="fork")
    elapsed = time.monotonic() - t0
    assert e.value.rank == 1 and "stopped responding" in str(e.value)
    assert 2 <= elapsed < 10
    assert e.value.partial_result.n_steps == 2


@pytest.mark.slow
def test_next_run_works_right_after_a_failure():
    with pytest.raises(RankFailedError):
        run_training(SMALL.replace(fault_rank=0, fault_step=1), progress=False, start_method="fork")
    ok = run_training(SMALL.replace(max_steps=3), progress=False, start_method="fork")
    assert ok.complete and ok.n_steps == 3


# ------------------------------------------------------------------------------------------ 4. interrupts
@pytest.mark.slow
def test_keyboard_interrupt_in_the_notebook_ends_every_child():
    polls = []

    def interrupt_after_training_started():
        polls.append(1)
        if len(polls) == 40:  # ~2 s in: the ranks are training
            raise KeyboardInterrupt

    kids_during = []

    def hello_forever(rank, world_size):
        while True:
            torch.distributed.barrier()

    def poll():
        kids_during.append(len(psutil.Process().children()))
        interrupt_after_training_started()

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        launch(hello_forever, 2, start_method="fork", on_poll=poll)
    assert time.monotonic() - t0 < 2 + 5
    assert max(kids_during) >= 2
    ok = run_training(SMALL.replace(max_steps=2), progress=False, start_method="fork")
    assert ok.n_steps == 2


def test_an_interrupt_while_the_ranks_start_ends_those_already_running(monkeypatch):
    # Ctrl-C (or any error) after a rank started but before the launcher watches them: those started must end
    # too, or they wait in the rendezvous and the program's exit hangs joining them.
    import torch.multiprocessing.spawn  # noqa: F401 - the module; its name is shadowed by the function spawn

    started = []

    def interrupted(procs, *a, **k):
        started.extend(procs)
        raise KeyboardInterrupt

    monkeypatch.setattr(sys.modules["torch.multiprocessing.spawn"], "ProcessContext", interrupted)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        launch(_hello, 2, start_method="fork")
    assert len(started) == 2 and all(p.exitcode is not None for p in started)
    assert time.monotonic() - t0 < L.GRACE_S + 5


SCRIPT = textwrap.dedent("""
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


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.NoSuchProcess:  # a short-lived helper (torch's imports run a few) that ended just now
        return ""


def _hung(proc: subprocess.Popen, left: list) -> str:
    """What still runs after the SIGINT (the parent's stack included), all of it killed: the failure message."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGUSR1)  # faulthandler writes every thread's stack to stderr
        time.sleep(1)
    names = describe_and_kill(left)
    _, err = proc.communicate()
    return f"still running 5 s after SIGINT: {names}; the parent's stderr: {err[-4000:]}"


@pytest.mark.slow
def test_sigint_to_the_parent_ends_every_child_within_5_s(tmp_path):
    script, trained = tmp_path / "long_run.py", tmp_path / "trained"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), str(trained)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_signals)
    deadline = time.monotonic() + 120
    while not trained.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)  # until both ranks have trained 5 steps: the signal lands in training, not in start-up
    assert trained.exists(), proc.communicate(timeout=10)[1][-2000:] if proc.poll() is not None else "no step in 120 s"
    family = [p for p in psutil.Process(proc.pid).children(recursive=True) if "resource_tracker" not in _cmd(p)]
    assert len(family) >= 3, [_cmd(p) for p in family]  # the forkserver and its two ranks
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    # outliving, not psutil.wait_procs: the forkserver outlives the parent by a moment, and its zombie (reaped by
    # PID 1 when it gets to it) has exited all the same.
    left = outliving(family + [psutil.Process(proc.pid)], timeout=5)
    assert not left, _hung(proc, left)
    out, err = proc.communicate(timeout=10)
    assert proc.returncode == 130 and "interrupted" in out, err[-2000:]
    assert time.monotonic() - t0 < 8


# ------------------------------------------------------------------------------------------ 5. concurrency
@pytest.mark.slow
def test_two_runs_at_the_same_time_from_two_processes(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-m", "ddp_helpers.train", "--dataset", "mnist-5k", "--max-steps", "20",
                               "--threads-per-rank", "1", "--no-plots", "--out", str(tmp_path / f"run{i}")],
                              env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = [p.communicate(timeout=180) for p in procs]
    for p, (_, err) in zip(procs, results):
        assert p.returncode == 0, err[-2000:]
    from ddp_helpers import TrainResult

    a, b = (TrainResult.load(str(tmp_path / f"run{i}" / "result.json")) for i in range(2))
    assert a.ranks[0].param_fingerprint == b.ranks[0].param_fingerprint


def _master_port(rank, world_size):
    return os.environ["MASTER_PORT"]


def test_two_launches_in_one_process_get_different_ports():
    # The default start method: forking from a process with a second launch running in another thread could
    # copy that thread's locks into the children (what Python warns about for fork in threaded programs).
    seen = []
    th = threading.Thread(target=lambda: seen.append(launch(_master_port, 2)))
    th.start()
    seen.append(launch(_master_port, 2))
    th.join()
    assert len(seen) == 2 and all(len(set(ports)) == 1 for ports in seen) and seen[0][0] != seen[1][0]


# ------------------------------------------------------------------------------------------ 7. checkpoints
def test_checkpoint_written_by_rank_0_only_and_atomically(tmp_path, monkeypatch):
    from ddp_helpers.engine import checkpoint

    marks = tmp_path / "marks"
    marks.mkdir()
    real = checkpoint.save_checkpoint

    def spy(directory, step, *a, **k):  # runs inside the forked ranks
        (marks / f"rank{torch.distributed.get_rank()}-step{step}").touch()
        return real(directory, step, *a, **k)

    monkeypatch.setattr(checkpoint, "save_checkpoint", spy)
    ck = tmp_path / "ck"
    run_training(SMALL.replace(max_steps=6, checkpoint_dir=str(ck), checkpoint_every=2), progress=False,
                 start_method="fork")
    assert sorted(os.listdir(marks)) == ["rank0-step2", "rank0-step4", "rank0-step6"]
    assert sorted(os.listdir(ck)) == ["ckpt-0000002.pt", "ckpt-0000004.pt", "ckpt-0000006.pt"]
    state = torch.load(ck / "ckpt-0000006.pt", weights_only=True)
    assert state["step"] == 6 and set(state) >= {"model", "optimizer", "config"}


def test_checkpoint_crash_mid_write_leaves_no_file(tmp_path, monkeypatch):
    from ddp_helpers.engine import checkpoint as C

    def broken_save(obj, f):
        f.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(C.torch, "save", broken_save)
    with pytest.raises(OSError):
        C.save_checkpoint(str(tmp_path), 3, {"w": torch.ones(2)}, {}, {})
    assert not (tmp_path / "ckpt-0000003.pt").exists()
    assert C.latest_checkpoint(str(tmp_path)) is None


@pytest.mark.slow
def test_resume_is_exact(tmp_path):
    cfg = SMALL.replace(max_steps=None, epochs=2, momentum=0.9)  # momentum: real optimizer state to restore
    full_dir, part_dir = tmp_path / "full", tmp_path / "part"
    full = run_training(cfg.replace(checkpoint_dir=str(full_dir)), progress=False, start_method="fork")
    k = 40  # mid-way through the second epoch (32 steps per epoch)
    run_training(cfg.replace(max_steps=k, checkpoint_dir=str(part_dir)), progress=False, start_method="fork")
    resumed = run_training(cfg.replace(resume_from=str(part_dir / f"ckpt-{k:07d}.pt"), checkpoint_dir=str(part_dir)),
                           progress=False, start_method="fork")
    assert resumed.ranks[0].step[0] == k and resumed.ranks[0].step[-1] == full.ranks[0].step[-1]
    assert resumed.ranks[0].param_fingerprint == full.ranks[0].param_fingerprint[k:]
    a = torch.load(full_dir / "ckpt-0000064.pt", weights_only=True)
    b = torch.load(part_dir / "ckpt-0000064.pt", weights_only=True)
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    for i, st in a["optimizer"]["state"].items():
        assert torch.equal(st["momentum_buffer"], b["optimizer"]["state"][i]["momentum_buffer"])


def test_resume_with_a_different_batch_size_is_refused(tmp_path):
    run_training(SMALL.replace(max_steps=2, checkpoint_dir=str(tmp_path)), progress=False, start_method="fork")
    with pytest.raises(ConfigError, match="batch_size"):
        run_training(SMALL.replace(batch_size=32, resume_from=str(tmp_path / "ckpt-0000002.pt")), progress=False)


# ------------------------------------------------------------------------------------------ 8. unequal shards
@pytest.mark.slow
def test_uneven_data_never_hangs_three_ranks():
    """4,000 samples over 3 ranks: DistributedSampler pads to 1,334 each, so all ranks take 21 steps."""
    res = run_training(TrainConfig(dataset="mnist-5k", world_size=3, threads_per_rank=1), progress=False,
                       start_method="fork")
    assert [len(r) for r in res.ranks] == [21, 21, 21]
    assert res.fingerprints_agree()
    last = res.ranks[0].sample_indices[-1]
    assert (last >= 0).sum() == 1334 - 20 * 64  # the short last batch is the same size on every rank


def test_launch_names_its_own_argument_for_a_taken_port():
    with pytest.raises(ConfigError, match=rf"launch\(port={TAKEN_PORT}\) is not accepted: a free port") as e:
        launch(_hello, 2, start_method="fork", port=TAKEN_PORT)
    assert "Use launch(port=0) to let the OS choose one" in str(e.value)  # the fix, spelled as the caller writes it


def test_taken_master_port_names_the_field_and_the_fix():
    with pytest.raises(ConfigError, match=rf"TrainConfig.master_port={TAKEN_PORT} is not accepted") as e:
        run_training(SMALL.replace(master_port=TAKEN_PORT), progress=False)
    assert "Use master_port=0 to let the OS choose one" in str(e.value)


def test_launch_names_its_host_argument():
    with pytest.raises(ConfigError, match=r"launch\(host='no-such-host.invalid'\) is not accepted: a resolvable host"):
        launch(_hello, 2, start_method="fork", host="no-such-host.invalid")


def test_resume_with_a_different_learning_rate_is_refused(tmp_path):
    run_training(SMALL.replace(max_steps=2, checkpoint_dir=str(tmp_path)), progress=False, start_method="fork")
    with pytest.raises(ConfigError, match="lr"):
        run_training(SMALL.replace(lr=0.1, resume_from=str(tmp_path / "ckpt-0000002.pt")), progress=False)


def test_unwritable_data_root_refused_even_when_running_as_root(tmp_path, monkeypatch):
    """Root may write anywhere, so deny write access the way a normal user would meet it."""
    from ddp_helpers.engine import config as C
    from ddp_helpers.data import sources as D

    ro = tmp_path / "read-only"
    ro.mkdir()
    real_access = os.access
    monkeypatch.setattr(C.os, "access", lambda p, mode: False if str(p).startswith(str(ro)) else real_access(p, mode))
    D.clear_cache()
    with pytest.raises(ConfigError, match=r"TrainConfig\.data_root=.*not accepted: a directory this user can write"):
        run_training(SMALL.replace(dataset="fashion-mnist", data_root=str(ro)), progress=False)
    D.clear_cache()



def test_seed_pipeline_stops_its_loader_workers_before_the_rank_ends(tmp_path, monkeypatch):
    # A rank ends with os._exit, which skips the finalizers of live DataLoader workers' queues: their
    # semaphores then "leak" (Python warns at shutdown). The loop must release its loader first.
    import ddp_helpers.engine.worker as W

    original = W.evaluate

    def evaluate_and_count_workers(model, data, rank, *args, **kwargs):
        # evaluate runs right after the training loop: the loader's workers must be gone by now
        (tmp_path / f"rank{rank}").write_text(str(len(psutil.Process().children())))
        return original(model, data, rank, *args, **kwargs)

    monkeypatch.setattr(W, "evaluate", evaluate_and_count_workers)  # forked ranks inherit the patch
    run_training(SMALL.replace(pipeline="seed", max_steps=3, num_workers=2), progress=False, start_method="fork")
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["0", "0"]
