"""The cost of one launch from a warm process: launch(fn, N) of a function that only returns its rank.

    python benchmarks/launch_overhead.py [--calls 15] [--markdown]

What every exercise check and every notebook cell that launches pays on top of its own work: forking N ranks
from the forkserver, their rendezvous and process group, the report back, the teardown. Run it alternated with
another checkout (PYTHONPATH=<checkout>) to compare two versions of the launcher on the same VM.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time


def _rank(rank: int, world_size: int) -> int:
    return rank


def _times(world_size: int, calls: int) -> list:
    from ddp_helpers import launch

    launch(_rank, world_size)  # not counted: the first launch at this size
    out = []
    for _ in range(calls):
        t0 = time.monotonic()
        assert launch(_rank, world_size) == list(range(world_size))
        out.append(time.monotonic() - t0)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=15, help="timed launches per world size")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = p.parse_args()
    if args.calls < 1:
        p.error("--calls must be at least 1")
    import ddp_helpers

    ddp_helpers.warm_up()
    bar = "|" if args.markdown else " "
    print(f"{bar} ranks {bar} median s {bar} min s {bar} calls {bar}")
    if args.markdown:
        print("|---|---|---|---|")
    for world_size in (2, 3):
        t = _times(world_size, args.calls)
        print(f"{bar} {world_size} {bar} {statistics.median(t):.3f} {bar} {min(t):.3f} {bar} {len(t)} {bar}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
