"""How many ranks, and threads each, this machine can run: checked before any process starts.

A launch of 10**6 ranks once filled the machine's process table (every user's fork failed for minutes). The
limits: a stated maximum, the usable cores (ranks may share a core, up to MAX_RANKS_PER_CORE of them), and the
processes this user and this cgroup may still start (RLIMIT_NPROC, the cgroup's pids.max). Standard library only
(psutil only where a process limit is set): the command line checks a run before torch is imported.
"""
from __future__ import annotations

import os
from typing import List, Optional, Tuple

try:
    import resource
except ImportError:  # Windows: no RLIMIT_NPROC
    resource = None  # type: ignore[assignment]

from ..common.errors import ConfigError, setting

MAX_WORLD_SIZE = 128  # ranks one launch starts on one machine, at most (a tutorial's runs use 1 to 8)
MAX_RANKS_PER_CORE = 8  # oversubscription allowed, bounded: the lessons run 4 ranks on 2 cores, a 1-core VM 4 on 1
TASKS_PER_RANK = 8  # threads a CPU rank holds besides its torch threads (gloo's, torch's pools, Python's), with
#                    room to spare (docs/benchmarks.md counts them); the process limits count threads


def usable_core_count() -> int:
    """The cores this process may run on (its affinity mask)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def cgroup_pids_room(cgroup_file: str = "/proc/self/cgroup",
                     fs_root: str = "/sys/fs/cgroup") -> Optional[Tuple[int, str]]:
    """(tasks this cgroup may still start, which file says so) for the tightest pids.max on the process's
    cgroup and its parents (cgroup v2, or v1's pids controller), None when none is set."""
    try:
        with open(cgroup_file) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best: Optional[Tuple[int, str]] = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3 or not (parts[1] == "" or "pids" in parts[1].split(",")):
            continue
        mount = fs_root if parts[1] == "" else os.path.join(fs_root, "pids")
        here = os.path.join(mount, parts[2].lstrip("/"))
        here = here if os.path.isdir(here) else mount  # inside a container the mount is its own cgroup
        while True:
            limit, used = _read_int(os.path.join(here, "pids.max")), _read_int(os.path.join(here, "pids.current"))
            if limit is not None and (best is None or limit - (used or 0) < best[0]):
                best = (limit - (used or 0), os.path.join(here, "pids.max") + f"={limit}, {used or 0} in use")
            if len(here) <= len(mount):
                break
            here = os.path.dirname(here)
    return best


def nproc_room() -> Optional[Tuple[int, str]]:
    """(tasks this user may still start, what says so) under RLIMIT_NPROC, None when unlimited or not enforced."""
    if resource is None:  # Windows: no such limit
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft == resource.RLIM_INFINITY or os.geteuid() == 0:  # root is exempt (CAP_SYS_RESOURCE)
        return None
    return soft - _user_tasks(), f"RLIMIT_NPROC={soft} (ulimit -u), {_user_tasks()} of this user's in use"


def _user_tasks() -> int:
    """Threads of every process of this user (what RLIMIT_NPROC counts)."""
    import psutil

    uid, total = os.getuid(), 0
    for p in psutil.process_iter(["uids", "num_threads"]):
        uids, threads = p.info["uids"], p.info["num_threads"]
        if uids is not None and uids.real == uid:
            total += threads or 1
    return total


def room_limits() -> List[Tuple[int, str]]:
    """Every process limit that applies here: (tasks still allowed, its name and figures)."""
    return [r for r in (cgroup_pids_room(), nproc_room()) if r is not None]


def check_world_size(world_size: int, threads: Optional[int], owner: str = "TrainConfig",
                     rooms: Optional[List[Tuple[int, str]]] = None) -> None:
    """Refuse more ranks, or threads per rank, than this machine can run; the settings are named as their owner
    spells them (TrainConfig.world_size=10, launch(world_size=10))."""
    cores = usable_core_count()
    most = min(MAX_WORLD_SIZE, MAX_RANKS_PER_CORE * cores)
    if world_size > most:
        why = (f"the stated maximum MAX_WORLD_SIZE={MAX_WORLD_SIZE}" if most == MAX_WORLD_SIZE else
               f"{MAX_RANKS_PER_CORE} ranks per usable core (MAX_RANKS_PER_CORE) x {cores} cores")
        raise ConfigError(f"{setting('world_size', world_size, owner=owner)} is not accepted: at most {most} ranks "
                          f"on this machine ({why}, ddp_helpers/ranks/limits.py); use {setting('world_size')}<={most}")
    if threads is not None and threads > cores:
        raise ConfigError(f"{setting('threads_per_rank', threads, owner=owner)} is not accepted: at most {cores}, "
                          "the usable cores (more threads than cores only wait for each other); use None (automatic: "
                          "cores // ranks) or fewer")
    need = world_size * ((threads or 1) + TASKS_PER_RANK)
    short = [(room, what) for room, what in (room_limits() if rooms is None else rooms) if need > room]
    if short and rooms is None and wait_for_leaving():  # what our last launches ended has left: look again
        short = [(room, what) for room, what in room_limits() if need > room]
    for room, what in short:
        left = leaving()
        still = (f"; {len(left)} of those in use are processes a launch in this process ended that have exited but "
                 "not yet been collected by their parent (pid 1 in some containers takes seconds): run again in a "
                 "moment" if left else "")
        raise ConfigError(f"{setting('world_size', world_size, owner=owner)} is not accepted: {world_size} ranks "
                          f"need about {need} processes and threads, and only {max(room, 0)} more may start here "
                          f"({what}{still}); use fewer ranks or {setting('threads_per_rank')}, or raise the limit")


# ---------------------------------------------------------------- what this process's launches ended, leaving
LEAVING_WAIT_S = 5.0  # the next launch waits this long at most for them: each exit ends the wait as it comes
_ENDED_GROUPS: "dict[int, None]" = {}  # the process groups of the ranks this process's launches ended (newest last)
_ENDED_KEPT = 256


def note_ended(groups: List[int]) -> None:
    """A launch ended ranks leading these process groups (ranks/ending.py): what is still in them is leaving."""
    for group in groups:
        _ENDED_GROUPS.pop(group, None)
        _ENDED_GROUPS[group] = None
    while len(_ENDED_GROUPS) > _ENDED_KEPT:
        del _ENDED_GROUPS[next(iter(_ENDED_GROUPS))]


def leaving() -> List[int]:
    """The pids, in the groups of ranks this process ended, of processes that are exiting or exited (Linux's
    /proc/<pid>/stat: state Z or X, or the PF_EXITING flag): a pids cgroup and RLIMIT_NPROC count them until
    their parent collects them. Killed children of a torch rank take a while to exit (their memory is torn down)."""
    if not _ENDED_GROUPS or not os.path.isdir("/proc/self"):
        return []
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _stat_fields(name)
            if fields and int(fields[2]) in _ENDED_GROUPS and (fields[0] in "ZXx" or int(fields[6]) & 0x4):
                found.append(int(name))
    return found


def _stat_fields(pid: str) -> List[str]:
    """/proc/<pid>/stat's fields after the command's name (state, ppid, pgrp, ..., flags at [6])."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].decode().split()
    except (OSError, IndexError):
        return []


def wait_for_leaving(timeout_s: Optional[float] = None) -> bool:
    """Wait until every leaving process (leaving()) has exited, each exit an event (a pidfd, Linux >= 5.3);
    True if there were any (the room is worth reading again), False if none or no way to wait for them."""
    import select
    import time

    pids = leaving()
    if not pids or not hasattr(os, "pidfd_open"):
        return bool(pids)
    deadline = time.monotonic() + (LEAVING_WAIT_S if timeout_s is None else timeout_s)
    fds = []
    try:
        for pid in pids:
            try:
                fds.append(os.pidfd_open(pid))
            except OSError:  # gone already
                pass
        poller = select.poll()  # not select(): no limit on the fds' numbers
        for fd in fds:
            poller.register(fd, select.POLLIN)
        while fds and time.monotonic() < deadline:
            for fd, _ in poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
                poller.unregister(fd)
                fds.remove(fd)
                os.close(fd)
    finally:
        for fd in fds:
            os.close(fd)
    return True
