"""resume_from: unreadable, foreign or finished checkpoints are refused with one clear ConfigError before any rank."""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from torch import nn

from ddp_helpers import ConfigError, TrainConfig, run_training
from ddp_helpers.ranks import launcher as L
from ddp_helpers.engine.checkpoint import FORMAT, check_resume, save_checkpoint
from ddp_helpers.engine.model import build_model
from ddp_helpers.engine.rng import rng_state

ENV = {**os.environ, "DDP_HELPERS_PROGRESS": "0"}
SMALL = TrainConfig(dataset="mnist-5k", max_steps=12, threads_per_rank=1)


def _good_payload(cfg: TrainConfig, step: int = 4) -> dict:
    """What save_checkpoint writes for cfg's model after `step` steps (no training needed)."""
    model = build_model(cfg.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    return {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(), "config": cfg.to_dict()}


def _write(path, kind: str) -> str:
    """Write one kind of bad checkpoint at path; returns the path."""
    path = str(path)
    good = _good_payload(SMALL)
    if kind == "truncated":
        torch.save(good, path)
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
    elif kind == "empty":
        open(path, "wb").close()
    elif kind == "tensor":
        torch.save(torch.ones(3), path)
    elif kind == "no-step":
        torch.save({k: v for k, v in good.items() if k != "step"}, path)
    elif kind == "bare-state-dict":
        torch.save(good["model"], path)
    elif kind == "text":  # torch.load fails with UnpicklingError, whose text suggests weights_only=False
        open(path, "w").write("# notes\nstep: 5\n")
    elif kind == "text-2":  # torch.load fails with IndexError
        open(path, "w").write("step: 5\nmodel: the weights\n")
    elif kind == "objects":
        torch.save({**good, "extra": argparse.Namespace(x=1)}, path)
    elif kind == "no-model":
        torch.save({k: v for k, v in good.items() if k != "model"}, path)
    elif kind == "other-shape":
        other = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 5))
        torch.save({**good, "model": other.state_dict()}, path)
    elif kind == "bad-optimizer":
        torch.save({**good, "optimizer": {"state": {}, "param_groups": []}}, path)
    elif kind == "rng-ranks":  # generator states of a 1-rank run for SMALL's 2 ranks
        torch.save({**good, "rng": [rng_state()]}, path)
    elif kind == "rng-entry":
        torch.save({**good, "rng": [rng_state(), {"torch": torch.zeros(3)}]}, path)
    elif kind == "nan-weights":  # a diverged run's checkpoint
        weights = {k: v.clone() for k, v in good["model"].items()}
        weights["1.weight"][0, 0] = float("nan")
        torch.save({**good, "model": weights, "format": FORMAT, "rng": [rng_state(), rng_state()]}, path)
    elif kind == "no-config":
        torch.save({k: v for k, v in good.items() if k != "config"}, path)
    elif kind == "format-1":  # what the previous version wrote: no generator states
        torch.save({**good, "format": "ddp_helpers.checkpoint/1"}, path)
    return path


# What each message must say besides naming resume_from.
CASES = {
    "truncated": "truncated or corrupted",
    "empty": "empty (0 bytes)",
    "tensor": "holds a Tensor, not a checkpoint",
    "no-step": "has no 'step'",
    "bare-state-dict": "bare state_dict",
    "text": "not a checkpoint written by torch.save",
    "text-2": "not a checkpoint written by torch.save",
    "objects": "holds Python objects other than tensors",
    "no-model": "has no 'model'",
    "other-shape": "has shape (5, 784), this model's has (10, 784)",
    "bad-optimizer": "can't be loaded into this model's SGD optimizer",
    "rng-ranks": "its 'rng' holds the generator states of 1 ranks, this run has world_size=2",
    "rng-entry": "its 'rng' entry for rank 1 holds ['torch'], not the states",
    "nan-weights": "its model's '1.weight' holds NaN or infinite values",
    "no-config": "its 'config' is missing",
    "format-1": "its format is 'ddp_helpers.checkpoint/1', not 'ddp_helpers.checkpoint/2'",
}


@pytest.fixture
def no_ranks(monkeypatch):
    """Records any attempt to start ranks (there must be none)."""
    started = []
    monkeypatch.setattr(L, "start_ranks", lambda *a, **k: started.append(1))
    return started


