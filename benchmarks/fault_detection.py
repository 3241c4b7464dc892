"""Inject each fault into a real 2-rank run and print the time to detect it and the processes left afterwards.

    python benchmarks/fault_detection.py

Faults: a rank raises; a rank SIGKILLs itself; a rank is SIGKILLed from outside; a rank hangs (collective
timeout 3 s); KeyboardInterrupt in the parent. 'detect' = from the fault to run_training raising;
'orphans' = live child processes 5 s later (must be 0).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

import psutil

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ddp_helpers import RankFailedError, TrainConfig, launch, run_training  # noqa: E402

BASE = TrainConfig(dataset="mnist-5k", threads_per_rank=1, max_steps=30)
FAULT_STEP = 10


def _children():
    return [p for p in psutil.Process().children(recursive=True)
            if "resource_tracker" not in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE]


def _orphans_after(seconds: float = 5.0) -> int:
    deadline = time.monotonic() + seconds
    while _children() and time.monotonic() < deadline:
        time.sleep(0.1)
    return len(_children())


def _fault_time(result_err: RankFailedError) -> float:
    """When the faulty step began on the failing rank (monotonic clock, shared by the processes)."""
    ranks = result_err.partial_result.ranks
    r = ranks[result_err.rank]
    return float(r.step_start_s[-1] + r.step_time_s[-1]) if len(r) else float("nan")


def injected(kind: str, start_method: str, timeout_s: float = 60.0):
    cfg = BASE.replace(fault_rank=1, fault_step=FAULT_STEP, fault_kind=kind, timeout_s=timeout_s)
    try:
        run_training(cfg, progress=False, start_method=start_method)
    except RankFailedError as e:
        detect = time.monotonic() - _fault_time(e)
        return detect, e.rank, e.message.split("\n")[0][:70], e.partial_result.n_steps
    raise AssertionError("no failure")


def external_kill(start_method: str):
    me, when = psutil.Process(), {}

    def killer():
        while True:
            kids = [p for p in me.children() if not any(s in " ".join(p.cmdline())
                                                          for s in ("resource_tracker", "forkserver"))]
            if len(kids) == 2:
                time.sleep(1.0)
                when["t"] = time.monotonic()
                os.kill(kids[1].pid, signal.SIGKILL)
                return
            time.sleep(0.02)

    threading.Thread(target=killer, daemon=True).start()
    try:
        run_training(BASE.replace(max_steps=None, epochs=1000), progress=False, start_method=start_method)
    except RankFailedError as e:
        return time.monotonic() - when["t"], e.rank, e.message[:70], e.partial_result.n_steps
    raise AssertionError("no failure")


def _spin(rank, world_size):
    import torch.distributed as dist

    while True:
        dist.barrier()


def interrupt():
    state = {}

    def poll():
        if "armed" not in state and len(_children()) >= 2:
            state["armed"] = time.monotonic()
        if "armed" in state and time.monotonic() - state["armed"] > 1.0:
            state["t"] = time.monotonic()
            raise KeyboardInterrupt

    try:
        launch(_spin, 2, start_method="fork", on_poll=poll)
    except KeyboardInterrupt:
        return time.monotonic() - state["t"], None, "KeyboardInterrupt re-raised, ranks stopped", 0
    raise AssertionError("no interrupt")


def main() -> int:
    cases = [
        ("rank raises (spawn)", lambda: injected("raise", "spawn")),
        ("rank raises (fork)", lambda: injected("raise", "fork")),
        ("rank SIGKILLs itself", lambda: injected("kill", "fork")),
        ("rank SIGKILLed from outside", lambda: external_kill("fork")),
        ("rank hangs (timeout_s=3)", lambda: injected("hang", "fork", timeout_s=3)),
        ("KeyboardInterrupt in parent", interrupt),
    ]
    print("| fault | detected in s | rank named | error | steps kept | orphans after |")
    print("|---|---|---|---|---|---|")
    total_orphans = 0
    for name, fn in cases:
        detect, rank, msg, kept = fn()
        orphans = _orphans_after()
        total_orphans += orphans
        print(f"| {name} | {detect:.2f} | {rank if rank is not None else '-'} | {msg} | {kept} | {orphans} |",
              flush=True)
    print(f"\norphan processes after all faults: {total_orphans}")
    return 0 if total_orphans == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
