"""The forkserver the ranks come from: a Ctrl-C sent to the notebook's process group while it imports torch
doesn't end it, and warm_up() in a script's top level (what nbconvert --to script makes) is harmless."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from _procs import default_signals, without_torch_note

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

INTERRUPTED = textwrap.dedent("""
    import os, sys
    import ddp_helpers

    def hello(rank, world_size):
        return rank

    if __name__ == "__main__":
        os.environ["DDP_HELPERS_PRELOAD"] = "slow_preload"  # the server is still importing when the test interrupts
        ddp_helpers.warm_up()
        print("warming", flush=True)
        try:
            sys.stdin.readline()  # a cell running while the server imports: the stop button interrupts it
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        print(ddp_helpers.launch(hello, 2), flush=True)  # the next cell
""")
SLOW_PRELOAD = "import os, time\nopen(os.environ['PRELOAD_MARK'], 'w').close()\ntime.sleep(2)\n"


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_while_the_server_imports_leaves_it_working(tmp_path):
    (tmp_path / "slow_preload.py").write_text(SLOW_PRELOAD)
    (tmp_path / "parent.py").write_text(INTERRUPTED)
    mark = tmp_path / "preloading"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), ROOT]), "PRELOAD_MARK": str(mark),
           "DDP_HELPERS_PROGRESS": "0"}
    proc = subprocess.Popen([sys.executable, str(tmp_path / "parent.py")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                            start_new_session=True,  # its own process group, as a Jupyter kernel has
                            preexec_fn=default_signals)  # SIGINT at its default, also in a background job
    try:
        first = proc.stdout.readline()
        if not without_torch_note(first):  # warm_up's line naming another torch than the recorded one
            first = proc.stdout.readline()
        assert first.strip() == "warming"
        deadline = time.monotonic() + 60
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.01)  # until the server is inside its (slow) preload
        assert mark.exists(), "the server never started its preload"
        os.killpg(proc.pid, signal.SIGINT)  # what Jupyter's interrupt sends: the kernel's whole group
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert without_torch_note(out).split() == ["interrupted", "[0,", "1]"], out + err
    assert "Traceback" not in err and "EOFError" not in err, err


UNGUARDED_WARM_UP = textwrap.dedent("""
    import ddp_helpers

    ddp_helpers.warm_up()  # a notebook's set-up cell, at the top level of the exported script


    def hello(rank, world_size):
        return rank


    if __name__ == "__main__":
        print(ddp_helpers.launch(hello, 2))
""")


@pytest.mark.slow
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_warm_up_at_a_scripts_top_level_is_harmless(tmp_path, method):
    script = tmp_path / "exported.py"
    script.write_text(UNGUARDED_WARM_UP.replace("launch(hello, 2)", f"launch(hello, 2, start_method={method!r})"))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=180,
                          env={**os.environ, "PYTHONPATH": ROOT, "DDP_HELPERS_PROGRESS": "0"})
    assert without_torch_note(done.stdout).strip() == "[0, 1]", done.stdout + done.stderr[-3000:]


PRELOAD_GC = textwrap.dedent("""
    import gc, json, os, sys
    from ddp_helpers.ranks import server_preload
    server_preload.MODULES = ()  # torch's imports left out: what is checked is the collector around them
    os.environ[server_preload.EXTRA_ENV] = sys.argv[1]
    try:
        server_preload.preload()
        failed = None
    except ImportError as e:
        failed = type(e).__name__
    import gc_probe
    print(json.dumps({"during": gc_probe.ENABLED, "after": gc.isenabled(), "frozen": gc.get_freeze_count(),
                      "failed": failed}))
""")


@pytest.mark.parametrize("extra, failed", [("gc_probe", None), ("gc_probe,no_such_module_here", "ModuleNotFoundError")])
def test_the_server_imports_with_the_collector_off_and_turns_it_back_on(tmp_path, extra, failed):
    """Collections during the preload's imports walk every object made so far (a part of the first launch's wait):
    the collector is off while they run, and on again with the heap frozen, after a failed import too."""
    (tmp_path / "gc_probe.py").write_text("import gc\nENABLED = gc.isenabled()\nKEEP = [[i] for i in range(1000)]\n")
    out = subprocess.run([sys.executable, "-c", PRELOAD_GC, extra], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, str(tmp_path)])})
    assert out.returncode == 0, out.stderr[-3000:]
    got = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert got["during"] is False and got["after"] is True and got["failed"] == failed, got
    assert got["frozen"] > 1000, got  # the probe's objects (and all before them) moved out of the collector's view