@pytest.mark.parametrize("kind", list(CASES))
def test_bad_checkpoint_is_refused_before_any_rank_starts(kind, tmp_path, no_ranks):
    path = _write(tmp_path / f"ckpt-{kind}.pt", kind)
    with pytest.raises(ConfigError) as e:
        run_training(SMALL.replace(resume_from=path), progress=False)
    msg = str(e.value)
    assert msg.startswith(f"TrainConfig.resume_from={path!r} is not accepted: "), msg
    assert CASES[kind] in msg, msg
    assert "resume_from=None" in msg, f"message does not say what to do: {msg}"
    assert "weights_only=False" not in msg, "never suggest loading a checkpoint that can run code"
    assert "\n" not in msg, msg
    assert not no_ranks


@pytest.mark.parametrize("with_rng", [True, False], ids=["rng-states", "without-rng"])
def test_a_good_checkpoint_passes_and_gives_its_step(tmp_path, with_rng):
    path = str(tmp_path / "ckpt-0000004.pt")
    cfg = SMALL.replace(momentum=0.9)
    payload = _good_payload(cfg)
    rng = [rng_state(), rng_state()] if with_rng else None  # a format /2 file without them (save_checkpoint's rng=None)
    save_checkpoint(str(tmp_path), 4, payload["model"], payload["optimizer"], payload["config"], rng=rng)
    assert ("rng" in torch.load(path, weights_only=True)) == with_rng
    assert check_resume(cfg.replace(resume_from=path)) == 4


def test_resume_past_the_end_is_refused(tmp_path, no_ranks):
    payload = _good_payload(SMALL, step=50)
    path = save_checkpoint(str(tmp_path), 50, payload["model"], payload["optimizer"], payload["config"])
    with pytest.raises(ConfigError) as e:
        run_training(SMALL.replace(resume_from=path), progress=False)  # max_steps=12 <= step 50
    msg = str(e.value)
    assert f"TrainConfig.resume_from={path!r}" in msg and "max_steps=12" in msg and "epochs=1" in msg, msg
    assert "step 50" in msg and "set max_steps above 50" in msg, msg
    assert not no_ranks


def test_resume_past_the_last_epoch_is_refused(tmp_path, no_ranks):
    cfg = SMALL.replace(max_steps=None)  # 4,000 digits / 2 ranks / 64: 32 steps per epoch
    payload = _good_payload(cfg, step=32)
    path = save_checkpoint(str(tmp_path), 32, payload["model"], payload["optimizer"], payload["config"])
    with pytest.raises(ConfigError, match=r"epochs=1: the checkpoint is at step 32 and this run ends at step 32"):
        run_training(cfg.replace(resume_from=path), progress=False)
    assert not no_ranks


@pytest.mark.parametrize("setting, value", [("batch_size", 32), ("lr", 0.1)])
def test_resume_with_other_settings_is_refused(setting, value, tmp_path, no_ranks):
    payload = _good_payload(SMALL)
    path = save_checkpoint(str(tmp_path), 4, payload["model"], payload["optimizer"], payload["config"])
    with pytest.raises(ConfigError, match=setting):
        run_training(SMALL.replace(resume_from=path, **{setting: value}), progress=False)
    assert not no_ranks


def test_a_torchrun_rank_names_a_resume_with_other_settings_by_its_flag(tmp_path, monkeypatch, capfd):
    """One rank of a torchrun job (its variables set here; every rank checks for itself, before its process
    group) refuses in the words of the command line. A real torchrun job refusing a resume, each rank saying so
    in one line: test_torchrun_unreadable_checkpoint_is_named_by_every_rank."""
    import ddp_helpers.cli.torchrun
    import ddp_helpers.ranks.rank
    from ddp_helpers.cli.train import main

    cfg = SMALL.replace(momentum=0.9)
    payload = _good_payload(cfg)
    ckpt = save_checkpoint(str(tmp_path), 4, payload["model"], payload["optimizer"], payload["config"])
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT="29500").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(ddp_helpers.cli.torchrun, "record_atomically", lambda fn: fn)  # elastic's @record
    monkeypatch.setattr(ddp_helpers.ranks.rank, "run_rank", lambda *a, **k: pytest.fail("the rank went on"))
    flags = ["--dataset", "mnist-5k", "--threads-per-rank", "1", "--no-plots", "--momentum", "0.9",
             "--resume-from", ckpt, "--out", str(tmp_path / "out")]
    assert main([*flags, "--lr", "0.5"]) == 2
    err = capfd.readouterr().err
    assert err.startswith("error: --lr 0.5 differs from the checkpoint's 0.01") and err.count("\n") == 1, err
    assert not (tmp_path / "out" / "result.json").exists()
    assert check_resume(cfg.replace(resume_from=ckpt)) == 4  # with its own settings it resumes: the lr was refused


