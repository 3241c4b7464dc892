"""Where a test run's CPU goes, per test, counting every process a test started (maintainers' tool, Linux).

    python tools/suite_cpu.py -- make test-unit                 # any command that runs pytest
    python tools/suite_cpu.py --top 40 --json cpu.json -- make test-notebooks

`pytest --durations` gives each test's wall time, but on a busy 2-core machine the time goes to the processes the
tests start (command lines, torchrun agents, spawned ranks, forkservers, kernels: each a fresh interpreter that
imports torch), which run beside other tests and are counted nowhere. This tool samples /proc every 0.2 s for
every process's CPU time, parent and start time, and has each pytest process (xdist workers too) log each test's
window through a plugin (tools/suite_cpu_plugin.py, loaded with PYTEST_PLUGINS). A process is charged to the
test that was running, in the pytest process it descends from, when it started: a forkserver to the test that
started it, each rank forked from it later to the test that launched that rank. Processes that end within one
sampling interval may be missed; the system-wide CPU (/proc/stat) is printed beside the sum to show how much.
The sampler's own cost is small (docs/benchmarks.md, "Figures behind the code's choices").
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Tuple

TOOLS = pathlib.Path(__file__).resolve().parent
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
Key = Tuple[int, int]  # (pid, start time in clock ticks): a pid reused later is another process


def read_stat(pid: str) -> Tuple[int, int, float]:
    """/proc/<pid>/stat: (parent pid, start time in ticks since boot, CPU seconds, user + system, all threads)."""
    with open(f"/proc/{pid}/stat") as fh:
        text = fh.read()
    fields = text[text.rindex(")") + 2:].split()  # the command name in parentheses may hold spaces
    return int(fields[1]), int(fields[19]), (int(fields[11]) + int(fields[12])) / TICKS


def read_cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace").strip()[:400]
    except OSError:
        return ""


def system_cpu() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat: user, nice, system, irq, softirq)."""
    with open("/proc/stat") as fh:
        fields = fh.readline().split()[1:]
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / TICKS


class Sampler:
    """A thread that reads every process's CPU time every interval_s; what it saw is in .procs."""

    def __init__(self, interval_s: float = 0.2):
        self.interval_s, self.procs, self.first = interval_s, {}, True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="suite_cpu-sampler", daemon=True)

    def __enter__(self) -> "Sampler":
        self.sample()  # before the command starts: what runs already is charged only what it uses from now on
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()  # the last word for those still running

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                ppid, start, cpu = read_stat(pid)
            except (OSError, ValueError, IndexError):
                continue  # ended between listdir and the read
            rec = self.procs.get((int(pid), start))
            if rec is None:  # seen for the first time: CPU it had before the run started isn't the run's
                rec = self.procs[(int(pid), start)] = {"pid": int(pid), "ppid": ppid, "start": start / TICKS,
                                                       "cpu0": cpu if self.first else 0.0, "seen": 0}
            if rec["seen"] < 3:  # read again: a child caught between fork and exec still shows its parent's
                rec["cmd"] = read_cmdline(pid) or rec.get("cmd", "")
            rec["cpu"], rec["seen"] = cpu, rec["seen"] + 1
        self.first = False


def kind(cmd: str, parent_cmd: str) -> str:
    """A short name for what a process is: 'forkserver', 'spawned rank', '-m ddp_helpers.train', 'sphinx'..."""
    if cmd and cmd == parent_cmd:
        return "forked from " + kind(parent_cmd, "")
    words = cmd.split()
    if not words:
        return "?"
    if "multiprocessing.forkserver" in cmd:
        return "forkserver"
    if "multiprocessing.spawn" in cmd:
        return "spawned rank"
    if "ipykernel" in cmd:
        return "kernel"
    if not os.path.basename(words[0]).startswith("python"):
        return os.path.basename(words[0])
    args = [w for w in words[1:] if w not in ("-u", "-B") and not w.startswith("-X")]
    if args[:1] == ["-m"] and len(args) > 1:
        return "-m " + args[1]
    if args and args[0] != "-c":
        return os.path.basename(args[0])
    return "python -c"


def attribute(procs: Dict[Key, dict], tests: List[dict]) -> Tuple[Dict[str, dict], Dict[str, float]]:
    """Charge each process to the test running, in the pytest process it descends from, when it started.

    Returns per test {cpu, procs, wall, started} (cpu: the pytest process's own during the test plus its
    processes'; started: each of those processes' kind and CPU) and CPU per kind of process, counting only
    processes below a pytest process that logged tests. A pytest run inside a test (a test that runs pytest) is
    one of that test's processes: its own tests' records are left out, so nothing is counted twice.
    """
    by_pid: Dict[int, List[dict]] = collections.defaultdict(list)
    for rec in sorted(procs.values(), key=lambda r: r["start"]):
        by_pid[rec["pid"]].append(rec)
    loggers = {t["pid"] for t in tests}
    nested = {pid for pid in loggers if any(_owner(r, by_pid, loggers) is not None for r in by_pid.get(pid, ()))}
    loggers -= nested
    by_pytest = collections.defaultdict(list)
    per_test: Dict[str, dict] = {}
    for t in (t for t in tests if t["pid"] in loggers):
        by_pytest[t["pid"]].append(t)
        entry = per_test.setdefault(t["id"], {"cpu": 0.0, "procs": 0, "wall": 0.0, "started": []})
        entry["cpu"] += t["cpu"]  # the same id twice (two runs of one notebook): both count
        entry["wall"] += t["t1"] - t["t0"]
    kinds: Dict[str, float] = collections.Counter()
    for rec in procs.values():
        owner = _owner(rec, by_pid, loggers)
        if owner is None:
            continue
        cpu = rec["cpu"] - rec["cpu0"]
        parent = _parent(rec, by_pid)
        name = kind(rec.get("cmd", ""), parent.get("cmd", "") if parent else "")
        kinds[name] += cpu
        test = _running_at(by_pytest[owner], rec["start"])
        if test is not None:
            entry = per_test[test["id"]]
            entry["cpu"] += cpu
            entry["procs"] += 1
            entry["started"].append([name, round(cpu, 2)])
    return per_test, dict(kinds)


