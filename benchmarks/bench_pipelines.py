"""Benchmark: Listing 7.2's data pipeline vs the package's default (with and without telemetry), one epoch, 2 ranks.

    python benchmarks/bench_pipelines.py                 # Fashion-MNIST 60,000 images (offline via Debian)
    python benchmarks/bench_pipelines.py --repeats 5 --markdown

Core binding (TrainConfig.bind_cores) is on by default where the cores suffice; the table also shows the
default without it, and the seed pipeline both ways (compared at its faster).
Prints wall time (launch to the last rank's end), start-up (launch to the slowest rank's first step),
training-loop time, steps/s, telemetry overhead and peak memory. The default configurations run --repeats times
and each seed variant --seed-repeats times spread over the session, all interleaved; medians are reported
(a 2-core VM is noisy). This is a script, not a timed test.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import threading
import time
from typing import Sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ddp_helpers import TrainConfig, run_training  # noqa: E402
from ddp_helpers.data import DataError  # noqa: E402

CONFIGS = {
    # The listing binds nothing; it is also measured with the launcher's binding, and the faster of the two
    # is what the default is compared with.
    "seed pipeline (Listing 7.2)": dict(pipeline="seed", bind_cores=False),
    "seed pipeline, cores bound": dict(pipeline="seed"),
    "default, full telemetry": dict(pipeline="default", telemetry=True),
    "default, bare loop": dict(pipeline="default", telemetry=False),
    "default, full telemetry, no binding": dict(pipeline="default", telemetry=True, bind_cores=False),
}
SEEDS = [name for name, o in CONFIGS.items() if o["pipeline"] == "seed"]


def machine() -> str:
    """One line describing where the figures come from."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, {gpu}; Python {platform.python_version()}, "
            f"torch {torch.__version__}")


def _memory_used_mb(fd: int) -> float:
    """System-wide memory in use (MemTotal - MemAvailable), MB, read from an open /proc/meminfo; NaN if unreadable."""
    # pread on a file kept open, and only the two fields parsed: opening the file and parsing all its lines in
    # Python slowed the default's training loop measurably at 100 samples a second (docs/benchmarks.md), and the
    # sampler must not perturb what it measures.
    try:
        b = os.pread(fd, 8192, 0)
        total = b.index(b"MemTotal:") + len(b"MemTotal:")
        avail = b.index(b"MemAvailable:") + len(b"MemAvailable:")
        return (int(b[total:b.index(b"kB", total)]) - int(b[avail:b.index(b"kB", avail)])) / 1024
    except (OSError, ValueError):
        return float("nan")


def _per_cpu_free_mb(fd: int) -> float:
    """Free pages held on the kernel's per-CPU lists (the `count:` of each pageset in an open /proc/zoneinfo), MB;
    0 if unreadable.

    MemFree and MemAvailable leave them out, and since Linux 6.7 the lists grow to hundreds of MB per CPU (1.4-1.7
    GB here on 2 CPUs): memory a process frees lands there, and the next allocation, served from them, leaves
    MemAvailable unchanged. Without this correction a 1 GiB allocation right after another one's release read as
    +6 to +425 MB.
    """
    try:
        b = os.pread(fd, 1 << 20, 0)
    except OSError:
        return 0.0
    pages, i = 0, b.find(b"count:")
    while i >= 0:
        end = b.find(b"\n", i)
        pages += int(b[i + 6:end])
        i = b.find(b"count:", end)
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class MemoryPeak:
    """Samples system-wide memory in use every 10 ms; .added_mb = the peak minus the level at entry.

    Unlike summed RSS, it counts a shared-memory page once, however many processes map it. In use = MemTotal -
    MemAvailable - the free pages on the per-CPU lists; those are read every 4th sample (/proc/zoneinfo costs
    ~30 us a read here against ~7 us for /proc/meminfo: see _memory_used_mb on why the sampler must stay cheap).
    """

    ZONES_EVERY = 4

    def __enter__(self) -> "MemoryPeak":
        self._fd, self._zones_fd = (_open_read_only(f) for f in ("/proc/meminfo", "/proc/zoneinfo"))
        self._per_cpu = _per_cpu_free_mb(self._zones_fd)
        self.base = self.peak = self.read()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def read(self, zones: bool = True) -> float:
        """Memory in use now, MB (NaN where /proc/meminfo can't be read); zones=False: the last per-CPU figure."""
        if zones:
            self._per_cpu = _per_cpu_free_mb(self._zones_fd)
        return _memory_used_mb(self._fd) - self._per_cpu

    def _sample(self) -> None:
        n = 0
        while not self._stop.wait(0.01):
            n += 1
            self.peak = max(self.peak, self.read(zones=n % self.ZONES_EVERY == 0))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for fd in (self._fd, self._zones_fd):
            if fd >= 0:
                os.close(fd)
        self.added_mb = self.peak - self.base


