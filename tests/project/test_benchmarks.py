"""The benchmark scripts still run and print the tables docs/benchmarks.md quotes (people check the figures)."""
import importlib.util
import math
import os
import re
import subprocess
import sys
import threading
import time

import psutil
import pytest

from ddp_helpers.data import DEBIAN_FASHION_DIR

from _procs import describe_and_kill, outliving

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(script: str, *args: str, timeout: int) -> subprocess.CompletedProcess:
    """Run benchmarks/<script> with args from the repository root; its output captured as text.

    Every process it started must end soon after it (a forkserver exits when its parent has gone): what outlives
    it is a leak, and its memory, handed back later, would also disturb the next test's system-wide measure.
    """
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "benchmarks", script), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    family, done = {}, threading.Event()

    def watch() -> None:  # the script's descendants, while it runs (an orphan leaves its tree)
        while not done.wait(0.2):
            try:
                family.update((p.pid, p) for p in psutil.Process(proc.pid).children(recursive=True))
            except psutil.Error:
                pass

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        done.set()
        watcher.join()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        left = describe_and_kill(outliving(list(family.values()), timeout=15.0))
    assert not left, f"{script} left processes running after it ended: {left}"
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _load(script: str):
    """benchmarks/<script> imported as a module (its folder on sys.path, as when it runs as a script)."""
    folder = os.path.join(ROOT, "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)  # step_warmth and thread_times import bench_pipelines from their folder
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), os.path.join(folder, script))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _in_process(script: str, args, monkeypatch, capsys) -> tuple:
    """benchmarks/<script>'s main() with these arguments, in this process: (exit status, stdout, stderr).

    Its ranks come from this worker's forkserver: a process of its own would spend ~10 s of CPU importing torch
    twice (itself and its forkserver) before measuring anything. Scripts that pin their own process to a core or
    find their ranks among their own children (step_warmth.py, thread_times.py) run as processes (_bench).
    """
    module = _load(script)
    monkeypatch.setattr(sys, "argv", [script, *args])
    capsys.readouterr()
    try:
        code = module.main()
    except SystemExit as e:  # argparse's p.error
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _refusal(script: str, args, monkeypatch, capsys) -> tuple:
    """A refusal happens while the arguments are read, before any measuring: (exit status, what went to stderr)."""
    code, _, err = _in_process(script, args, monkeypatch, capsys)
    return code, err


def _table(stdout: str) -> dict:
    """Markdown rows of a benchmark's table, keyed by their first cell (the header row left out)."""
    cells = [[x.strip() for x in line.strip().strip("|").split("|")] for line in stdout.splitlines()
             if line.startswith("| ") and not line.startswith("|---")]
    return {c[0]: c[1:] for c in cells[1:]}


def test_allreduce_latency_prints_one_row_per_collective(monkeypatch, capsys):
    code, stdout, stderr = _in_process("allreduce_latency.py", ["--iters", "5", "--rounds", "1", "--markdown"],
                                       monkeypatch, capsys)
    assert code == 0, stderr[-3000:]
    rows = [line for line in stdout.splitlines() if re.match(r"\| all-(reduce|gather) \d", line)]
    labels = [r.split("|")[1].strip() for r in rows]
    assert labels == ["all-reduce 1", "all-reduce 2", "all-reduce 4", "all-reduce 64", "all-reduce 1024",
                      "all-reduce 7850", "all-reduce 32768", "all-gather 7850"], stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert int(cells[1].replace(",", "")) == int(cells[0].split()[1]) * 4  # bytes of float32
        median, mean, p90 = (float(c) for c in cells[2:5])
        assert 0 < median <= p90 and mean > 0
        assert re.fullmatch(r"\d+%", cells[5])


def test_allreduce_latency_refuses_bad_counts(monkeypatch, capsys):
    code, err = _refusal("allreduce_latency.py", ["--iters", "0"], monkeypatch, capsys)
    assert code == 2 and "--iters and --rounds must be at least 1" in err, err


