"""What launch() can't start is refused before any rank starts: a taken port, a host that doesn't resolve, an
unknown start method, fork after CUDA, a program read from stdin; a script without a main guard is named."""
from __future__ import annotations

import os
import atexit
import socket
import re
import subprocess
import sys
import types

import pytest
import torch

from ddp_helpers import ConfigError, LaunchError, TrainConfig, launch, run_training

ENV = {**os.environ, "DDP_HELPERS_PROGRESS": "0"}

_taken = socket.socket()
_taken.bind(("127.0.0.1", 0))
_taken.listen(1)
TAKEN_PORT = _taken.getsockname()[1]
atexit.register(_taken.close)  # held for the whole session (the ids use it), closed at its end


def _hello(rank, world_size):
    return rank


def test_launch_names_its_own_argument_for_a_taken_port():
    with pytest.raises(ConfigError, match=rf"launch\(port={TAKEN_PORT}\) is not accepted: a free port") as e:
        launch(_hello, 2, start_method="fork", port=TAKEN_PORT)
    assert "Use launch(port=0) to let the OS choose one" in str(e.value)  # the fix, spelled as the caller writes it


def test_launch_names_its_host_argument():
    with pytest.raises(ConfigError, match=r"launch\(host='no-such-host.invalid'\) is not accepted: a resolvable host"):
        launch(_hello, 2, start_method="fork", host="no-such-host.invalid")


def test_unknown_start_method_refused():
    with pytest.raises(ConfigError, match="start_method"):
        launch(_hello, 2, start_method="threads")


def test_fork_refused_when_cuda_is_initialized(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(LaunchError, match="CUDA is already initialized"):
        launch(_hello, 2, start_method="fork")


def test_spawn_from_a_program_on_stdin_is_refused_before_anything_starts(monkeypatch):
    """`python - <<EOF`: spawn can't re-import a main program that has no file; say so instead of a dead rank.

    In this process, with the main module such a program has: what CPython gives it is checked first, in a bare
    interpreter (no torch to import: the refusal itself needs no other process)."""
    import ddp_helpers.engine.runner as R

    seen = subprocess.run([sys.executable, "-"], input="import sys; m = sys.modules['__main__']\n"
                          "print(m.__file__, m.__spec__)", capture_output=True, text=True, timeout=60)
    assert seen.stdout.split() == ["<stdin>", "None"], seen.stdout + seen.stderr
    stdin_main = types.ModuleType("__main__")
    stdin_main.__file__, stdin_main.__spec__ = "<stdin>", None
    monkeypatch.setitem(sys.modules, "__main__", stdin_main)
    loaded = []
    monkeypatch.setattr(R, "load_data", lambda *a, **k: loaded.append(1))
    with pytest.raises(LaunchError) as e:
        run_training(TrainConfig(dataset="mnist-5k", max_steps=2), progress=False)  # auto: the forkserver
    assert "read from <stdin>" in str(e.value) and "Save the code to a file" in str(e.value)
    assert not loaded  # refused before the data set is loaded, not after a failed launch


NANOBIND_EXIT_REPORT = re.compile(r"^(nanobind: |\s*- (leaked |\.\.\. skipped)|See https://nanobind\.)")


@pytest.mark.slow
def test_a_script_without_main_guard_gets_the_idiom_in_the_error(tmp_path):
    """Under spawn each rank re-imports the script; unguarded, it tries to launch again and dies before training.
    A real program: what is proved is what its ranks' real re-import does."""
    script = tmp_path / "unguarded.py"
    script.write_text("from ddp_helpers import run_training, TrainConfig\n"
                      "run_training(TrainConfig(dataset='mnist-5k', max_steps=2, threads_per_rank=1), progress=False)\n")
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=ENV, capture_output=True, text=True,
                       timeout=180)
    assert p.returncode != 0
    # torch 2.15's CUDA build loads triton, whose nanobind extension lists the objects it leaked when an interpreter
    # ends after an uncaught exception ("nanobind: leaked 4 instances!", then one line each): after our error line.
    lines = [line for line in p.stderr.strip().splitlines() if not NANOBIND_EXIT_REPORT.match(line)]
    last = lines[-1]
    assert "RankFailedError" in last and "before it reached the training function" in last, p.stderr[-3000:]
    assert 'if __name__ == "__main__":' in last
