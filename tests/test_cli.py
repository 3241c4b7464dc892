"""Result files, the command line (spawn) and the same module under torchrun."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from ddp_helpers import TrainResult
from ddp_helpers.engine.config import free_port

ENV = {**os.environ, "DDP_HELPERS_PROGRESS": "0"}


def test_save_load_round_trip(small_run, tmp_path):
    path = small_run.save(str(tmp_path / "r.json"))
    text = open(path).read()
    json.loads(text)  # strict JSON: no NaN tokens, no pickle
    back = TrainResult.load(path)
    assert back.config == small_run.config and back.dataset == small_run.dataset
    assert back.test_accuracy == small_run.test_accuracy
    for a, b in zip(small_run.ranks, back.ranks):
        for field in ("step", "loss", "local_grad_norm", "synced_grad_norm", "sample_indices", "step_time_s"):
            assert np.array_equal(getattr(a, field), getattr(b, field)), field
        assert a.param_fingerprint == b.param_fingerprint and a.samples_hash == b.samples_hash
    assert np.array_equal(back.final_params, small_run.final_params)
    assert len(back.peak_cuda_mb) == 2 and all(np.isnan(back.peak_cuda_mb))  # gloo on CPU: no GPU memory, saved as null
    assert back.peak_rss_mb == small_run.peak_rss_mb and back.bytes_allreduced == small_run.bytes_allreduced
    assert sorted(back.captured_grads) == sorted(small_run.captured_grads)
    assert np.array_equal(back.captured_grads[3]["local"], small_run.captured_grads[3]["local"])
    assert back.records()[5] == small_run.records()[5]


def test_load_rejects_other_files(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="not a ddp_helpers.TrainResult"):
        TrainResult.load(str(p))


def _cli(args, cwd, **kw):
    return subprocess.run([sys.executable, "-m", "ddp_helpers.train", *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=180, **kw)


def test_cli_end_to_end(tmp_path, small_run):
    out = tmp_path / "run"
    p = _cli(["--dataset", "mnist-5k", "--max-steps", "8", "--threads-per-rank", "1", "--out", str(out)], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "parameters identical on all ranks after every step: True" in p.stdout
    assert sorted(os.listdir(out)) == ["fingerprints.png", "grad_norms.png", "loss.png", "result.json"]
    for png in ("loss.png", "grad_norms.png", "fingerprints.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = TrainResult.load(str(out / "result.json"))
    assert res.ranks[0].param_fingerprint == small_run.ranks[0].param_fingerprint  # same config, same run


def test_cli_bad_flag_value_is_a_clear_error(tmp_path):
    p = _cli(["--batch-size", "0", "--out", str(tmp_path / "x")], tmp_path)
    assert p.returncode == 2
    assert "TrainConfig.batch_size=0" in p.stderr and "Traceback" not in p.stderr


def test_cli_failure_keeps_partial_metrics(tmp_path):
    out = tmp_path / "run"
    p = _cli(["--dataset", "mnist-5k", "--max-steps", "8", "--fault-rank", "1", "--fault-step", "4",
              "--out", str(out)], tmp_path)
    assert p.returncode == 1
    assert "rank 1 failed" in p.stderr and "InjectedFault" in p.stderr
    partial = TrainResult.load(str(out / "partial_result.json"))
    assert not partial.complete and partial.n_steps == 4


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                    reason="torchrun not installed next to this Python")
def test_torchrun_gives_the_same_run(tmp_path, small_run):
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    out = tmp_path / "tr"
    p = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "ddp_helpers.train",
                        "--dataset", "mnist-5k", "--max-steps", "8", "--threads-per-rank", "1", "--out", str(out)],
                       cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    res = TrainResult.load(str(out / "result.json"))
    assert res.world_size == 2 and res.fingerprints_agree()
    assert res.ranks[1].param_fingerprint == small_run.ranks[1].param_fingerprint
    assert res.test_accuracy == small_run.test_accuracy


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                    reason="torchrun not installed next to this Python")
def test_torchrun_two_nodes_give_the_same_run(tmp_path, small_run):
    """Two torchrun agents on this machine stand in for two nodes: RANK differs, LOCAL_RANK is 0 on both."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    port = free_port()
    procs = []
    for node in (0, 1):
        # Each "node" binds its one rank's thread to the same core otherwise: on real nodes they differ.
        procs.append(subprocess.Popen(
            [torchrun, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
             "--master-addr", "127.0.0.1", "--master-port", str(port), "-m", "ddp_helpers.train",
             "--dataset", "mnist-5k", "--max-steps", "8", "--threads-per-rank", "1", "--bind-cores", "false",
             "--no-plots", "--out", str(tmp_path / f"node{node}")],
            cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-2000:] for log in logs)
    assert not (tmp_path / "node1").exists()  # only global rank 0 writes, even though node 1 has a local rank 0
    res = TrainResult.load(str(tmp_path / "node0" / "result.json"))
    assert res.world_size == 2 and res.fingerprints_agree()
    for mine, spawned in zip(res.ranks, small_run.ranks):
        assert np.array_equal(mine.sample_indices, spawned.sample_indices)  # shards follow RANK, not LOCAL_RANK
        assert mine.param_fingerprint == spawned.param_fingerprint
    assert res.test_accuracy == small_run.test_accuracy


@pytest.mark.parametrize("text, expected", [("false", False), ("true", True), ("auto", None), ("off", False)])
def test_cli_bind_cores_flag_accepts_auto(text, expected):
    from ddp_helpers.train import build_parser, config_from_args

    assert config_from_args(build_parser().parse_args(["--bind-cores", text])).bind_cores is expected


def test_cli_plain_bool_flag_refuses_auto(capsys):
    from ddp_helpers.train import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--telemetry", "auto"])  # telemetry has no automatic setting
    assert "--telemetry" in capsys.readouterr().err


def test_default_threads_follow_the_usable_cores(monkeypatch):
    import ddp_helpers.ranks.procs as P
    import ddp_helpers.engine.config as C

    monkeypatch.setattr(P, "usable_cores", lambda: [4, 5, 6, 7, 8, 9])  # e.g. taskset -c 4-9
    monkeypatch.setattr(P, "cpu_quota", lambda: None)
    assert C.default_threads(2) == 3 and C.default_threads(4) == 1 and C.default_threads(8) == 1
