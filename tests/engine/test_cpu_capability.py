"""The bitwise claims hold with other CPU kernels too: their tests, re-run in a process that uses other kernels.

torch picks its kernels by the CPU's vector unit (AVX-512, AVX2, none) and MKL by the CPU's make, and the kernels
decide the last bits of every float32 sum. A claim such as "by hand == DDP, bit for bit" that held only with
this machine's kernels would fail on the next laptop. ATEN_CPU_CAPABILITY=default (no SIMD) and
MKL_CBWR=COMPATIBLE make this machine run other kernels; both are read once, when torch starts, so the claims'
tests run again in a fresh interpreter (and its ranks) under them.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from ddp_helpers import TrainConfig, launch, run_training
from ddp_helpers.data import write_mnist

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "ddp_mnist.py"
OTHER_KERNELS = {"default": {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}}
BITWISE_CLAIMS = (
    "tests/engine/test_resume.py::test_a_crashed_run_resumed_from_latest_ends_like_the_uninterrupted_one",  # nb 6
    "tests/engine/test_cpu_capability.py::test_the_scripts_training_equals_run_training_bitwise",  # notebook 4
    "tests/engine/test_cpu_capability.py::test_torch_runs_the_kernels_it_was_asked_for",
)


def _only_under_other_kernels() -> None:
    if not os.environ.get("ATEN_CPU_CAPABILITY"):
        pytest.skip("runs inside test_bitwise_claims_hold_with_other_cpu_kernels, which sets ATEN_CPU_CAPABILITY")


def _script_rank(rank: int, world_size: int, root: str, save: str) -> int:
    """examples/ddp_mnist.py's main() on a forked rank: launch sets torchrun's variables, which main() reads."""
    spec = importlib.util.spec_from_file_location("ddp_mnist", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.main(argparse.Namespace(data_root=root, epochs=1, save=save if rank == 0 else None))


@pytest.mark.needs_torchvision
def test_the_scripts_training_equals_run_training_bitwise(tmp_path):
    """The script's own training code (torchvision's transforms, its loop) gives run_training's parameters.

    Its ranks are forked here rather than started by its mp.spawn (notebook 4 runs that, natively and with other
    kernels; tests/cli/test_example_script.py runs the script under torchrun): cheap enough to run with this
    machine's kernels and again under others, where the float arithmetic of torchvision's transforms and of the
    training could round differently.
    """
    root, saved = str(tmp_path / "MNIST_5k"), str(tmp_path / "final.pt")
    write_mnist(root)
    importlib.import_module("torchvision")  # once here, not in each forked rank
    codes = launch(_script_rank, 2, args=(root, saved), start_method="fork", init_group=False,
                   threads_per_rank=1)
    assert codes == [0, 0]
    sd = torch.load(saved)
    params = torch.cat([sd["1.weight"].reshape(-1), sd["1.bias"]]).numpy()
    cfg = TrainConfig(dataset="mnist", data_root=root, backend="gloo", world_size=2, epochs=1, threads_per_rank=1,
                      telemetry=False)
    assert np.array_equal(params, run_training(cfg, progress=False, start_method="fork").final_params)


def test_torch_runs_the_kernels_it_was_asked_for():
    """Under ATEN_CPU_CAPABILITY, this interpreter (and so its forked ranks) really uses those kernels."""
    _only_under_other_kernels()
    assert torch.backends.cpu.get_cpu_capability() == os.environ["ATEN_CPU_CAPABILITY"].upper()


@pytest.mark.parametrize("kernels", sorted(OTHER_KERNELS))
def test_bitwise_claims_hold_with_other_cpu_kernels(kernels):
    from _torchvision import torchvision_loads

    # The script's claim needs torchvision (its transforms); where none loads, the others must all still pass.
    claims = [c for c in BITWISE_CLAIMS if torchvision_loads() or "test_the_scripts_training" not in c]
    env = {**os.environ, **OTHER_KERNELS[kernels]}
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:nbval",
                        *claims], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0 and f"{len(claims)} passed" in p.stdout, p.stdout[-4000:] + p.stderr[-2000:]
