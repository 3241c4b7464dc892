"""SIGTERM or SIGHUP to a process mid-run (a kernel the server stops) leaves none of its folders behind: the run
folder and its multiprocessing folder (the forkserver's socket) are removed before it dies of the signal, which
skips atexit (issue 49, round-4 leftover)."""
from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from _procs import default_signals

SCRIPT = """
import sys, time
from ddp_helpers import launch

def wait(rank, world_size, marker):
    open(f"{marker}{rank}", "w").close()
    time.sleep(120)

if __name__ == "__main__":
    launch(wait, 2, args=(sys.argv[1],))
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signalled_launcher_leaves_no_folder(signum, tmp_path):
    temp = tempfile.mkdtemp(prefix="sig-", dir="/tmp")  # its own temp dir: only this launch's folders in it
    try:
        script = tmp_path / "run.py"
        script.write_text(SCRIPT)
        marker = str(tmp_path / "started")
        proc = subprocess.Popen([sys.executable, str(script), marker], cwd=str(tmp_path),
                                env={**os.environ, "TMPDIR": temp, "PYTHONPATH": os.getcwd()},
                                preexec_fn=default_signals)  # under `nohup make test` SIGHUP would stay ignored
        deadline = time.monotonic() + 240
        while not all(os.path.exists(f"{marker}{r}") for r in (0, 1)):  # both ranks running
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        assert glob.glob(os.path.join(temp, "ddp_helpers-mp-*")), "no multiprocessing folder to test"
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == -signum  # it still dies of the signal, as without the package
        assert [f for f in os.listdir(temp) if f.startswith("ddp_helpers-")] == []  # (torch caches stay)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
