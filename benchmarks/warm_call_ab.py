"""The warm call of two (or more) versions of the package, alternated: each round runs every tree once, in a
fresh interpreter, with one cold run_training call and then N warm ones, and prints the medians of each phase.

    git worktree add /tmp/old <commit>
    python benchmarks/warm_call_ab.py /tmp/old . [--rounds 6] [--calls 8]

Phases, from TrainResult's own clocks (the same fields in older versions): start-up, the loop, after the loop
(wall_time_s - start-up - loop: the ranks' evaluation and exit, the launch's end) and the rest of the call.
Alternating cancels the machine's drift (other work beside); the load average is printed with each run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

PROGRAM = """\
import json, sys, time
from ddp_helpers import TrainConfig, run_training
def main(n):
    run_training(TrainConfig(dataset="mnist-5k"), progress=False)  # cold: the forkserver starts
    for _ in range(n):
        t0 = time.monotonic()
        r = run_training(TrainConfig(dataset="mnist-5k"), progress=False)
        call = time.monotonic() - t0
        print(json.dumps({"call": call, "startup": r.startup_s, "loop": r.loop_time_s,
                          "after": r.wall_time_s - r.startup_s - r.loop_time_s, "other": call - r.wall_time_s}))
if __name__ == "__main__":
    main(int(sys.argv[1]))
"""
PHASES = ("call", "startup", "loop", "after", "other")


def _run(tree: str, calls: int) -> dict:
    """One fresh interpreter on `tree`'s package: the medians of its warm calls, in seconds."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), "DDP_HELPERS_PROGRESS": "0"}
    out = subprocess.run([sys.executable, "-c", PROGRAM, str(calls)], env=env,
                         capture_output=True, text=True, cwd=os.path.abspath(tree))
    if out.returncode != 0:
        raise RuntimeError(f"{tree}: exit {out.returncode}\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {k: statistics.median(r[k] for r in rows) for k in PHASES}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trees", nargs="+", help="repository checkouts (worktrees) to compare, the first the baseline")
    p.add_argument("--rounds", type=int, default=6, help="rounds; each runs every tree once (default 6)")
    p.add_argument("--calls", type=int, default=8, help="warm calls per run, after one cold (default 8)")
    args = p.parse_args()
    if len(args.trees) < 2 or args.rounds < 1 or args.calls < 1:
        p.error("give two trees or more, --rounds >= 1 and --calls >= 1")
    got = {t: [] for t in args.trees}
    for rnd in range(1, args.rounds + 1):
        for tree in args.trees:
            load = " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"
            got[tree].append(_run(tree, args.calls))
            print(f"round {rnd} {tree} (load {load}): " + ", ".join(f"{k} {got[tree][-1][k] * 1e3:.0f} ms"
                                                                   for k in PHASES), flush=True)
    base = got[args.trees[0]]
    for tree in args.trees:
        meds = {k: statistics.median(r[k] for r in got[tree]) for k in PHASES}
        ratio = "/".join(f"{r['after'] / b['after']:.2f}" for r, b in zip(got[tree], base))
        print(f"{tree}: medians of {args.rounds} rounds: " + ", ".join(f"{k} {meds[k] * 1e3:.0f} ms" for k in PHASES)
              + f"; after the loop against {args.trees[0]}, round by round: {ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
