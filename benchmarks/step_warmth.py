"""How much slower one training step runs when the core did something else just before it (a "cold" step).

    python benchmarks/step_warmth.py                  # gaps of 0, 0.3, 1, 3 and 10 ms, sleeping and busy
    python benchmarks/step_warmth.py --steps 400 --markdown

One process, bound to one core, one thread: the listing's model (Flatten -> Linear(784, 10)), SGD, batch 64,
no DDP and no other process of ours. Before each step the core either sleeps or busy-waits for a gap; the step
(zero_grad, forward, loss, backward, optimizer.step) is then timed, and so is a small pure-Python loop run
right after it as a control with a tiny memory footprint. Rounds go over the gaps in turn, so that the VM's
drift spreads over all of them. In a 2-rank DDP loop every step follows a wait for the all-reduce: this shows
what such a wait costs the next step, apart from the wait itself.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from ddp_helpers.engine.model import build_model  # noqa: E402
from bench_pipelines import print_table  # noqa: E402  (this folder is on sys.path: the script's own)

PHASES = ("zero_grad", "forward + loss", "backward", "optimizer.step")


def _sleep(seconds: float) -> None:
    if seconds > 0:
        time.sleep(seconds)


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


GAP_KINDS: Dict[str, Callable[[float], None]] = {"sleep": _sleep, "busy-wait": _busy}


def _tiny() -> int:
    """The control: ~3,000 additions in Python, a few KB of code and data."""
    s = 0
    for i in range(3000):
        s += i
    return s


def measure(gaps_ms: List[float], steps: int, rounds: int, warmup: int = 10
            ) -> Dict[Tuple[str, float], Dict[str, List[float]]]:
    """(gap kind, gap ms) -> lists of us per step: 'gap', 'step', each phase, 'control'."""
    model = build_model(0)  # seeds torch, so the batch below is the same in every run
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    out: Dict[Tuple[str, float], Dict[str, List[float]]] = {
        (k, g): {n: [] for n in ("gap", "step", "control", *PHASES)} for k in GAP_KINDS for g in gaps_ms}
    gc.collect()
    gc.freeze()  # no garbage collection in the middle of a timed step
    ns = time.perf_counter_ns
    per_round = -(-steps // rounds)
    for _ in range(rounds):
        for gap in gaps_ms:
            for kind, wait in GAP_KINDS.items():
                rec = out[(kind, gap)]
                for i in range(warmup + per_round):
                    t0 = ns()
                    wait(gap / 1e3)
                    t1 = ns()
                    opt.zero_grad(set_to_none=True)
                    t2 = ns()
                    loss = F.cross_entropy(model(x), y)
                    t3 = ns()
                    loss.backward()
                    t4 = ns()
                    opt.step()
                    t5 = ns()
                    _tiny()
                    t6 = ns()
                    if i < warmup:  # the first steps after switching gaps carry the previous gap's state
                        continue
                    for name, a, b in (("gap", t0, t1), ("step", t1, t5), ("control", t5, t6),
                                       (PHASES[0], t1, t2), (PHASES[1], t2, t3), (PHASES[2], t3, t4),
                                       (PHASES[3], t4, t5)):
                        rec[name].append((b - a) / 1e3)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gaps", default="0,0.3,1,3,10", help="comma-separated gaps before each step, in ms")
    p.add_argument("--steps", type=int, default=300, help="timed steps per gap and kind (medians reported)")
    p.add_argument("--rounds", type=int, default=3, help="passes over all gaps, to spread the VM's drift")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown (for the README)")
    args = p.parse_args()
    try:
        gaps = [float(g) for g in args.gaps.split(",") if g.strip()]
    except ValueError:
        print(f"error: --gaps must be numbers in ms separated by commas, got {args.gaps!r}", file=sys.stderr)
        return 2
    if not gaps or any(not 0 <= g <= 1000 for g in gaps):
        print(f"error: --gaps must be between 0 and 1000 ms, got {args.gaps!r}", file=sys.stderr)
        return 2
    if args.steps < 1 or args.rounds < 1 or args.rounds > args.steps:
        print("error: --steps and --rounds must be at least 1, with --rounds at most --steps", file=sys.stderr)
        return 2
    if hasattr(os, "sched_setaffinity"):
        core = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {core})  # one core, as a bound rank runs
    torch.set_num_threads(1)  # one thread, as each rank runs
    res = measure(gaps, args.steps, args.rounds)
    base = {k: statistics.median(res[(k, gaps[0])]["step"]) for k in GAP_KINDS}
    base_ctl = {k: statistics.median(res[(k, gaps[0])]["control"]) for k in GAP_KINDS}
    head = ("gap before the step", "gap us", "step us", f"x gap {gaps[0]:g} ms", *(f"{n} us" for n in PHASES),
            "control us", f"control x gap {gaps[0]:g} ms")
    rows = []
    for kind in GAP_KINDS:
        for gap in gaps:
            r = {n: statistics.median(v) for n, v in res[(kind, gap)].items()}
            rows.append((f"{kind} {gap:g} ms", f"{r['gap']:.0f}", f"{r['step']:.0f}", f"{r['step'] / base[kind]:.2f}",
                         *(f"{r[n]:.0f}" for n in PHASES), f"{r['control']:.0f}",
                         f"{r['control'] / base_ctl[kind]:.2f}"))
    print_table(head, rows, args.markdown)
    per_gap = -(-args.steps // args.rounds) * args.rounds
    print(f"medians of {per_gap} steps per row, in {args.rounds} rounds over the gaps; one process on one core, "
          f"1 thread, batch 64; control = ~3,000 Python additions timed right after each step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
