"""A torch left half imported by an interrupt (Ctrl-C during a cold kernel's `import torch`) is named with the fix,
a kernel restart, instead of torch's raw errors on every later launch (issue 49, round-4 leftover)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

# What an interrupted `import torch` leaves, made without a race: torch's submodules and C extension loaded,
# `torch` itself gone from sys.modules. Importing it again then fails inside torch.
HALF_IMPORTED = """
import sys
import torch
del sys.modules["torch"]
try:
    {call}
except BaseException as e:
    print(type(e).__name__ + ": " + str(e))
"""


@pytest.mark.parametrize("call", ["from ddp_helpers import run_training",
                                  "from ddp_helpers import launch; launch(print, 2)"], ids=["import", "launch"])
def test_a_half_imported_torch_says_restart_the_kernel(call):
    proc = subprocess.run([sys.executable, "-c", HALF_IMPORTED.format(call=call)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": os.getcwd()})
    out = proc.stdout.strip()
    assert out.startswith("TorchImportBroken: torch's import was interrupted") and "restart the kernel" in out, \
        proc.stdout + proc.stderr
    assert "\n" not in out


def test_a_whole_torch_is_not_mistaken_for_a_broken_one():
    from ddp_helpers.common.torch_state import half_imported, import_torch

    assert not half_imported() and import_torch() is sys.modules["torch"]
