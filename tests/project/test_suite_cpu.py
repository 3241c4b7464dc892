"""tools/suite_cpu.py: each test is charged the CPU of the processes it started, ranks forked later included."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _suite_cpu():
    spec = importlib.util.spec_from_file_location("suite_cpu", ROOT / "tools" / "suite_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _procs(*rows) -> dict:
    """{(pid, start): record} from (pid, ppid, start, cpu, cmd[, cpu0]) rows, as Sampler leaves them."""
    out = {}
    for pid, ppid, start, cpu, cmd, *cpu0 in rows:
        out[(pid, int(start * 100))] = {"pid": pid, "ppid": ppid, "start": start, "cpu": cpu, "cmd": cmd,
                                        "cpu0": cpu0[0] if cpu0 else 0.0}
    return out


PY = "/venv/bin/python"
WORKER = f"{PY} -u -c import sys;exec(eval(sys.stdin.readline()))"
FORKSERVER = f"{PY} -B -c from multiprocessing.forkserver import main; main(3, 5, ['x'])"
TESTS = [{"id": "t.py::a", "pid": 100, "t0": 10.0, "t1": 20.0, "cpu": 1.0},
         {"id": "t.py::b", "pid": 100, "t0": 20.0, "t1": 30.0, "cpu": 0.5},
         {"id": "u.py::c", "pid": 101, "t0": 10.0, "t1": 40.0, "cpu": 0.0}]


def test_a_forkserver_goes_to_the_test_that_started_it_and_each_rank_to_the_test_that_launched_it():
    tool = _suite_cpu()
    procs = _procs((100, 1, 5.0, 30.0, WORKER, 2.0),  # the worker itself: charged through its tests' own cpu
                   (200, 100, 12.0, 4.0, FORKSERVER),  # started during a
                   (300, 200, 25.0, 2.0, FORKSERVER),  # a rank it forked during b
                   (301, 300, 26.0, 1.0, f"{PY} -m ddp_helpers.train --out x"),  # that rank's own child
                   (302, 200, 20.0 - 0.5 / tool.TICKS, 0.5, FORKSERVER),  # b's first moment, rounded down a tick
                   (400, 101, 45.0, 9.0, f"{PY} -m sphinx"),  # after its worker's last test: no test's
                   (500, 1, 12.0, 7.0, "/usr/bin/something"))  # not below any pytest process
    per_test, kinds = tool.attribute(procs, TESTS)
    assert per_test["t.py::a"] == {"cpu": 5.0, "procs": 1, "wall": 10.0, "started": [["forkserver", 4.0]]}
    assert per_test["t.py::b"] == {"cpu": 4.0, "procs": 3, "wall": 10.0, "started": [
        ["forked from forkserver", 2.0], ["-m ddp_helpers.train", 1.0], ["forked from forkserver", 0.5]]}
    assert per_test["u.py::c"]["cpu"] == 0.0
    assert kinds == {"forkserver": 4.0, "forked from forkserver": 2.5, "-m ddp_helpers.train": 1.0, "-m sphinx": 9.0}


def test_a_pytest_run_inside_a_test_is_that_tests_and_a_parent_is_the_one_alive_when_its_child_started():
    tool = _suite_cpu()
    inner = f"{PY} -m pytest -q t.py::b"
    tests = TESTS + [{"id": "t.py::b", "pid": 600, "t0": 15.5, "t1": 17.0, "cpu": 0.7}]  # logged by the inner run
    procs = _procs((100, 1, 5.0, 30.0, WORKER),
                   (600, 100, 15.0, 2.0, inner),  # started by test a
                   (700, 600, 16.0, 1.5, FORKSERVER),  # started by the inner run's b
                   (600, 1, 35.0, 8.0, "/usr/bin/later"),  # the pid reused after the inner run ended
                   (800, 600, 36.0, 3.0, FORKSERVER))  # the later process's child: not below pytest
    per_test, kinds = tool.attribute(procs, tests)
    assert per_test["t.py::a"]["cpu"] == 1.0 + 2.0 + 1.5 and per_test["t.py::a"]["procs"] == 2
    assert per_test["t.py::b"] == {"cpu": 0.5, "procs": 0, "wall": 10.0, "started": []}  # not the inner run's
    assert kinds == {"-m pytest": 2.0, "forkserver": 1.5}


@pytest.mark.parametrize("cmd, parent, expected", [
    (f"{PY} -B -c from multiprocessing.spawn import spawn_main; spawn_main(tracker_fd=4)", WORKER, "spawned rank"),
    (f"{PY} -Xfrozen_modules=off -m ipykernel_launcher -f k.json", WORKER, "kernel"),
    (f"{PY} /venv/bin/torchrun --standalone -m ddp_helpers.train", WORKER, "torchrun"),
    (f"{PY} -u -m ddp_helpers.train --out x", "torchrun", "-m ddp_helpers.train"),
    (f"{PY} -c print(1)", WORKER, "python -c"),
    ("/usr/lib/chromium/chromium --headless", WORKER, "chromium"),
])
def test_each_process_gets_a_short_name_of_what_it_runs(cmd, parent, expected):
    assert _suite_cpu().kind(cmd, parent) == expected


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_real_run_charges_a_childs_cpu_to_its_test_and_keeps_the_commands_exit_status(tmp_path):
    (tmp_path / "test_burn.py").write_text(
        "import subprocess, sys\n"
        "BURN = 'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.6: pass'\n"
        "def test_idle():\n    pass\n"  # first: a process must not be charged to the test before its own
        "def test_child_burns():\n    subprocess.run([sys.executable, '-c', BURN], check=True)\n"
        "def test_fails():\n    assert False\n")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "suite_cpu.py"), "--json", str(tmp_path / "cpu.json"),
                           "--", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:nbval",
                           "test_burn.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr  # the failing test's status, passed on
    tests = json.loads((tmp_path / "cpu.json").read_text())["tests"]
    child, idle = tests["test_burn.py::test_child_burns"], tests["test_burn.py::test_idle"]
    assert child["procs"] == 1 and 0.35 < child["cpu"] < 5, child  # sampled every 0.2 s: its last moments may be missed
    assert idle["procs"] == 0 and idle["cpu"] < 0.2, idle
    assert "test_burn.py::test_child_burns" in done.stdout and "python -c" in done.stdout, done.stdout
