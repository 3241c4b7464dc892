"""Process hygiene shared by launched ranks and their DataLoader workers: parent-death signal and core binding."""
from __future__ import annotations

import os
import signal
from typing import List, Optional, Sequence

_ALL_CORES_ENV = "DDP_HELPERS_ALL_CORES"  # the cores the launcher could use, for processes a bound rank starts


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so no worker outlives a crashed launcher."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the launcher's own cleanup still applies
        pass


def usable_cores() -> List[int]:
    """The cores this process may run on (its affinity mask, which cgroups and taskset can narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


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

    bind_cores=None binds gloo ranks when the cores suffice, False never binds; True raises ValueError
    (saying why) when binding is impossible.
    """
    plan = core_plan(world_size, threads, usable_cores()) if backend == "gloo" and bind_cores is not False else None
    if bind_cores and plan is None:
        raise ValueError(f"binding needs the gloo backend (not {backend!r}), 2 or more ranks, and a core of its "
                         f"own for each of the {world_size} x {threads} rank threads "
                         f"({len(usable_cores())} usable cores)")
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