@pytest.mark.parametrize("kind", ["text", "other-shape"])
def test_cli_bad_checkpoint_is_one_line_and_exit_2(kind, tmp_path, capfd, recwarn):
    """In this process: capfd reads file descriptor 2 (torch's own writes count), recwarn the Python warnings a real
    process would print. (A real process refusing a checkpoint: the unreadable one below.)"""
    from ddp_helpers.cli.train import main

    path = _write(tmp_path / f"ckpt-{kind}.pt", kind)
    code = main(["--dataset", "mnist-5k", "--max-steps", "12", "--resume-from", path, "--start-method", "fork",
                 "--out", str(tmp_path / "o")])
    err = capfd.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith(f"error: --resume-from {path} is not accepted: ") and CASES[kind] in err
    assert "or leave out --resume-from to start over" in err, err
    assert "weights_only=False" not in err
    quiet = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)  # unprinted by default
    assert not [w for w in recwarn if not issubclass(w.category, quiet)], [str(w.message) for w in recwarn]


# ------------------------------------------------------------------ a checkpoint this user can't read
NO_DAC = ["--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search"]


def _as_user_who_cant_read(cmd: list) -> list:
    """cmd run so that a chmod 000 file is unreadable: as root, without the capabilities that override modes."""
    if os.geteuid() != 0:
        return cmd
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root and setpriv (util-linux) is missing: root reads any file")
    probe = subprocess.run([setpriv, *NO_DAC, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"setpriv can't drop capabilities here: {probe.stderr.strip()}")
    return [setpriv, *NO_DAC, *cmd]


@pytest.fixture
def unreadable_checkpoint(tmp_path):
    payload = _good_payload(SMALL)
    path = save_checkpoint(str(tmp_path), 4, payload["model"], payload["optimizer"], payload["config"])
    os.chmod(path, 0)
    yield path
    os.chmod(path, 0o600)


def _assert_unreadable_named(line: str, path: str) -> None:
    assert line == (f"error: --resume-from {path} is not accepted: this user can't read the file (Permission "
                    f"denied); make it readable for this user (chmod a+r {path}), run as its owner, or leave out "
                    "--resume-from to start over"), line


@pytest.mark.slow
def test_cli_unreadable_checkpoint_is_one_line_and_exit_2(unreadable_checkpoint, tmp_path):
    cmd = [sys.executable, "-m", "ddp_helpers.train", "--dataset", "mnist-5k", "--max-steps", "12",
           "--resume-from", unreadable_checkpoint, "--out", str(tmp_path / "o")]
    p = subprocess.run(_as_user_who_cant_read(cmd), cwd=tmp_path, env=ENV, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    _assert_unreadable_named(p.stderr.rstrip("\n"), unreadable_checkpoint)


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                    reason="torchrun not installed next to this Python")
@pytest.mark.slow
def test_torchrun_unreadable_checkpoint_is_named_by_every_rank(unreadable_checkpoint, tmp_path):
    """Under torchrun each rank checks the path itself, before importing torch: a rank that refuses says so in one
    line and exits 2 (torchrun then 1). The first to exit ends the job (the agent stops the others), so the other
    rank may be stopped before it prints its own line."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "ddp_helpers.train", "--dataset", "mnist-5k",
           "--max-steps", "12", "--threads-per-rank", "1", "--resume-from", unreadable_checkpoint,
           "--out", str(tmp_path / "o")]
    p = subprocess.run(_as_user_who_cant_read(cmd), cwd=tmp_path, env=ENV, capture_output=True, text=True,
                       timeout=240)
    assert p.returncode != 0
    errors = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
    assert 1 <= len(errors) <= 2, p.stderr[-3000:]
    for line in errors:
        _assert_unreadable_named(line, unreadable_checkpoint)
    assert "PermissionError" not in p.stderr and re.search(r"exitcode\s*:\s*2\b", p.stderr), p.stderr[-3000:]


def test_a_directory_as_resume_from_is_called_a_directory(tmp_path, no_ranks):
    payload = _good_payload(SMALL)
    for step in (4, 10):
        save_checkpoint(str(tmp_path), step, payload["model"], payload["optimizer"], payload["config"])
    with pytest.raises(ConfigError) as e:
        run_training(SMALL.replace(resume_from=str(tmp_path)), progress=False)
    assert str(e.value) == (f"TrainConfig.resume_from={str(tmp_path)!r} is not accepted: it is a directory, not a "
                            "checkpoint file; give one of its ckpt-*.pt files, e.g. the latest "
                            f"{str(tmp_path / 'ckpt-0000010.pt')!r}")
    assert not no_ranks
