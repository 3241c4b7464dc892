"""This machine's room for ranks: the usable cores, the container's CPU quota and the budget they leave, the
processes it may still start (RLIMIT_NPROC, the cgroup's pids.max) and those a launch ended still leaving; the
cgroup tree read by one walk (v2 and v1); the core-binding plan, and binding a thread to its cores (or undoing an
inherited binding). Probes only: ranks/checks.py refuses what they can't hold, judging one reading of them
(machine_room). Standard library only (psutil only where a process limit is set)."""
from __future__ import annotations

import math
import os
import pathlib
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

try:
    import resource
except ImportError:  # Windows: no RLIMIT_NPROC
    resource = None  # type: ignore[assignment]

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
    limits = cgroup_limits("cpu", _read_cpu_max, _read_cfs_quota, cgroup_file, fs_root)
    return min(limits) if limits else None


def _text(path: str) -> str:
    """A small file's text, opened, read and closed in one call: a Ctrl-C on a `with open(...)` line, after the
    open and before the block, would leave the file open (held by the notebook's last traceback)."""
    return pathlib.Path(path).read_text()


def cgroup_limits(controller: str, read_v2: Callable[[str], Any], read_v1: Callable[[str], Any],
                  cgroup_file: str = "/proc/self/cgroup", fs_root: str = "/sys/fs/cgroup") -> List[Any]:
    """What read_v2 (cgroup v2's tree) or read_v1 (v1's `controller` tree) finds, not None, in the folder of this
    process's cgroup and each parent: the one walk of the cgroup tree (for the CPU quota and the pids room)."""
    try:
        lines = _text(cgroup_file).splitlines()
    except OSError:
        return []
    found: List[Any] = []
    for line in lines:
        parts = line.split(":", 2)  # hierarchy id : controllers : path
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2: one unified tree
            found += _walk_limits(fs_root, path, read_v2)
        elif controller in controllers.split(","):  # cgroup v1: the controller's own tree
            mount = os.path.join(fs_root, controllers)
            found += _walk_limits(mount if os.path.isdir(mount) else os.path.join(fs_root, controller), path, read_v1)
    return found


def _walk_limits(mount: str, path: str, read: Callable[[str], Any]) -> List[Any]:
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
        quota, period = (_text(os.path.join(d, "cpu.max")).split() + ["100000"])[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _read_cfs_quota(d: str) -> Optional[float]:
    try:
        quota = int(_text(os.path.join(d, "cpu.cfs_quota_us")))
        period = int(_text(os.path.join(d, "cpu.cfs_period_us")))
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- the processes this machine may still start
def _read_pids_room(folder: str) -> Optional[Tuple[int, str]]:
    """(tasks a pids cgroup folder may still start, what says so), None where pids.max is absent or "max"."""
    limit, used = _read_int(os.path.join(folder, "pids.max")), _read_int(os.path.join(folder, "pids.current"))
    if limit is None:
        return None
    return limit - (used or 0), os.path.join(folder, "pids.max") + f"={limit}, {used or 0} in use"


def _read_int(path: str) -> Optional[int]:
    try:
        text = _text(path).strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def cgroup_pids_room(cgroup_file: str = "/proc/self/cgroup",
                     fs_root: str = "/sys/fs/cgroup") -> Optional[Tuple[int, str]]:
    """(tasks this cgroup may still start, which file says so) for the tightest pids.max on the process's
    cgroup and its parents (cgroup v2, or v1's pids controller), None when none is set."""
    rooms = cgroup_limits("pids", _read_pids_room, _read_pids_room, cgroup_file, fs_root)
    return min(rooms, key=lambda room: room[0]) if rooms else None


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
        return pathlib.Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].decode().split()
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


def cpu_budget() -> int:
    """Whole CPUs this process can keep busy: its usable cores, capped by its cgroup's CPU quota (at least 1)."""
    return _budget(len(usable_cores()), cpu_quota())


def _budget(n_cores: int, quota: Optional[float]) -> int:
    return n_cores if quota is None else max(1, min(n_cores, math.floor(quota + 1e-9)))


@dataclass(frozen=True)
class MachineRoom:
    """This machine's facts a launch is checked against, read once: the usable cores, the whole CPUs they and the
    CPU quota allow, and the room each process limit leaves (none read where the ranks already run)."""

    cores: Tuple[int, ...]  # the affinity mask
    budget: int  # cpu_budget(): the cores capped by the quota
    rooms: Tuple[Tuple[int, str], ...]  # room_limits(): (tasks still allowed, its name and figures)


def machine_room(process_room: bool = True) -> MachineRoom:
    """The usable cores, the CPU budget and (process_room) every process limit's room: one read of each, one walk
    of the cgroup tree for each controller."""
    cores = usable_cores()
    return MachineRoom(tuple(cores), _budget(len(cores), cpu_quota()), tuple(room_limits()) if process_room else ())


def default_threads(world_size: int, budget: Optional[int] = None) -> int:
    """Torch threads per CPU rank so that the ranks together don't oversubscribe the cores (or the CPU quota);
    budget: cpu_budget() if read already (a MachineRoom's)."""
    return max(1, (cpu_budget() if budget is None else budget) // world_size)


def core_plan(world_size: int, threads: int, cores: Sequence[int]) -> Optional[List[List[int]]]:
    """Disjoint cores for each rank (rank r gets `threads` of them), or None when binding would not help.

    None when there is one rank (nothing to separate) or too few cores to give every rank its own.
    """
    if world_size < 2 or threads < 1 or world_size * threads > len(cores):
        return None
    return [list(cores[r * threads:(r + 1) * threads]) for r in range(world_size)]


def binding_plan(world_size: int, threads: int, backend: str, bind_cores: Optional[bool],
                 machine: Optional[MachineRoom] = None) -> Optional[List[List[int]]]:
    """The cores of each rank for these settings, None to leave the ranks unbound (the launcher's one rule).

    bind_cores=None binds gloo ranks when the cores suffice and no CPU quota narrows them, False never binds;
    True raises ValueError (saying why) when binding is impossible. machine: the facts if read already.
    """
    cores, budget = (list(machine.cores), machine.budget) if machine is not None else (usable_cores(), cpu_budget())
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
