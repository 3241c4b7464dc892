"""Follow one `run_training(cfg)` call through the package as a maintainer reading it would, and count the stops.

    python tools/follow_calls.py [--depth N] [--path]

A warm call (a first one starts the forkserver) is traced in this process with `sys.setprofile`, its `cfg` made
before the trace as the call's name says (`--with-config` traces `TrainConfig(...)` too): every function of
`ddp_helpers` the launching process enters, each counted the first time only, in the order the call reaches it.
A *room* is a module; a *stop* is each move into a room while following that order (several functions read in a
row in one module are one stop); a *return* is a stop in a room already left. `--depth N` keeps the functions at
most N calls below `run_training` (a reader who follows N levels deep); `--path` prints the stops.
Issue 60 asks for at most 30 stops with at most 10 returns.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable


def trace(call: Callable[[], object], package_dir: str) -> list[tuple[str, str, int]]:
    """(module path, function, depth below `call`) of every package function `call` enters in this thread."""
    events: list[tuple[str, str, int]] = []
    depth = 0
    prefix = package_dir.rstrip(os.sep) + os.sep

    def profile(frame, event, arg):  # noqa: ARG001 -- sys.setprofile's signature
        nonlocal depth
        code = frame.f_code
        if not code.co_filename.startswith(prefix):
            return
        if event == "call":
            events.append((code.co_filename[len(prefix):], code.co_qualname, depth))
            depth += 1
        elif event == "return":
            depth -= 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return events


def stops(events: list[tuple[str, str, int]], max_depth: int) -> list[tuple[str, list[str]]]:
    """The rooms visited in order, each with the functions first read there (each function counted once)."""
    seen: set[tuple[str, str]] = set()
    path: list[tuple[str, list[str]]] = []
    for module, name, depth in events:
        if depth > max_depth or (module, name) in seen:
            continue
        seen.add((module, name))
        if not path or path[-1][0] != module:
            path.append((module, []))
        path[-1][1].append(name)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depth", type=int, default=10**6, help="follow at most this many calls deep (default: all)")
    p.add_argument("--path", action="store_true", help="print every stop with the functions read there")
    p.add_argument("--with-config", action="store_true", help="trace the TrainConfig(...) that makes cfg too")
    args = p.parse_args()
    import ddp_helpers
    from ddp_helpers import TrainConfig, run_training

    cfg = TrainConfig(dataset="mnist-5k")

    def one_call():
        return run_training(TrainConfig(dataset="mnist-5k") if args.with_config else cfg, progress=False)

    one_call()  # the first call starts the forkserver: follow a warm one, the path every later call takes
    path = stops(trace(one_call, os.path.dirname(ddp_helpers.__file__)), args.depth)
    rooms = {module for module, _ in path}
    if args.path:
        for module, names in path:
            print(f"{module:32} {', '.join(names)}")
    functions = sum(len(names) for _, names in path)
    print(f"{len(path)} stops in {len(rooms)} rooms, {len(path) - len(rooms)} returns to a room already left "
          f"({functions} functions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
