"""Start-up of a run from one long-lived Python process (a notebook kernel): the default start method against
spawn, a first call with and without warm_up(), a notebook set-up cell calling warm_up() before or after its
imports, and exercise checks after the first. Each call's phases: start-up, the loop, after the loop (the ranks'
evaluation and exit, the launch's end) and the rest of the call (checks, data, result, clean-up).

    python benchmarks/startup.py [--calls 4] [--markdown]

Targets (docs/benchmarks.md): median start-up of calls 2..N <= 0.15 s and the whole call <= 0.3 s with the
default; start-up >= 10x faster than spawn's, in the same run; an exercise check after the first <= 1 s.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the repository's package and teacher/, whatever the working directory


def _calls(start_method: str, n: int) -> list:
    from ddp_helpers import TrainConfig, run_training

    out = []
    for _ in range(n):
        t0 = time.monotonic()
        r = run_training(TrainConfig(dataset="mnist-5k"), progress=False, start_method=start_method)
        call = time.monotonic() - t0
        # wall_time_s runs from the launch to the moment launch() returned: start-up, the loop, then what follows
        # the loop (the ranks' evaluation and exit, the launch's end). The rest of the call is this process's own
        # work around the launch (checks, the data, the plan, the result, the run folder's removal).
        out.append({"call": call, "startup": r.startup_s, "loop": r.loop_time_s,
                    "after": r.wall_time_s - r.startup_s - r.loop_time_s, "other": call - r.wall_time_s})
    return out


def _checks(n: int) -> list:
    from ddp_helpers.exercises import check_global_mean
    from teacher.solutions import SOLUTIONS

    out = []
    for _ in range(n):
        t0 = time.monotonic()
        assert check_global_mean(SOLUTIONS["global_mean"], quiet=True).passed
        out.append(time.monotonic() - t0)
    return out


def _first_call(warm: bool, reading_s: float) -> dict:
    """In a fresh interpreter: (warm_up(), a pause as a reader would take), then one timed call."""
    code = ("import json, time, sys; sys.path[:0] = [%r, %r]\n"
            "import ddp_helpers\n"
            "if %r:\n    ddp_helpers.warm_up(); time.sleep(%r)\n"
            "from startup import _calls\n"
            "print(json.dumps(_calls('auto', 1)[0]))\n") % (ROOT, os.path.join(ROOT, "benchmarks"), warm, reading_s)
    env = {**os.environ, "DDP_HELPERS_PROGRESS": "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


SETUP_CELL = """\
import json, operator, sys, time
t0 = time.monotonic()
sys.path.insert(0, {root!r})
import ddp_helpers
if {early!r}:
    ddp_helpers.warm_up()  # the notebooks' set-up cell: first, so the server imports torch beside this process
import matplotlib.pyplot
import torch
from ddp_helpers import launch
if not {early!r}:
    ddp_helpers.warm_up()
launch(operator.add, 2)  # a notebook's first launch
print(json.dumps(time.monotonic() - t0))
"""


def _setup_cell(early: bool) -> float:
    """In a fresh interpreter: a set-up cell's imports and warm_up(), then a first launch; seconds to its end."""
    env = {**os.environ, "DDP_HELPERS_PROGRESS": "0"}
    code = SETUP_CELL.format(root=ROOT, early=early)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"the set-up cell failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=4, help="run_training calls per start method (the first is cold)")
    p.add_argument("--checks", type=int, default=3, help="exercise checks (check_global_mean on its solution)")
    p.add_argument("--reading-s", type=float, default=6.0, help="pause between warm_up() and the first call")
    p.add_argument("--setup-rounds", type=int, default=5, help="set-up cells timed per placement of warm_up()")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = p.parse_args()
    if args.calls < 2 or args.checks < 2:
        p.error("--calls and --checks must be at least 2 (the first is the cold one)")
    if args.setup_rounds < 1:
        p.error("--setup-rounds must be at least 1")
    os.environ.setdefault("DDP_HELPERS_PROGRESS", "0")
    auto, spawn = _calls("auto", args.calls), _calls("spawn", args.calls)
    checks = _checks(args.checks)
    cold, warmed = _first_call(False, 0.0), _first_call(True, args.reading_s)
    setup = {True: [], False: []}
    for _ in range(args.setup_rounds):  # alternated: the VM's speed drifts
        for early in (True, False):
            setup[early].append(_setup_cell(early))
    rows = [("default (auto), call 1", auto[0]), *((f"default (auto), call {i + 1}", c) for i, c in enumerate(auto[1:], 1)),
            *((f"spawn, call {i + 1}", c) for i, c in enumerate(spawn)),
            ("default, first call in a fresh process", cold),
            (f"default, first call {args.reading_s:.0f} s after warm_up()", warmed)]
    bar = "|" if args.markdown else " "
    print(f"{bar} run {bar} start-up s {bar} whole call s {bar} loop s {bar} after the loop s {bar} other s {bar}")
    if args.markdown:
        print("|---|---|---|---|---|---|")
    for name, c in rows:
        print(f"{bar} {name} {bar} {c['startup']:.3f} {bar} {c['call']:.3f} {bar} {c['loop']:.3f} {bar} "
              f"{c['after']:.3f} {bar} {c['other']:.3f} {bar}")
    med_start = statistics.median(c["startup"] for c in auto[1:])
    med_call = statistics.median(c["call"] for c in auto[1:])
    spawn_start = statistics.median(c["startup"] for c in spawn[1:])
    later_checks = statistics.median(checks[1:])
    print(f"exercise check: first {checks[0]:.2f} s, later (median) {later_checks:.2f} s  (target <= 1 s)")
    print(f"default start-up, calls 2..{args.calls} (median): {med_start:.3f} s (target <= 0.15 s); whole call "
          f"{med_call:.3f} s (target <= 0.3 s)")
    phases = {k: statistics.median(c[k] for c in auto[1:]) for k in ("startup", "loop", "after", "other")}
    print(f"default calls 2..{args.calls}, phases (median): start-up {phases['startup']:.3f} s, loop "
          f"{phases['loop']:.3f} s, after the loop (evaluation, the ranks' exit, the launch's end) "
          f"{phases['after']:.3f} s, other (checks, data, result, clean-up) {phases['other']:.3f} s")
    print(f"start-up spawn / default: {spawn_start / med_start:.1f}x (target >= 10x)")
    print(f"set-up cell to the end of the first launch (median of {args.setup_rounds}): warm_up() before the imports "
          f"{statistics.median(setup[True]):.2f} s, after them {statistics.median(setup[False]):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
