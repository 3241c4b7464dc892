"""Checkpoints: written by rank 0 only, atomically (a crash or a full disk mid-write leaves no file), and loadable
with torch.load(weights_only=True)."""
from __future__ import annotations

import os
import subprocess

import pytest
import torch

from ddp_helpers import RankFailedError, TrainConfig, run_training

SMALL = TrainConfig(dataset="mnist-5k", max_steps=12, threads_per_rank=1)


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
    state = torch.load(ck / "ckpt-0000006.pt", weights_only=True)  # tensors and plain types only
    assert state["step"] == 6 and set(state) >= {"model", "optimizer", "config"}
    assert state["model"]["1.weight"].shape == (10, 784)


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


def _mount_tmpfs(path, options: str) -> None:
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"can't mount a tmpfs here ({done.stderr.decode().strip()}); needs root")


def _fills_the_disk_at(step_to_fill: int):
    """save_checkpoint as the ranks call it, but at step_to_fill another program has just filled the disk."""
    from ddp_helpers.engine import checkpoint

    real = checkpoint.save_checkpoint

    def save(directory, step, *args, **kwargs):
        if step == step_to_fill:
            with open(os.path.join(directory, "..", "filler"), "wb") as fh:  # the tmpfs's other file
                try:
                    while True:
                        fh.write(b"\0" * 65536)
                except OSError:
                    pass  # full
        return real(directory, step, *args, **kwargs)
    return save


def test_a_full_disk_while_checkpointing_is_named_and_leaves_no_partial_file(tmp_path, monkeypatch):
    from ddp_helpers.engine import checkpoint

    disk = tmp_path / "small"
    _mount_tmpfs(disk, "size=1m")  # room for the run's 6 checkpoints (checked before training) ...
    (disk / "ckpt").mkdir()
    monkeypatch.setattr(checkpoint, "save_checkpoint", _fills_the_disk_at(4))  # ... until another program fills it
    try:
        with pytest.raises(RankFailedError) as e:
            run_training(SMALL.replace(momentum=0.9, checkpoint_dir=str(disk / "ckpt"), checkpoint_every=2),
                         progress=False, start_method="fork")
        err = e.value
        assert err.rank == 0 and "no space left on the device" in str(err) and str(disk) in str(err)
        assert isinstance(err.original, OSError)
        assert os.listdir(disk / "ckpt") == ["ckpt-0000002.pt"]  # no ckpt-*.pt.tmp<pid> left behind
        assert err.partial_result is not None and err.partial_result.n_steps == 4  # the steps made before it
        assert err.partial_result.fingerprints_agree() and err.partial_result.final_params is not None
    finally:
        subprocess.run(["umount", str(disk)])
