"""examples/ddp_mnist.py (Listing 7.2 fixed, no ddp_helpers inside) under torchrun, and write-mnist, the offline
data it runs on. Its training code against run_training: tests/engine/test_cpu_capability.py (with this machine's
kernels and others); its own mp.spawn start: notebook 4 (natively and with other kernels, in make test)."""
from __future__ import annotations

import os
import pathlib
import re
import runpy
import subprocess
import sys
import urllib.request

import numpy as np
import pytest
import torch

from ddp_helpers import TrainConfig, load_data, run_training
from ddp_helpers.data import sources as D
from ddp_helpers.data import write_mnist

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "examples" / "ddp_mnist.py"
DEAD_PROXY = "http://127.0.0.1:1"  # nothing listens there: every download fails at once, online or not
ENV = {**os.environ, "HTTP_PROXY": DEAD_PROXY, "HTTPS_PROXY": DEAD_PROXY, "http_proxy": DEAD_PROXY,
       "https_proxy": DEAD_PROXY, "NO_PROXY": "", "no_proxy": ""}
EPOCHS = 2  # two, so the sampler's set_epoch reshuffle is compared too


@pytest.fixture(scope="module")
def mnist5k_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("MNIST_5k")
    write_mnist(str(root))
    return root


@pytest.fixture(scope="module")
def engine_run(mnist5k_root):
    """run_training with the script's settings: 2 gloo ranks, seed 0, batch 64, lr 0.01, one thread per rank."""
    cfg = TrainConfig(dataset="mnist", data_root=str(mnist5k_root), backend="gloo", world_size=2, epochs=EPOCHS,
                      threads_per_rank=1, telemetry=False)
    return run_training(cfg, progress=False, start_method="fork")  # no forkserver: a fresh interpreter adds nothing


def _run(cmd, tmp_path):
    return subprocess.run(cmd, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=240)


def _check_against_engine(p, saved, engine_run):
    assert p.returncode == 0, p.stderr[-3000:]
    acc = re.findall(r"^test accuracy: (0\.\d{4})$", p.stdout, re.M)
    assert acc == [f"{engine_run.test_accuracy:.4f}"], p.stdout
    sd = torch.load(saved)
    params = torch.cat([sd["1.weight"].reshape(-1), sd["1.bias"]]).numpy()
    # Bitwise, not allclose: the same shards in the same order, the same initial weights, ToTensor+Normalize
    # give the same floats as the engine's normalize, and one thread per rank gives the same sums.
    assert np.array_equal(params, engine_run.final_params)


@pytest.mark.needs_torchvision
def test_written_layout_is_mnist5k_as_torchvision_reads_it(mnist5k_root):
    from torchvision import datasets

    d = D.load_mnist5k()
    train = datasets.MNIST(str(mnist5k_root), train=True, download=True)  # finds the files: no download
    test = datasets.MNIST(str(mnist5k_root), train=False, download=True)
    assert torch.equal(train.data, d.train_images) and torch.equal(train.targets, d.train_labels)
    assert torch.equal(test.data, d.test_images) and torch.equal(test.targets, d.test_labels)
    assert sorted(os.listdir(mnist5k_root / "MNIST")) == ["raw"]  # torchvision 0.29 writes no processed/ folder
    splits = load_data(TrainConfig(dataset="mnist", data_root=str(mnist5k_root)))
    assert splits.name == "mnist-5k" and "5,000-digit" in splits.source  # never passes for the full MNIST
    before = {f: os.path.getmtime(mnist5k_root / "MNIST" / "raw" / f) for f in D.RAW_FILES}
    write_mnist(str(mnist5k_root))  # the same files again: accepted, nothing rewritten
    assert before == {f: os.path.getmtime(mnist5k_root / "MNIST" / "raw" / f) for f in D.RAW_FILES}


def test_write_mnist_refuses_the_listings_folder_and_other_mnists(tmp_path, mnist5k_root):
    with pytest.raises(D.DataError, match="listing's MNIST folder"):
        write_mnist(str(tmp_path / "MNIST_data"))
    assert not (tmp_path / "MNIST_data").exists()
    other = tmp_path / "other"
    raw = other / "MNIST" / "raw"
    raw.mkdir(parents=True)
    data = (mnist5k_root / "MNIST" / "raw" / "train-labels-idx1-ubyte").read_bytes()
    (raw / "train-labels-idx1-ubyte").write_bytes(data[:-1] + bytes([(data[-1] + 1) % 10]))  # one label differs
    with pytest.raises(D.DataError, match="already holds a different MNIST"):
        write_mnist(str(other))
    assert os.listdir(raw) == ["train-labels-idx1-ubyte"]  # nothing added next to it
    legacy = tmp_path / "legacy" / "MNIST" / "processed"
    legacy.mkdir(parents=True)
    with pytest.raises(D.DataError, match="processed"):
        write_mnist(str(tmp_path / "legacy"))


def _as_main(monkeypatch, argv, module=None, path=None) -> int:
    """Run a module or a script as `python -m module` / `python path` would, in this process: its exit code.

    runpy runs its `if __name__ == "__main__":` block with sys.argv set; a fresh interpreter would prove nothing
    more for a command that starts no process, and costs an import of torch (~2 CPU-s)."""
    monkeypatch.setattr(sys, "argv", argv)
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        return e.code
    return 0


def test_write_mnist_command_line(tmp_path, capfd, monkeypatch):
    code = _as_main(monkeypatch, ["python -m ddp_helpers.data", "write-mnist", str(tmp_path / "five_k")],
                    module="ddp_helpers.data")
    assert code == 0, capfd.readouterr().err
    assert sorted(os.listdir(tmp_path / "five_k" / "MNIST" / "raw")) == sorted(D.RAW_FILES)
    from ddp_helpers.data.__main__ import main  # its refusal: the same main()

    assert main(["write-mnist", str(tmp_path / "MNIST_data")]) == 1
    err = capfd.readouterr().err
    assert "listing's MNIST folder" in err and "Traceback" not in err and err.count("\n") == 1, err


@pytest.mark.needs_torchvision
@pytest.mark.slow
def test_script_under_torchrun_matches_run_training(tmp_path, mnist5k_root, engine_run):
    saved = tmp_path / "final.pt"
    p = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
              "--data-root", str(mnist5k_root), "--epochs", str(EPOCHS), "--save", str(saved)], tmp_path)
    _check_against_engine(p, saved, engine_run)
    batch_lines = [line for line in p.stdout.splitlines() if line.startswith("batch ")]
    assert 0 < len(batch_lines) <= 2 * EPOCHS  # rank 0 logs now and then (32 batches an epoch), not every batch


@pytest.mark.needs_torchvision
def test_script_offline_without_data_names_the_fix(tmp_path, capfd, monkeypatch):
    """The script's own main block, in this process (it fails before starting any rank): one line on stderr."""
    for name, value in ENV.items():
        if "proxy" in name.lower():
            monkeypatch.setenv(name, value)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(urllib.request, "_opener", None)  # urlopen builds its opener anew, with the dead proxy
    code = _as_main(monkeypatch, [str(SCRIPT), "--data-root", str(tmp_path / "empty")], path=str(SCRIPT))
    out, err = capfd.readouterr()
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "python -m ddp_helpers.data write-mnist" in lines[0], err
    assert out == ""
