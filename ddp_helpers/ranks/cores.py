"""Which cores the ranks run on: the usable cores, the container's CPU quota (cgroup v2 and v1), the budget they
leave, the core-binding plan, and binding a thread to its cores (or undoing an inherited binding)."""
from __future__ import annotations

import math
import os
from typing import List, Optional, Sequence

_ALL_CORES_ENV = "DDP_HELPERS_ALL_CORES"  # the cores the launcher could use, for processes a bound rank starts


def usable_cores() -> List[int]:
    """The cores this process may run on (its affinity mask, which cgroups and taskset can narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_quota(cgroup_file: str = "/proc/self/cgroup", fs_root: str = "/sys/fs/cgroup") -> Optional[float]:
    """CPUs' worth of time this process's cgroup may use (e.g. 2.0 under `docker --cpus=2`), None if unlimited.

    A quota doesn't narrow the affinity mask: a container or a JupyterHub/Binder pod limited to 2 CPUs
    still sees every core of the host, and sizing threads by the cores seen would oversubscribe it.
    Reads cgroup v2's cpu.max or v1's cpu.cfs_quota_us / cpu.cfs_period_us, on the process's cgroup and
    its parents (the tightest limit wins).
    """
    try:
        with open(cgroup_file) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        parts = line.split(":", 2)  # hierarchy id : controllers : path
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2: one unified tree
            limits += _walk_limits(fs_root, path, _read_cpu_max)
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's own tree
            mount = os.path.join(fs_root, controllers)
            limits += _walk_limits(mount if os.path.isdir(mount) else os.path.join(fs_root, "cpu"), path,
                                   _read_cfs_quota)
    return min(limits) if limits else None


def _walk_limits(mount: str, path: str, read) -> List[float]:
    # Inside a container the process's path may not exist under the mount (the mount is already its own cgroup):
    # then only the mount itself is read.
    here = os.path.join(mount, path.lstrip("/"))
    if not os.path.isdir(here):
        here = mount
    found = []
    while True:
        limit = read(here)
        if limit is not None:
            found.append(limit)
        if len(here) <= len(mount):
            return found
        here = os.path.dirname(here)


def _read_cpu_max(d: str) -> Optional[float]:
    try:
        with open(os.path.join(d, "cpu.max")) as f:
            quota, period = (f.read().split() + ["100000"])[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _read_cfs_quota(d: str) -> Optional[float]:
    try:
        with open(os.path.join(d, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(d, "cpu.cfs_period_us")) as f:
            period = int(f.read())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def cpu_budget() -> int:
    """Whole CPUs this process can keep busy: its usable cores, capped by its cgroup's CPU quota (at least 1)."""
    cores = len(usable_cores())
    quota = cpu_quota()
    return cores if quota is None else max(1, min(cores, math.floor(quota + 1e-9)))


def core_plan(world_size: int, threads: int, cores: Sequence[int]) -> Optional[List[List[int]]]:
    """Disjoint cores for each rank (rank r gets `threads` of them), or None when binding would not help.

    None when there is one rank (nothing to separate) or too few cores to give every rank its own.
    """
    if world_size < 2 or threads < 1 or world_size * threads > len(cores):
        return None
    return [list(cores[r * threads:(r + 1) * threads]) for r in range(world_size)]


def binding_plan(world_size: int, threads: int, backend: str,
                 bind_cores: Optional[bool]) -> Optional[List[List[int]]]:
    """The cores of each rank for these settings, None to leave the ranks unbound (the launcher's one rule).

    bind_cores=None binds gloo ranks when the cores suffice and no CPU quota narrows them, False never binds;
    True raises ValueError (saying why) when binding is impossible.
    """
    cores, budget = usable_cores(), cpu_budget()
    plan = core_plan(world_size, threads, cores[:budget]) if backend == "gloo" and bind_cores is not False else None
    if bind_cores and plan is None:
        # Name only the condition that fails: a list of every rule reads as if all of them were broken.
        if backend != "gloo":
            why = f"binding is for CPU ranks (gloo); backend {backend!r} runs each rank on its own GPU"
        elif world_size < 2:
            why = "binding separates ranks from each other, and there is only 1 rank"
        else:
            quota = f", {budget} of them allowed by the CPU quota" if budget < len(cores) else ""
            why = (f"{world_size} ranks x {threads} thread{'s' * (threads != 1)} need {world_size * threads} cores "
                   f"of their own, and there are {len(cores)} usable cores{quota}")
        raise ValueError(why)
    if bind_cores is None and budget < len(cores):
        # Under a quota the host shares its cores with others, and which ones are free is its business:
        # pinning the ranks to fixed cores could put them on busy ones. Bind only when asked to.
        return None
    return plan


def bind_this_thread(cores: Sequence[int]) -> bool:
    """Pin the calling thread (and the threads and processes it starts later) to these cores; False if refused."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    all_cores = ",".join(map(str, usable_cores()))
    try:
        os.sched_setaffinity(0, set(cores))  # pid 0 = the calling thread only on Linux
    except OSError:  # a sandbox that forbids it: binding is an optimization, so run unbound
        return False
    os.environ.setdefault(_ALL_CORES_ENV, all_cores)
    return True


def unbind_this_process() -> None:
    """Undo an inherited binding (a DataLoader worker forked by a bound rank may use every core again)."""
    saved = os.environ.get(_ALL_CORES_ENV)
    if saved and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in saved.split(",")})
