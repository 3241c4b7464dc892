"""Reliability, round 2: signals to the parent, stale log folders, torchrun resumes checked, output folders
checked before training, and a full disk while checkpointing."""
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

from ddp_helpers import RankFailedError, TrainConfig, launch, run_training
from ddp_helpers.ranks import cleanup as C

from _procs import default_signals, describe_and_kill, outliving

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = TrainConfig(dataset="mnist-5k", max_steps=12, threads_per_rank=1)

PARENT = textwrap.dedent("""
    import sys
    from ddp_helpers import TrainConfig, run_training

    if __name__ == "__main__":
        print("training", flush=True)
        run_training(TrainConfig(dataset="mnist-5k", epochs=1000, threads_per_rank=1), progress=False)
""")


def _env(tmp_path) -> dict:
    return {**os.environ, "DDP_HELPERS_PROGRESS": "0", "TMPDIR": str(tmp_path)}  # its log folder lands here


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
@pytest.mark.slow
def test_a_signal_to_the_parent_stops_the_ranks_and_removes_the_log_folder(tmp_path, sig):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, env=_env(tmp_path), preexec_fn=default_signals)
    assert parent.stdout.readline().strip() == "training"
    deadline = time.monotonic() + 60
    while not glob.glob(str(tmp_path / (C.RUN_DIR_PREFIX + "*"))) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(4.0)  # the ranks are in the training loop by now
    family = psutil.Process(parent.pid).children(recursive=True)
    parent.send_signal(sig)
    _, stderr = parent.communicate(timeout=15)
    alive = outliving(family, timeout=5.0)
    names = describe_and_kill(alive)
    assert parent.returncode == -sig, stderr[-2000:]  # it ended as the signal would have ended it
    assert not alive, f"{len(alive)} process(es) outlived the parent: {names}"
    assert glob.glob(str(tmp_path / (C.RUN_DIR_PREFIX + "*"))) == [], "the run's log folder was left behind"
    assert "leaked semaphore" not in stderr


def _hello(rank: int, world_size: int) -> int:
    return rank


def test_log_folders_of_dead_owners_are_removed_at_the_next_launch(tmp_path, monkeypatch):
    monkeypatch.setattr(C.tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    started = psutil.Process(dead.pid).create_time()
    dead.wait()
    folders = {name: tmp_path / (C.RUN_DIR_PREFIX + name) for name in ("dead", "mine", "reused", "foreign")}
    for folder in folders.values():
        folder.mkdir()
    (folders["dead"] / "owner").write_text(f"{dead.pid} {started}")
    (folders["mine"] / "owner").write_text(f"{os.getpid()} {psutil.Process().create_time()}")
    (folders["reused"] / "owner").write_text(f"{os.getpid()} {psutil.Process().create_time() - 100}")
    assert launch(_hello, 2) == [0, 1]
    assert sorted(p.name for p in tmp_path.glob(C.RUN_DIR_PREFIX + "*")) == sorted(
        C.RUN_DIR_PREFIX + n for n in ("mine", "foreign"))  # a folder without an owner file is not ours


# ------------------------------------------------------------------------------------------ torchrun resumes
def _torchrun(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "ddp_helpers.train", "--dataset", "mnist-5k", "--threads-per-rank", "1", "--no-plots", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env(tmp_path), timeout=240)


@pytest.mark.slow
def test_a_torchrun_resume_with_other_settings_is_refused(tmp_path):
    ck = tmp_path / "ck"
    run_training(SMALL.replace(max_steps=4, checkpoint_dir=str(ck), momentum=0.9), progress=False)
    ckpt = str(ck / "ckpt-0000004.pt")
    refused = _torchrun(tmp_path, "--momentum", "0.9", "--lr", "0.5", "--resume-from", ckpt, "--out",
                        str(tmp_path / "out"))
    assert refused.returncode != 0
    assert "error: --lr 0.5 differs from the checkpoint's 0.01" in refused.stderr  # named by its flag
    assert not (tmp_path / "out" / "result.json").exists()
    # The checkpoint itself resumes with its own settings: the refusal was the learning rate's. (A torchrun job
    # resuming is test_resume_latest's restart; a second torchrun job here would only import torch three more times.)
    ok = run_training(SMALL.replace(max_steps=6, momentum=0.9, resume_from=ckpt), progress=False)
    assert ok.ranks[0].step[0] == 4 and ok.n_steps == 2


# ------------------------------------------------------------------------------------------ output folders
def _cli(tmp_path, out: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ddp_helpers.train", "--dataset", "mnist-5k", "--out", out, "--no-plots"]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env(tmp_path), timeout=120)


def _mount_tmpfs(path, options: str) -> None:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"can't mount a tmpfs here ({done.stderr.decode().strip()}); needs root")


@pytest.mark.slow
def test_an_output_folder_that_cant_be_written_is_refused_before_training(tmp_path):
    (tmp_path / "file").write_text("x")
    ro = tmp_path / "ro"
    _mount_tmpfs(ro, "ro,size=1m")
    try:
        for out, why in ((str(tmp_path / "file"), "is an existing file"), ("/proc/ddp-out", "can't be written"),
                         (str(ro / "out"), "Read-only file system")):
            t0 = time.monotonic()
            done = _cli(tmp_path, out)
            assert done.returncode == 2 and why in done.stderr and "Traceback" not in done.stderr, done.stderr
            assert done.stderr.count("\n") == 1 and "--out" in done.stderr
            assert time.monotonic() - t0 < 30  # refused at once, not after a training run
    finally:
        subprocess.run(["umount", str(ro)])


# ------------------------------------------------------------------------------------------ a full disk
def test_a_full_disk_while_checkpointing_is_named_and_leaves_no_partial_file(tmp_path):
    disk = tmp_path / "small"
    _mount_tmpfs(disk, "size=48k")  # a checkpoint with momentum needs ~64 KB
    try:
        with pytest.raises(RankFailedError) as e:
            run_training(SMALL.replace(momentum=0.9, checkpoint_dir=str(disk), checkpoint_every=2), progress=False)
        err = e.value
        assert err.rank == 0 and "no space left on the device" in str(err) and str(disk) in str(err)
        assert isinstance(err.original, OSError)
        assert os.listdir(disk) == []  # no ckpt-*.pt.tmp<pid> left behind
        assert err.partial_result is not None and err.partial_result.n_steps == 2  # the steps made before it
        assert err.partial_result.fingerprints_agree()
    finally:
        subprocess.run(["umount", str(disk)])


def test_checkpoints_still_load_after_the_in_memory_write(tmp_path):
    run_training(SMALL.replace(max_steps=2, checkpoint_dir=str(tmp_path)), progress=False)
    state = torch.load(tmp_path / "ckpt-0000002.pt", weights_only=True)
    assert state["step"] == 2 and state["model"]["1.weight"].shape == (10, 784)


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
