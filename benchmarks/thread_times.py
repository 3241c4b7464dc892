"""Where a rank's time goes during the training loop, thread by thread: CPU time, time-slices, run-queue wait.

    python benchmarks/thread_times.py                 # Fashion-MNIST, 2 ranks, 3 runs of the default
    python benchmarks/thread_times.py --runs 5 --markdown

Reads Linux's per-thread scheduler statistics (/proc/<pid>/task/<tid>/schedstat: time on a CPU, time waiting
in a run queue while runnable, number of time-slices) of each rank's threads when the ranks have done their
first step and again at the launcher's last poll before their last step (it polls every 50 ms), and prints
the difference per step and rank: the loop without its first and last few steps, and without evaluation.
The run-queue wait is the point: a gloo thread woken to move the all-reduce forward, but waiting for a core.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import defaultdict
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ddp_helpers import TrainConfig, load_data, run_training  # noqa: E402
from ddp_helpers.data import DataError  # noqa: E402
from bench_pipelines import print_table  # noqa: E402  (this folder is on sys.path: the script's own)

Snapshot = Dict[Tuple[int, int], Tuple[str, int, int, int]]  # (pid, tid) -> (kind, run ns, wait ns, slices)


def _children(parent: int) -> List[int]:
    """Processes whose parent is `parent` (the ranks started by the launcher)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent:
            pids.append(int(entry))
    return sorted(pids)


def _kind(pid: int, tid: int, name: str) -> str:
    if tid == pid:
        return "training thread"
    if name.startswith("gloo"):
        return f"gloo {name.removeprefix('gloo_')}"  # gloo's TCP event loop
    if name.startswith("pt_gloo"):
        return "gloo collective workers"  # PyTorch's ProcessGroupGloo worker threads
    return "other threads"


def snapshot(pids: List[int]) -> Snapshot:
    """Scheduler statistics of every thread of these processes."""
    snap: Snapshot = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for t in tids:
            tid = int(t)
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                    run, wait, slices = (int(x) for x in fh.read().split())
                with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                    name = fh.read().strip()
            except (OSError, ValueError):
                continue
            snap[(pid, tid)] = (_kind(pid, tid, name), run, wait, slices)
    return snap


def measure(cfg: TrainConfig) -> Tuple[float, int, Dict[str, Tuple[float, float, float]]]:
    """One run: (loop s, steps per rank, kind -> (run us, wait us, slices) per step and rank)."""
    me = os.getpid()
    state: dict = {}

    def on_progress(done: List[int], total: int) -> None:
        if min(done) >= total:
            return  # the ranks are past the loop (evaluating, exiting): keep the last in-loop snapshot
        if "first" not in state and min(done) >= 1:
            state["pids"] = _children(me)
            state["first"] = (snapshot(state["pids"]), min(done))
        elif "first" in state:
            state["latest"] = (snapshot(state["pids"]), min(done))

    r = run_training(cfg, progress=False, on_progress=on_progress, start_method="spawn")  # ranks: our children
    if "latest" not in state or state["latest"][1] <= state["first"][1]:
        raise RuntimeError("the loop ended before two polls could see it; use a larger data set")
    (first, n0), (last, n1) = state["first"], state["latest"]
    per_kind: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for key, (kind, run, wait, slices) in last.items():
        _, run0, wait0, slices0 = first.get(key, (kind, 0, 0, 0))
        acc = per_kind[kind]
        acc[0] += run - run0
        acc[1] += wait - wait0
        acc[2] += slices - slices0
    steps = (n1 - n0) * r.world_size  # rank-steps between the two snapshots (the ranks run in lockstep)
    out = {k: (v[0] / 1e3 / steps, v[1] / 1e3 / steps, v[2] / steps) for k, v in per_kind.items() if v[0] > 0}
    return r.loop_time_s, r.n_steps, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="fashion-mnist", help="fashion-mnist (60k) | mnist | mnist-5k")
    p.add_argument("--runs", type=int, default=3, help="runs of the default configuration (medians reported)")
    p.add_argument("--no-telemetry", action="store_true", help="measure the bare loop instead")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown (for the README)")
    args = p.parse_args()
    if args.runs < 1:
        print("error: --runs must be at least 1", file=sys.stderr)
        return 2
    if not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat"):
        print("error: this kernel has no per-thread scheduler statistics (/proc/<pid>/task/<tid>/schedstat); "
              "it needs Linux built with CONFIG_SCHED_INFO", file=sys.stderr)
        return 2
    cfg = TrainConfig(dataset=args.dataset, epochs=1, telemetry=not args.no_telemetry)
    try:
        load_data(cfg).train_normalized()  # loaded once here, as run_training would
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    loops, rows = [], defaultdict(list)
    for i in range(args.runs):
        loop, steps, kinds = measure(cfg)
        loops.append(loop)
        for k, v in kinds.items():
            rows[k].append(v)
        print(f"  run {i + 1}: loop {loop:.3f} s, {steps} steps/rank, {1e3 * loop / steps:.2f} ms a step", flush=True)
    med_step_us = 1e6 * statistics.median(loops) / steps
    head = ("thread (per rank)", "on a CPU us/step", "waiting for a CPU us/step", "time-slices/step")
    order = ["training thread", "gloo collective workers", "gloo tcp_loop", "other threads"]
    table = []
    for k in sorted(rows, key=lambda k: order.index(k) if k in order else len(order)):
        vs = rows[k]
        table.append((k, f"{statistics.median(v[0] for v in vs):.0f}", f"{statistics.median(v[1] for v in vs):.0f}",
                      f"{statistics.median(v[2] for v in vs):.1f}"))
    print_table(head, table, args.markdown)
    print(f"medians of {args.runs} runs; a step took {med_step_us:.0f} us (median loop / steps), "
          f"on {os.cpu_count()} cores shared by {cfg.world_size} ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