@pytest.mark.slow
def test_bench_pipelines_prints_every_configuration_and_the_targets(monkeypatch, capsys):
    # The default start method (a forkserver with torch preloaded) instead of the script's spawn: the table and
    # the targets are the same code either way, and five spawned pairs of ranks importing torch cost ~80% of it.
    code, stdout, stderr = _in_process("bench_pipelines.py", ["--dataset", "mnist-5k", "--repeats", "1",
                                                              "--seed-repeats", "1", "--markdown", "--start-method",
                                                              "auto"], monkeypatch, capsys)
    assert code == 0, stderr[-3000:]
    rows = {c[0]: c for c in ([x.strip() for x in line.strip("|").split("|")] for line in stdout.splitlines()
                              if line.startswith("| seed") or line.startswith("| default"))}
    assert set(rows) == {"seed pipeline (Listing 7.2)", "seed pipeline, cores bound", "default, full telemetry",
                         "default, bare loop", "default, full telemetry, no binding"}, stdout
    for name, c in rows.items():
        wall, startup, loop = float(c[1]), float(c[2]), float(c[3])
        assert 0 < startup < wall and 0 < loop < wall, c
        # mnist-5k: 4,000 training images; no sampler in the seed pipeline, so each rank walks all of them
        assert int(c[4]) == (63 if name.startswith("seed") else 32), c
        # Memory the run added (peak minus the level at entry, system-wide): a number, never below 0. Not a lower
        # bound: while another test worker or the previous run hands pages back, a run's peak can be its entry level
        # (CI read 0 for a seed run). That the sampler sees an allocation is test_memory_sampler_... below.
        assert math.isfinite(float(c[8])) and float(c[8]) >= 0, c
    for target in ("default end to end vs seed:", "default loop vs seed loop:", "telemetry overhead:"):
        assert target in stdout


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="no /proc/meminfo (not Linux)")
def test_memory_sampler_reads_meminfo_and_sees_an_allocation():
    bench = _load("bench_pipelines.py")
    with open("/proc/meminfo") as fh:  # the slow, obvious parse the sampler's fast one must agree with
        info = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in fh)}
    fd = os.open("/proc/meminfo", os.O_RDONLY)
    try:
        fast = bench._memory_used_mb(fd)
    finally:
        os.close(fd)
    assert abs(fast - (info["MemTotal"] - info["MemAvailable"]) / 1024) < 64  # MB; the system moves in between
    assert math.isnan(bench._memory_used_mb(-1))  # an unreadable file gives NaN, not an exception
    # The kernel keeps freed pages on per-CPU lists that MemAvailable leaves out, and serves the next allocation
    # from them: 1 GiB allocated right after another 1 GiB was freed read as +6 to +425 MB, so the sampler
    # subtracts them (checked below). The measure is system-wide, and under load other processes hand back
    # memory while a reading is taken: each reading is compared with one taken a moment apart, the block in use
    # against the block freed (the block is in the measure) and against the sampler's peak (it caught it).
    with open("/proc/zoneinfo") as fh:  # the slow, obvious parse of the per-CPU lists
        slow = sum(int(n) for n in re.findall(r"^\s+count:\s+(\d+)$", fh.read(), re.M)) * os.sysconf("SC_PAGE_SIZE")
    zones = os.open("/proc/zoneinfo", os.O_RDONLY)
    try:
        assert abs(bench._per_cpu_free_mb(zones) - slow / 2**20) < 64
    finally:
        os.close(zones)
    assert bench._per_cpu_free_mb(-1) == 0.0  # unreadable (not Linux): no correction
    readings = []
    for _ in range(3):
        with bench.MemoryPeak() as used:
            block = bytearray(2**30)
            block[::4096] = b"\1" * len(block[::4096])  # touch every page, so the memory is really in use
            time.sleep(0.1)  # ten sampling periods
            holding = used.read()
            time.sleep(0.05)  # five more
            del block
            freed = used.read()
        readings.append((holding - freed, used.peak - holding))
        if holding - freed > 512 and used.peak > holding - 64:
            break
    assert any(block_mb > 512 and peak_gap > -64 for block_mb, peak_gap in readings), readings


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat"),
                    reason="no per-thread scheduler statistics in this kernel")
