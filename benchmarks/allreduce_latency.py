"""Time one gloo all-reduce between the ranks, by payload size: what a DDP step waits for on a CPU.

    python benchmarks/allreduce_latency.py [--iters 1500] [--world-size 2] [--markdown]

The ranks start as the training runs start them (ddp_helpers.launch: spawn, one thread per rank, each
rank's thread bound to its own core when the cores allow) and all-reduce float32 tensors of each size in a
tight loop, each call waited for, as DDP's reducer waits for its bucket. Sizes include 7,850 floats: the
whole gradient of the tutorial's Linear(784, 10), which DDP sends as one bucket. One all-gather of that
gradient is timed for comparison (it is not what DDP does). The figures are rank 0's; each size is warmed up
first, and the sizes are measured twice in turn so that drift of the machine shows.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Dict, List

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ddp_helpers import launch  # noqa: E402
from ddp_helpers.engine.model import build_model, n_params  # noqa: E402

MODEL_GRAD = n_params(build_model(0))  # the tutorial model's whole gradient (7,850 floats): DDP's one bucket
SIZES = tuple(sorted({1, 2, 4, 64, 1024, MODEL_GRAD, 32768}))  # float32 elements
WARMUP = 100


def _time_calls(fn, iters: int) -> List[float]:
    for _ in range(WARMUP):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure(rank: int, world_size: int, iters: int, rounds: int) -> Dict[str, List[List[float]]]:
    """Runs on every rank (module level, so spawn can import it): {label: [seconds per call, one list per round]}."""
    import torch
    import torch.distributed as dist

    group = dist.group.WORLD
    times: Dict[str, List[List[float]]] = {}
    grad = torch.randn(MODEL_GRAD)
    gathered = [torch.empty(MODEL_GRAD) for _ in range(world_size)]
    for _ in range(rounds):
        for n in SIZES:
            t = torch.randn(n)
            # group.allreduce is the collective DDP's hook runs (dist.all_reduce minus its argument checks)
            times.setdefault(f"all-reduce {n}", []).append(_time_calls(lambda t=t: group.allreduce([t]).wait(), iters))
        label = f"all-gather {MODEL_GRAD}"
        times.setdefault(label, []).append(
            _time_calls(lambda: group.allgather([gathered], [grad]).wait(), iters))
    return times


def summarize(samples: List[float]) -> Dict[str, float]:
    """Median, mean and 90th percentile in microseconds, and the share of calls over 2 ms."""
    us = sorted(s * 1e6 for s in samples)
    return {"median": statistics.median(us), "mean": statistics.fmean(us), "p90": us[int(0.9 * (len(us) - 1))],
            "slow": sum(u > 2000 for u in us) / len(us)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=1500, help="timed calls per size and round")
    p.add_argument("--rounds", type=int, default=2, help="passes over all sizes")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown (for the README)")
    args = p.parse_args()
    if args.iters < 1 or args.rounds < 1:
        p.error("--iters and --rounds must be at least 1")

    from bench_pipelines import machine, print_table  # the pipeline benchmark's machine line and tables

    print(f"machine: {machine()}")
    print(f"gloo, {args.world_size} ranks, {args.iters} timed calls per size and round, {args.rounds} rounds; "
          "rank 0's figures")
    per_rank = launch(measure, args.world_size, args=(args.iters, args.rounds), backend="gloo")
    rows = []
    for label, rounds in per_rank[0].items():
        stats = [summarize(r) for r in rounds]
        nbytes = int(label.split()[1]) * 4  # float32

        def span(key: str, fmt: str = "{:.0f}") -> str:
            vals = [fmt.format(s[key]) for s in stats]
            return vals[0] if len(set(vals)) == 1 else " / ".join(vals)

        rows.append((label, f"{nbytes:,}", span("median"), span("mean"), span("p90"),
                     " / ".join(f"{100 * s['slow']:.0f}%" for s in stats)))
    head = ("collective (float32 elements)", "bytes", "median us", "mean us", "p90 us", "calls > 2 ms")
    print_table(head, rows, args.markdown)
    if args.rounds > 1:
        print("(a / b: the value in each round)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