def _open_read_only(path: str) -> int:
    """A read-only descriptor of path; -1 if it can't be opened."""
    try:
        return os.open(path, os.O_RDONLY)
    except OSError:
        return -1  # not Linux: readings are NaN (meminfo) or uncorrected (zoneinfo)


def print_table(head: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> None:
    """Print rows under head: as a Markdown table (for docs/benchmarks.md) or as aligned columns."""
    if markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
        for row in (head, *rows):
            print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="fashion-mnist", help="fashion-mnist (60k) | mnist | mnist-5k")
    p.add_argument("--data-root", default=None, help="where the data set is (default: TrainConfig's data_root)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="runs per configuration (median reported)")
    p.add_argument("--seed-repeats", type=int, default=2,
                   help="runs of each slow seed-pipeline variant, spread evenly over the repeats")
    p.add_argument("--backend", default="auto")
    p.add_argument("--start-method", default="spawn", choices=("spawn", "auto", "forkserver", "fork"),
                   help="how every configuration starts its ranks: spawn, as the listing's mp.spawn and the earlier "
                        "tables (benchmarks/startup.py compares the start methods)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown (for the README)")
    args = p.parse_args()

    base = TrainConfig(dataset=args.dataset, world_size=args.world_size, backend=args.backend, epochs=1)
    if args.data_root:
        base = base.replace(data_root=args.data_root)
    try:
        from ddp_helpers import load_data

        data = load_data(base)
        n = len(data.train_labels)
        normalized = data.train_normalized()  # as run_training does for the default: held here from now on
        data_mb = sum(t.numel() * t.element_size() for t in (data.train_images, data.train_labels, data.test_images,
                                                             data.test_labels, normalized)) / 2**20
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"machine: {machine()}")
    print(f"data: {args.dataset}, {n} training images, {args.world_size} ranks, 1 epoch, batch 64 per rank")
    from ddp_helpers.ranks.cores import binding_plan
    from ddp_helpers.ranks.checks import default_threads, resolve_backend

    # The launcher's own rule (bind_cores=None), so the line says what the default runs really do.
    plan = binding_plan(args.world_size, default_threads(args.world_size),
                        resolve_backend(args.backend, args.world_size), None)
    print("core binding: " + ("none possible" if plan is None else
                              ", ".join(f"rank {r} -> cores {c}" for r, c in enumerate(plan))))
    runs = {name: [] for name in CONFIGS}
    n_reps = max(args.repeats, args.seed_repeats)
    # The VM's speed drifts by tens of percent over minutes: spread the few seed runs over the whole session
    # (first and last repeat for 2) so that they and the default runs see the same conditions.
    seed_reps = {round(i * (n_reps - 1) / max(args.seed_repeats - 1, 1)) for i in range(args.seed_repeats)}
    for rep in range(n_reps):
        for name, overrides in CONFIGS.items():
            if rep not in (seed_reps if name in SEEDS else range(args.repeats)):
                continue
            t0 = time.monotonic()
            with MemoryPeak() as used:
                r = run_training(base.replace(**overrides), progress=False, start_method=args.start_method)
            call = time.monotonic() - t0
            step_ms = 1e3 * statistics.median(float(t) for rank in r.ranks for t in rank.step_time_s)
            # The slow tail: time spent above the median step (ranks run in lockstep, so rank 0 speaks for all).
            tail = sum(max(0.0, float(t) - step_ms / 1e3) for t in r.ranks[0].step_time_s)
            runs[name].append(dict(wall=r.wall_time_s, call=call, startup=r.startup_s, loop=r.loop_time_s,
                                   steps=r.n_steps, step_ms=step_ms, mem=sum(r.peak_rss_mb) + r.parent_rss_mb,
                                   rank_mem=max(r.peak_rss_mb), added=used.added_mb, acc=r.test_accuracy, tail=tail,
                                   gpu_mem=max((m for m in r.peak_cuda_mb if math.isfinite(m)), default=float("nan"))))
            print(f"  run {rep + 1}: {name:28s} wall {r.wall_time_s:6.2f} s  start-up {r.startup_s:5.2f} s  "
                  f"loop {r.loop_time_s:6.3f} s  ({r.n_steps} steps/rank)", flush=True)

    med = {name: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for name, rs in runs.items()}
    tel, bare, unbound = (med[k] for k in CONFIGS if k not in SEEDS)
    seed = min((med[k] for k in SEEDS), key=lambda m: m["loop"])  # the listing at its best
    on_gpu = any(math.isfinite(m["gpu_mem"]) for m in med.values())  # nccl ranks report their GPU's peak
    rows = []
    for name, m in med.items():
        rows.append((name, f"{m['wall']:.2f}", f"{m['startup']:.2f}", f"{m['loop']:.3f}", f"{m['steps']:.0f}",
                     f"{m['steps'] / m['loop']:.0f}", f"{m['step_ms']:.2f}", f"{m['mem']:.0f} ({m['rank_mem']:.0f})",
                     f"{m['added']:.0f}",
                     f"{m['acc']:.4f}") + ((f"{m['gpu_mem']:.0f}",) if on_gpu else ()))
    head = ("configuration", "wall s", "start-up s", "loop s", "steps/rank", "steps/s", "median step ms",
            "peak RSS MB all (max rank)", "memory added MB", "test acc")
    head += ("peak GPU MB (max rank)",) if on_gpu else ()
    print_table(head, rows, args.markdown)
    overhead = (tel["loop"] - bare["loop"]) / bare["loop"]
    print()
    print(f"default end to end vs seed:   {seed['wall'] / tel['wall']:.1f}x faster   (target >= 4x)")
    print(f"default loop vs seed loop:    {seed['loop'] / tel['loop']:.1f}x faster   (target >= 20x)")
    print(f"  without core binding:       {seed['loop'] / unbound['loop']:.1f}x (the seed at its best either way)")
    print(f"  the slow tail:              {100 * tel['tail'] / tel['loop']:.0f}% of the default's loop is time above "
          f"its median step; without it {seed['loop'] / (tel['loop'] - tel['tail']):.1f}x")
    print(f"telemetry overhead:           {100 * overhead:+.1f}% of the bare loop   (target <= 15%)")
    step_overhead = (tel["step_ms"] - bare["step_ms"]) / bare["step_ms"]
    print(f"  per-step view:              {100 * step_overhead:+.1f}% (median step time with vs without telemetry)")
    print("memory added = peak of the system's memory in use during the run minus before it (shared pages counted "
          f"once); the default's data stay loaded in this process between runs ({data_mb:.0f} MB decoded + normalized)")
    print(f"medians of {args.repeats} runs (seed pipeline: {args.seed_repeats} per variant); "
          "wall = launch to the last rank's end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