@pytest.mark.skipif(not os.path.isdir(DEBIAN_FASHION_DIR), reason="Debian's dataset-fashion-mnist not installed")
@pytest.mark.slow
def test_thread_times_accounts_for_each_kind_of_thread():
    out = _bench("thread_times.py", "--runs", "1", "--markdown", timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {k: v for k, v in _table(out.stdout).items() if k.startswith(("training", "gloo"))}
    assert {"training thread", "gloo collective workers", "gloo tcp_loop"} <= set(rows), out.stdout
    step_us = float(re.search(r"a step took (\d+) us", out.stdout).group(1))
    on_cpu = {k: float(v[0]) for k, v in rows.items()}
    # The training thread computes every step; all threads of a rank together can't use more than the 2 ranks'
    # share of the cores in a step, and each all-reduce wakes gloo's threads at least once.
    assert 0 < on_cpu["training thread"] < step_us * (os.cpu_count() or 1)
    assert sum(on_cpu.values()) * 2 <= step_us * (os.cpu_count() or 1) * 1.1
    assert float(rows["gloo collective workers"][2]) >= 1 and float(rows["gloo tcp_loop"][2]) >= 1


def test_thread_times_refuses_bad_counts(monkeypatch, capsys):
    code, err = _refusal("thread_times.py", ["--runs", "0"], monkeypatch, capsys)
    assert code == 2 and "--runs must be at least 1" in err, err


@pytest.mark.slow
def test_step_warmth_times_each_gap_kind_and_phase():
    out = _bench("step_warmth.py", "--gaps", "0,2", "--steps", "40", "--rounds", "2", "--markdown", timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _table(out.stdout)
    assert set(rows) == {"sleep 0 ms", "sleep 2 ms", "busy-wait 0 ms", "busy-wait 2 ms"}, out.stdout
    for name, r in rows.items():
        gap_us, step_us, ratio = float(r[0]), float(r[1]), float(r[2])
        phases = [float(v) for v in r[3:7]]
        # The gap really happened (a sleep may overshoot, never undershoot), the first gap is the baseline,
        # and the phases are parts of the step (medians of parts can't add up to much more than the whole).
        assert gap_us >= (2000 if name.endswith(" 2 ms") else 0) * 0.99, (name, r)
        assert step_us > 0 and all(v > 0 for v in phases), (name, r)
        assert sum(phases) <= step_us * 1.25, (name, r)
        if name.endswith(" 0 ms"):
            assert ratio == 1.0, (name, r)


@pytest.mark.parametrize("args, message", [
    (["--gaps", "-1"], "--gaps must be between 0 and 1000 ms"),
    (["--gaps", "1,x"], "--gaps must be numbers"),
    (["--steps", "0"], "--steps and --rounds must be at least 1"),
    (["--steps", "2", "--rounds", "3"], "--rounds at most --steps"),
])
def test_step_warmth_refuses_bad_settings(args, message, monkeypatch, capsys):
    code, err = _refusal("step_warmth.py", args, monkeypatch, capsys)
    assert code == 2 and message in err, err


@pytest.mark.slow
def test_startup_prints_every_call_and_the_targets(monkeypatch, capsys):
    # In this process: its calls' ranks (the default's and spawn's) are this worker's children either way; the
    # rows that measure a fresh interpreter start one each. A process of its own would add ~7 s of CPU here.
    code, stdout, stderr = _in_process("startup.py", ["--calls", "2", "--checks", "2", "--reading-s", "0",
                                                      "--setup-rounds", "1", "--markdown"], monkeypatch, capsys)
    assert code == 0, stderr[-3000:]
    rows = _table(stdout)
    assert {"default (auto), call 1", "default (auto), call 2", "spawn, call 1", "spawn, call 2",
            "default, first call in a fresh process", "default, first call 0 s after warm_up()"} == set(rows)
    for startup, call, loop, after, other in ((float(x) for x in r) for r in rows.values()):
        assert 0 < startup < call and 0 < loop < call
        assert 0 <= after < call and 0 < other < call and abs(startup + loop + after + other - call) < 0.004
    for target in ("exercise check: first", "default start-up, calls 2..2", "start-up spawn / default:",
                   "default calls 2..2, phases (median): start-up",
                   "set-up cell to the end of the first launch (median of 1): warm_up() before the imports"):
        assert target in stdout


@pytest.mark.parametrize("args, message", [
    (["--calls", "1"], "--calls and --checks must be at least 2"),
    (["--setup-rounds", "0"], "--setup-rounds must be at least 1"),
])
def test_startup_refuses_bad_settings(args, message, monkeypatch, capsys):
    code, err = _refusal("startup.py", args, monkeypatch, capsys)
    assert code == 2 and message in err, err


def test_launch_overhead_prints_a_row_per_world_size(monkeypatch, capsys):
    """In this process (its launches are the package's own, forked from this worker's forkserver)."""
    module = _load("launch_overhead.py")
    monkeypatch.setattr(sys, "argv", ["launch_overhead.py", "--calls", "2", "--markdown"])
    assert module.main() == 0
    rows = _table(capsys.readouterr().out)
    assert sorted(rows) == ["2", "3"] and all(float(r[0]) > 0 and r[2] == "2" for r in rows.values()), rows


def test_launch_overhead_refuses_bad_counts(monkeypatch, capsys):
    code, err = _refusal("launch_overhead.py", ["--calls", "0"], monkeypatch, capsys)
    assert code == 2 and "--calls must be at least 1" in err, err


def test_kernel_restart_refuses_bad_counts(monkeypatch, capsys):
    code, _, err = _in_process("kernel_restart.py", ["--rounds", "0"], monkeypatch, capsys)
    assert code == 2 and "--rounds" in err


@pytest.mark.parametrize("args, message", [
    (["--rounds", "0"], "--rounds and --warm-calls must be at least 1"),
    (["--warm-calls", "0"], "--rounds and --warm-calls must be at least 1"),
    (["--contenders", "ddp_helpers,keras"], "--contenders: unknown keras"),
    (["--also-tree", "/nonexistent-tree"], "--also-tree /nonexistent-tree: no ddp_helpers package in it"),
])
def test_first_call_peers_refuses_bad_settings(args, message, monkeypatch, capsys):
    code, err = _refusal("first_call_peers.py", args, monkeypatch, capsys)
    assert code == 2 and message in err, err


@pytest.mark.slow
def test_first_call_peers_times_each_phase_in_a_real_kernel():
    # ddp_helpers alone, one round, as a process of its own (the script imports no torch; its kernel, the kernel's
    # forkserver and the ranks must all be gone when it ends). A peer this interpreter can't import is named and
    # left out, not a failure.
    out = _bench("first_call_peers.py", "--rounds", "1", "--warm-calls", "1", "--markdown",
                 "--contenders", "ddp_helpers,accelerate", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    if importlib.util.find_spec("accelerate") is None:
        assert "accelerate: left out" in out.stdout, out.stdout
    rows = _table(out.stdout)
    kernel, setup, first, both, warm = (float(x) for x in rows["ddp_helpers"])
    assert 0 < kernel and 0 < setup and 0 < first and 0 < warm and abs(setup + first - both) < 0.011, rows
    phases = {k: float(v[0]) for k, v in rows.items() if k.startswith(("set-up cell:", "server", "first call:"))}
    # The server starts during the set-up cell and has preloaded by the end of the first call's wait; the call's
    # parts fit in the call as the client timed it.
    assert 0 <= phases["server started (from the set-up's start)"] < phases["server's preloads done (idem)"], phases
    assert 0 < phases["server's CPU time by then"], phases
    assert 0 <= phases["first call: waiting for the server"] <= phases["first call: start-up (the wait included)"]
    assert phases["first call: start-up (the wait included)"] + phases["first call: loop"] < first, phases