def _running_at(tests: List[dict], start: float) -> Optional[dict]:
    """The test during which a process started at `start` began.

    /proc gives start times rounded down to a clock tick: one that began in a test's first milliseconds reads
    as before it. So a window reaches a tick back, and of two that hold start the later one began it.
    """
    held = [t for t in tests if t["t0"] - 1.0 / TICKS < start < t["t1"]]
    return max(held, key=lambda t: t["t0"]) if held else None


def _parent(rec: dict, by_pid: Dict[int, List[dict]]) -> Optional[dict]:
    """rec's parent: the newest process with its parent's pid that started no later than rec (pids are reused)."""
    older = [r for r in by_pid.get(rec["ppid"], ()) if r["start"] <= rec["start"]]
    return older[-1] if older else None


def _owner(rec: dict, by_pid: Dict[int, List[dict]], loggers: set) -> Optional[int]:
    """The nearest pytest process that logged tests above rec, or None."""
    for _ in range(64):  # deeper trees than this don't occur; a cycle (a reused pid) must not loop forever
        if rec["ppid"] in loggers:
            return rec["ppid"]
        rec = _parent(rec, by_pid)
        if rec is None:
            return None
    return None


def load_tests(folder: str) -> List[dict]:
    return [json.loads(line) for path in glob.glob(os.path.join(folder, "tests-*.jsonl")) for line in open(path)]


def report(per_test: Dict[str, dict], kinds: Dict[str, float], wall_s: float, machine_cpu_s: float, top: int) -> str:
    files: Dict[str, float] = collections.Counter()
    for test_id, t in per_test.items():
        files[test_id.split("::")[0]] += t["cpu"]
    charged = sum(t["cpu"] for t in per_test.values())
    lines = [f"wall {wall_s:.0f} s; the machine's CPU {machine_cpu_s:.0f} s; charged to {len(per_test)} tests "
             f"{charged:.0f} s (the rest: pytest's start-up and collection, processes outside any test, missed "
             "short ones, other programs)", "", "CPU s  file"]
    lines += [f"{cpu:6.1f} {name}" for name, cpu in sorted(files.items(), key=lambda x: -x[1])[:top]]
    lines += ["", "CPU s  wall s  procs  test"]
    lines += [f"{t['cpu']:6.1f} {t['wall']:6.1f} {t['procs']:6d}  {test_id}"
              for test_id, t in sorted(per_test.items(), key=lambda x: -x[1]["cpu"])[:top]]
    lines += ["", "CPU s  the tests' processes, by kind"]
    lines += [f"{cpu:6.1f} {name}" for name, cpu in sorted(kinds.items(), key=lambda x: -x[1])[:top]]
    return "\n".join(lines)


def profiled_env(folder: str) -> dict:
    """The command's environment: every pytest process loads the plugin and logs into folder."""
    plugins = ",".join(p for p in (os.environ.get("PYTEST_PLUGINS"), "suite_cpu_plugin") if p)
    path = os.pathsep.join(p for p in (str(TOOLS), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTEST_PLUGINS=plugins, PYTHONPATH=path, SUITE_CPU_DIR=folder,
                SUITE_CPU_PLUGIN=str(TOOLS / "suite_cpu_plugin.py"))  # pip_user.py copies it beside its plugin


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="python tools/suite_cpu.py [--top N] [--json FILE] -- COMMAND ...")
    p.add_argument("--top", type=int, default=30, help="rows per table (default 30)")
    p.add_argument("--json", help="also write every test's figures to this file")
    cut = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:cut])  # --help ends here
    command = argv[cut + 1:]
    if not command:
        p.error("give the command to run after --, e.g. -- make test-unit")
    if not os.path.isdir("/proc/self"):
        p.error("it reads /proc: Linux only")
    with tempfile.TemporaryDirectory(prefix="suite_cpu_") as folder:
        machine0, t0 = system_cpu(), time.monotonic()
        with Sampler() as sampler:
            try:
                code = subprocess.run(command, env=profiled_env(folder)).returncode
            except FileNotFoundError:
                print(f"suite_cpu.py: {command[0]}: command not found", file=sys.stderr)
                return 127
        wall, machine = time.monotonic() - t0, system_cpu() - machine0
        per_test, kinds = attribute(sampler.procs, load_tests(folder))
    print(report(per_test, kinds, wall, machine, args.top))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"tests": per_test, "kinds": kinds, "wall_s": wall,
                                                       "machine_cpu_s": machine}, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
