"""A temp dir whose path is too long for a socket (clusters set long TMPDIRs) still launches: the forkserver's
socket folder goes to a short private folder instead of failing with "AF_UNIX path too long" (issue 49, round-4
leftover)."""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from ddp_helpers.common.errors import ConfigError
from ddp_helpers.ranks import folders, startmethod

SCRIPT = """
import os
from ddp_helpers import launch

def where(rank, world_size):
    return rank

if __name__ == "__main__":
    print(launch(where, 2))
"""


def test_a_launch_from_a_long_temp_dir(tmp_path):
    temp = tmp_path / ("x" * 60) / ("y" * 60)
    temp.mkdir(parents=True)
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(temp), "PYTHONPATH": os.getcwd()})
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and out.strip() == "[0, 1]", out + err
    assert "AF_UNIX" not in err
    for folder in glob.glob(os.path.join(folders.SHORT_ROOT, folders.MP_DIR_PREFIX + "*")):  # its own: removed
        try:
            with open(os.path.join(folder, "owner")) as fh:
                assert not fh.read().startswith(f"{proc.pid} "), folder
        except OSError:
            pass  # another process's, or being removed


def test_the_socket_root_is_chosen_by_the_path_length(monkeypatch):
    assert startmethod.socket_root("/tmp") is None
    long = "/scratch/" + "a" * 80
    assert startmethod.socket_root(long) == folders.SHORT_ROOT
    monkeypatch.setattr(startmethod, "SOCKET_PATH_MAX", 108)
    assert startmethod.socket_root("/" + "b" * 64) is None  # 107 bytes with its NUL: fits on Linux ...
    monkeypatch.setattr(startmethod, "SOCKET_PATH_MAX", 104)
    assert startmethod.socket_root("/" + "b" * 64) == folders.SHORT_ROOT  # ... not on macOS
    monkeypatch.setattr(folders, "SHORT_ROOT", "/nonexistent-short-root")
    with pytest.raises(ConfigError, match=r"TMPDIR='/scratch/a+' is not accepted: .*AF_UNIX.*set TMPDIR to a "
                                          r"shorter folder"):
        startmethod.socket_root(long)
