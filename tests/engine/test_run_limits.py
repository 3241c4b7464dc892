"""What a run may take, checked before it starts (telemetry, checkpoint room), and what a run keeps when it ends
early: an interrupt, a full disk, a checkpoint that can't be written at the end."""
from __future__ import annotations

import errno
import json
import os
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
import torch

from ddp_helpers import ConfigError, RankFailedError, TrainConfig, TrainResult, build_model, run_training
from ddp_helpers.engine import checkpoint as C
from ddp_helpers.ranks import launcher as L
from ddp_helpers.ranks.launcher import LaunchInterrupted

SMALL = TrainConfig(dataset="mnist-5k", max_steps=8, threads_per_rank=1)


def test_telemetry_too_large_for_the_kernel_is_refused_before_anything_is_allocated(monkeypatch):
    started = []
    monkeypatch.setattr(L, "start_ranks", lambda *a, **k: started.append(1))
    rss = psutil.Process().memory_info().rss
    with pytest.raises(ConfigError, match=r"batch_size=65536 .* telemetry .* over the") as e:
        run_training(SMALL.replace(max_steps=None, batch_size=65536, accumulation_steps=1024, epochs=8),
                     progress=False)
    assert "telemetry=False" in str(e.value) and not started
    assert psutil.Process().memory_info().rss - rss < 200 * 2**20  # before: ~4.3 GB allocated in this process


def test_the_command_line_names_the_telemetry_not_the_room_in_out(tmp_path, capfd):
    from ddp_helpers.cli.train import main

    code = main(["--batch-size", "65536", "--accumulation-steps", "1024", "--epochs", "1000", "--dataset",
                 "mnist-5k", "--out", str(tmp_path / "out")])
    err = capfd.readouterr().err
    assert code == 2 and "telemetry" in err and "bytes free" not in err, err
    assert not (tmp_path / "out").exists()  # a refused run leaves no --out behind


def test_an_out_refused_for_room_is_not_left_behind(tmp_path, capfd, monkeypatch):
    from ddp_helpers.cli import outputs
    from ddp_helpers.cli.train import main

    monkeypatch.setattr(outputs, "shutil", SimpleNamespace(disk_usage=lambda p: SimpleNamespace(free=1000)))
    assert main(["--dataset", "mnist-5k", "--out", str(tmp_path / "new" / "out")]) == 2
    assert "bytes free" in capfd.readouterr().err and not (tmp_path / "new" / "out").exists()


def test_a_checkpoint_folder_without_room_is_refused_before_training(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(L, "start_ranks", lambda *a, **k: started.append(1))
    monkeypatch.setattr(C, "shutil", SimpleNamespace(disk_usage=lambda p: SimpleNamespace(free=150_000)))
    with pytest.raises(ConfigError, match=r"checkpoint_dir=.* 150,000 bytes free .* 4 checkpoint"):
        run_training(SMALL.replace(momentum=0.9, checkpoint_dir=str(tmp_path), checkpoint_every=2), progress=False)
    assert not started


def _full_at(step_to_fail: int):
    real = C.save_checkpoint

    def save(directory, step, *args, **kwargs):  # runs inside the forked ranks (rank 0 writes)
        if step == step_to_fail:
            raise OSError(errno.ENOSPC, f"no space left on the device to write {directory}")
        return real(directory, step, *args, **kwargs)
    return save


def test_a_finished_run_whose_last_checkpoint_fails_keeps_its_result(tmp_path, monkeypatch):
    monkeypatch.setattr(C, "save_checkpoint", _full_at(8))
    with pytest.raises(C.CheckpointError, match="final checkpoint .step 8. could not be written") as e:
        run_training(SMALL.replace(checkpoint_dir=str(tmp_path)), progress=False, start_method="fork")
    result = e.value.result
    assert result.complete and result.n_steps == 8 and np.isfinite(result.test_accuracy)
    assert result.final_params is not None


def test_the_command_line_writes_the_result_when_only_the_last_checkpoint_fails(tmp_path, monkeypatch, capfd):
    from ddp_helpers.cli.train import main

    monkeypatch.setattr(C, "save_checkpoint", _full_at(8))
    code = main(["--dataset", "mnist-5k", "--max-steps", "8", "--threads-per-rank", "1", "--start-method", "fork",
                 "--checkpoint-dir", str(tmp_path / "ck"), "--no-plots", "--out", str(tmp_path / "out")])
    err = capfd.readouterr().err
    assert code == 1 and "final checkpoint (step 8)" in err and "result.json holds its result" in err, err
    assert TrainResult.load(str(tmp_path / "out" / "result.json")).n_steps == 8


def test_a_run_that_fails_midway_keeps_rank_0s_latest_parameters(tmp_path, monkeypatch):
    monkeypatch.setattr(C, "save_checkpoint", _full_at(4))
    with pytest.raises(RankFailedError) as e:
        run_training(SMALL.replace(checkpoint_dir=str(tmp_path), checkpoint_every=2), progress=False,
                     start_method="fork")
    partial = e.value.partial_result
    assert partial.n_steps == 4 and partial.final_params is not None
    model = partial.model()  # loads: the parameters after step 4, rank 0's last recorded
    full = run_training(SMALL.replace(max_steps=4), progress=False, start_method="fork")
    assert np.array_equal(partial.final_params, full.final_params) and isinstance(model, torch.nn.Module)


def test_checkpoints_are_rotated_to_the_newest_n(tmp_path):
    run_training(SMALL.replace(checkpoint_dir=str(tmp_path), checkpoint_every=2, checkpoint_keep=2),
                 progress=False, start_method="fork")
    assert sorted(os.listdir(tmp_path)) == ["ckpt-0000006.pt", "ckpt-0000008.pt"]


def test_a_checkpoint_whose_optimizer_holds_another_lr_is_refused(tmp_path):
    model = build_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=5.0)  # what load_state_dict would put back
    C.save_checkpoint(str(tmp_path), 2, model.state_dict(), opt.state_dict(), SMALL.to_dict())  # config: 0.01
    with pytest.raises(ConfigError, match=r"param_groups\[0\]\['lr'\]=5\.0, and this run's is 0\.01"):
        run_training(SMALL.replace(resume_from=str(tmp_path / "ckpt-0000002.pt")), progress=False)


@pytest.mark.parametrize("damage", ["truncated", "wrong keys"])
def test_a_damaged_result_file_is_named(tmp_path, small_run, damage):
    path = tmp_path / "result.json"
    small_run.save(str(path))
    text = path.read_text()
    path.write_text(text[: len(text) // 2] if damage == "truncated" else json.dumps({"format": json.loads(text)["format"]}))
    with pytest.raises(ValueError, match=str(path)):
        TrainResult.load(str(path))


def test_an_interrupted_run_keeps_the_steps_it_made():
    def interrupt_after_three(steps, total):
        if min(steps) >= 3:
            raise KeyboardInterrupt  # what the notebook's stop button raises in this thread

    with pytest.raises(LaunchInterrupted) as e:
        run_training(SMALL.replace(max_steps=None, epochs=50), progress=False, start_method="fork",
                     on_progress=interrupt_after_three)
    partial = e.value.partial_result
    assert isinstance(e.value, KeyboardInterrupt) and partial.n_steps >= 3 and not partial.complete
    lines = e.value._render_traceback_()  # what a notebook shows: one line, no package frames
    assert len(lines) == 1 and "all 2 ranks have ended" in lines[0] and ".partial_result" in lines[0]
