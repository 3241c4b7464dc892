"""Bad settings are refused by run_training before any process starts, naming the setting, its value and the fix."""
from __future__ import annotations

import os
import atexit
import socket

import psutil
import pytest
import torch

from ddp_helpers import ConfigError, TrainConfig, run_training
from ddp_helpers.ranks import launcher as L

SMALL = TrainConfig(dataset="mnist-5k", max_steps=12, threads_per_rank=1)

_taken = socket.socket()
_taken.bind(("127.0.0.1", 0))
_taken.listen(1)
TAKEN_PORT = _taken.getsockname()[1]
atexit.register(_taken.close)  # held for the whole session (the ids use it), closed at its end

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
    monkeypatch.setattr(L, "start_ranks", lambda *a, **k: started.append(1))
    before = len(psutil.Process().children(recursive=True))
    with pytest.raises(ConfigError) as e:
        run_training(SMALL.replace(**kwargs), progress=False)
    msg = str(e.value)
    assert setting in msg, f"message does not name the setting: {msg}"
    value = list(kwargs.values())[0]
    assert repr(value) in msg or str(value) in msg, f"message does not show the value: {msg}"
    assert "accepted" in msg or "use" in msg or "needs" in msg, f"message does not say what to do: {msg}"
    assert not started and len(psutil.Process().children(recursive=True)) == before


def test_taken_master_port_names_the_field_and_the_fix():
    with pytest.raises(ConfigError, match=rf"TrainConfig.master_port={TAKEN_PORT} is not accepted") as e:
        run_training(SMALL.replace(master_port=TAKEN_PORT), progress=False)
    assert "Use master_port=0 to let the OS choose one" in str(e.value)


def test_not_a_config_is_refused():
    with pytest.raises(ConfigError, match="TrainConfig"):
        run_training({"world_size": 2}, progress=False)  # type: ignore[arg-type]


def test_too_many_nccl_ranks_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match="one GPU per rank"):
        run_training(SMALL.replace(backend="nccl", world_size=2), progress=False)


def test_auto_backend_picks_gloo_without_enough_gpus(monkeypatch):
    from ddp_helpers.ranks.checks import resolve_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_backend("auto", 2) == "gloo"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_backend("auto", 2) == "nccl"


# ------------------------------------------------------------------------------------------ the data root
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


@pytest.mark.needs_torchvision
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


def test_unreadable_data_root_is_refused(tmp_path):
    root = tmp_path / "file-not-dir"
    root.write_text("x")
    from ddp_helpers.data import sources as D

    D.clear_cache()
    with pytest.raises(ConfigError, match="data_root"):
        run_training(SMALL.replace(dataset="fashion-mnist", data_root=str(root)), progress=False)
