"""The checks before a launch, each rule in one place: launch()'s arguments by name, the ranks and threads this
machine can run (cores, RLIMIT_NPROC, the cgroup's pids.max), the start method, the backend and its GPUs, the core
binding, the rendezvous address; LaunchPlan.checked builds the one plan launch() and run_training run.

A value that would fail only inside the ranks, fail raw, or be silently taken for something else is refused here,
before any process starts, with a one-line error naming the setting and the fix. Standard library only at import
(torch only when asked about GPUs or fork): the command line checks a run's size before torch is imported.
"""
from __future__ import annotations

import inspect
import math
import multiprocessing
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Tuple

from ..common.errors import ConfigError, SaysSettings, refused, render, setting
from ..common.torch_state import half_imported, import_torch
from . import cores
from .cores import binding_plan, default_threads  # noqa: F401 - default_threads: the plan's threads
from .env import GpuLayout, visible_gpus
from .startmethod import START_METHODS, resolve_start_method

LAUNCH_BACKENDS = ("gloo", "nccl", "auto")
MAX_POLL_S = 60.0  # between two looks at the ranks (on_poll's period), at most
MAX_WORLD_SIZE = 128  # ranks one launch starts on one machine, at most (a tutorial's runs use 1 to 8)
MAX_RANKS_PER_CORE = 8  # oversubscription allowed, bounded: the lessons run 4 ranks on 2 cores, a 1-core VM 4 on 1
TASKS_PER_RANK = 8  # threads a CPU rank holds besides its torch threads (gloo's, torch's pools, Python's), with
#                    room to spare (docs/benchmarks.md counts them); the process limits count threads
WILDCARDS = ("0.0.0.0", "::", "")  # "every interface": a store there is reachable from the whole network
# Two windows of the failure path, in seconds (ranks/launcher.py). Each is ended early by its event (a zombie
# server, the other ranks' exit), so a higher value costs nothing when all goes well; the environment variable
# overrides the default, read at each use (a test under load sets it high so that only the event ends the wait).
SERVER_EXIT_S = 2.0  # DDP_HELPERS_SERVER_EXIT_S: a killed forkserver has this long to be seen dead (zombie or gone)
SETTLE_S = 0.3  # DDP_HELPERS_SETTLE_S: after a failure, this long for the other ranks to publish their last step


class LaunchError(SaysSettings, RuntimeError):
    """The ranks could not be started as asked (raised before any process starts)."""

    def __init__(self, message: object = "", *rest: object):
        self.marked = str(message)
        super().__init__(render(self.marked), *rest)


def window_s(name: str) -> float:
    """SERVER_EXIT_S or SETTLE_S: DDP_HELPERS_<name> from the environment if set, else the module's value."""
    text = os.environ.get(f"DDP_HELPERS_{name}")
    if text is None:
        return globals()[name]
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"DDP_HELPERS_{name}={text!r} is not a positive number of seconds; "
                          f"unset it for the default ({globals()[name]})")
    return value


# ---------------------------------------------------------------- launch()'s own arguments, by name
def _refuse(name: str, value: Any, accepted: str) -> ConfigError:
    return refused(name, value, accepted, owner="launch()")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_fn(fn: Any, args: Any) -> None:
    """fn must be callable as fn(rank, world_size, *args) (checked on its signature where it has one)."""
    if not isinstance(args, (tuple, list)):
        raise _refuse("args", args, "a tuple of the extra arguments fn receives after rank and world_size, e.g. "
                                    "args=(data,) (one argument) or args=() (none)")
    if not callable(fn):
        raise _refuse("fn", fn, "a function called as fn(rank, world_size, *args) on every rank")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function without one: the ranks will say
        return
    try:
        signature.bind(0, 1, *args)
    except TypeError as e:
        name = getattr(fn, "__qualname__", type(fn).__name__)
        raise ConfigError(f"launch(fn={name}) is not accepted: each rank calls fn(rank, world_size, *args), "
                          f"{2 + len(args)} positional arguments, and {name}{signature} can't take them ({e}); "
                          "give fn the parameters (rank, world_size, ...) or change args") from None


def check_flags(**flags: Any) -> None:
    """Each of these is True or False (None too where named with a trailing '_': bind_cores_)."""
    for name, value in flags.items():
        optional = name.endswith("_")
        if not (isinstance(value, bool) or (optional and value is None)):
            name = name.rstrip("_")
            raise _refuse(name, value, ("None (automatic), " if optional else "") + "True or False")


def check_numbers(world_size: Any, threads_per_rank: Any, timeout_s: Any, poll_s: Any, on_poll: Any) -> None:
    """world_size an int >= 1, threads_per_rank None or an int >= 1, the timeout and the polling period finite."""
    if not _is_int(world_size) or world_size < 1:
        raise _refuse("world_size", world_size, "an int >= 1")
    if threads_per_rank is not None and (not _is_int(threads_per_rank) or threads_per_rank < 1):
        raise _refuse("threads_per_rank", threads_per_rank, "None (automatic: usable cores // ranks) or an int >= 1")
    ok = isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and math.isfinite(timeout_s)
    if not ok or not 1 <= timeout_s <= 86400:
        raise _refuse("timeout_s", timeout_s, "seconds, a number from 1 to 86400 (e.g. 60): how long a collective "
                                              "waits for a peer before it fails")
    ok = isinstance(poll_s, (int, float)) and not isinstance(poll_s, bool) and math.isfinite(poll_s)
    if not ok or not 0 < poll_s <= MAX_POLL_S:
        raise _refuse("poll_s", poll_s, f"seconds between looks at the ranks, a number with 0 < poll_s <= "
                                        f"{MAX_POLL_S:g} (e.g. 0.05)")
    if on_poll is not None and not callable(on_poll):
        raise _refuse("on_poll", on_poll, "None, or a function with no arguments called between looks")


def check_port_and_backend(host: Any, port: Any, backend: Any) -> None:
    """The types and ranges before the machine's checks (which bind the port)."""
    if not isinstance(host, str):
        raise _refuse("host", host, "an address string such as '127.0.0.1'")
    if not _is_int(port) or not 0 <= port <= 65535:
        raise _refuse("port", port, "0 (a free port) or a port number from 1 to 65535")
    if backend not in LAUNCH_BACKENDS:
        raise _refuse("backend", backend, f"one of {LAUNCH_BACKENDS} (gloo: CPU ranks; nccl: one GPU per rank)")


def check_run_dir(run_dir: Any) -> None:
    """None (a new private folder), or an existing folder of this user (ranks/folders.new_run_dir())."""
    if run_dir is None:
        return
    if not isinstance(run_dir, (str, os.PathLike)) or not os.path.isdir(run_dir):
        raise _refuse("run_dir", run_dir, "None (a new private folder, removed at the end) or an existing "
                                          "folder, as ddp_helpers.ranks.folders.new_run_dir() makes")
    from ..common.trusted import fix_for, path_problem

    problem = path_problem(os.fspath(run_dir))
    if problem:  # another user could swap it, or a folder on its way, for theirs: reports are unpickled from it
        raise _refuse("run_dir", run_dir, f"a folder no other user can change ({problem}); {fix_for(problem)}")


# ---------------------------------------------------------------- how many ranks, and threads each, fit here
def check_world_size(world_size: int, threads: Optional[int], machine: cores.MachineRoom,
                     owner: str = "TrainConfig") -> None:
    """Refuse more ranks, or threads per rank, than this machine (its facts, read once) can run; the settings are
    named as their owner spells them (TrainConfig.world_size=10, launch(world_size=10))."""
    n_cores = len(machine.cores)
    most = min(MAX_WORLD_SIZE, MAX_RANKS_PER_CORE * n_cores)
    if world_size > most:
        why = (f"the stated maximum MAX_WORLD_SIZE={MAX_WORLD_SIZE}" if most == MAX_WORLD_SIZE else
               f"{MAX_RANKS_PER_CORE} ranks per usable core (MAX_RANKS_PER_CORE) x {n_cores} cores")
        raise ConfigError(f"{setting('world_size', world_size, owner=owner)} is not accepted: at most {most} ranks "
                          f"on this machine ({why}, ddp_helpers/ranks/checks.py); use {setting('world_size')}<={most}")
    if threads is not None and threads > n_cores:
        raise ConfigError(f"{setting('threads_per_rank', threads, owner=owner)} is not accepted: at most {n_cores}, "
                          "the usable cores (more threads than cores only wait for each other); use None (automatic: "
                          "cores // ranks) or fewer")
    need = world_size * ((threads or 1) + TASKS_PER_RANK)
    if any(need > room for room, _ in machine.rooms):
        _refuse_room(world_size, need, machine.rooms, owner)


def _refuse_room(world_size: int, need: int, rooms: Tuple[Tuple[int, str], ...], owner: str) -> None:
    """The process limits' verdict, read again once what our last launches ended has left."""
    short = [(room, what) for room, what in rooms if need > room]
    if cores.wait_for_leaving():  # what our last launches ended has left: look again
        short = [(room, what) for room, what in cores.room_limits() if need > room]
    for room, what in short:
        left = cores.leaving()
        still = (f"; {len(left)} of those in use are processes a launch in this process ended that have exited but "
                 "not yet been collected by their parent (pid 1 in some containers takes seconds): run again in a "
                 "moment" if left else "")
        raise ConfigError(f"{setting('world_size', world_size, owner=owner)} is not accepted: {world_size} ranks "
                          f"need about {need} processes and threads, and only {max(room, 0)} more may start here "
                          f"({what}{still}); use fewer ranks or {setting('threads_per_rank')}, or raise the limit")


# ---------------------------------------------------------------- where the ranks run: start method, GPUs, cores, address
def check_start_method(start_method: str) -> str:
    """Refuse a start method that can't work in this process; returns the one to use ('auto' resolved)."""
    if not isinstance(start_method, str) or start_method not in START_METHODS:
        raise refused("start_method", start_method, f"one of {START_METHODS}", owner="launch()")
    if half_imported():  # fork's ranks would be copies of this torch, and the checks below (CUDA, GPUs) import it:
        import_torch()  # one left half imported by an interrupt is named here, with the fix (a kernel restart)
    method = resolve_start_method(start_method)
    if method not in multiprocessing.get_all_start_methods():
        raise LaunchError(f"{setting('start_method', start_method)} is not available on {sys.platform}; use "
                          f"{setting('start_method', 'auto')} (forkserver where available, else spawn)")
    if method == "fork" and _cuda_initialized():
        raise LaunchError(f"{setting('start_method', 'fork')} refused: CUDA is already initialized in this "
                          f"process and a forked child can't use it. Use {setting('start_method', 'auto')} (the "
                          "default), which starts the ranks from a clean server process")
    if method != "fork":
        _check_main_module(method)
    return method


def _cuda_initialized() -> bool:
    import torch  # a forked rank is a copy of this process, so it holds torch anyway

    return torch.cuda.is_initialized()


def _check_main_module(method: str) -> None:
    # spawn and forkserver start each rank by re-importing the main program: refuse one with no file to import.
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return  # python -m package.module: re-imported by name
    path = getattr(main, "__file__", None)  # None in Jupyter, the REPL and python -c: nothing is re-imported
    if path is not None and not os.path.isfile(path):
        raise LaunchError(f"{setting('start_method', method)} can't start ranks from a program read from {path}: "
                          "each rank re-imports the main program from its file. Save the code to a file and run that")


def resolve_backend(backend: str, world_size: int, owner: str = "TrainConfig",
                    layout: Optional[GpuLayout] = None) -> str:
    """'auto' -> nccl when every rank gets a GPU of its own (env.GpuLayout: the rule each rank follows), else
    gloo; 'nccl' refused where some rank would have none. layout: a rank's own (under torchrun or srun), else the
    world_size ranks this process starts, which all see its GPUs."""
    if backend == "gloo":
        return backend  # nothing to ask torch: a launcher without torch imported stays so
    # visible_gpus imports torch: importable, check_start_method named a half-imported one

    launched = layout is None
    layout = layout or GpuLayout(visible_gpus(), world_size)
    if backend == "auto":
        return "nccl" if layout.fits else "gloo"
    if backend == "nccl" and not layout.fits:
        if launched and layout.visible:  # the ranks start here: fewer of them is the fix
            raise ConfigError(
                f"{setting('world_size', world_size, owner=owner)} is not accepted with "
                f"{setting('backend', 'nccl')}: only {layout.visible} GPU(s) are visible and nccl needs one GPU per "
                f"rank (two ranks on one GPU are refused); use {setting('world_size')}<={layout.visible}, or "
                f"{setting('backend', 'gloo')}")
        raise layout.refusal(owner)
    return backend


def check_binding(world_size: int, threads: int, backend: str, bind_cores: Optional[bool],
                  owner: str = "TrainConfig", machine: Optional[cores.MachineRoom] = None) -> None:
    """Refuse bind_cores=True where the ranks can't each have cores of their own (the plan says why)."""
    try:
        binding_plan(world_size, threads, backend, bind_cores, machine)  # each rank makes the same plan for itself
    except ValueError as e:
        error = refused("bind_cores", bind_cores, f"None (bind when possible) or False here: {e}", owner)
        if owner != "launch()":
            raise error from None
        raise LaunchError(f"{error.marked}. Use {setting('bind_cores', None)} to bind only when possible, or fewer "
                          f"ranks or {setting('threads_per_rank')}") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on host right now (another program may still take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_address(host: str, port: int, owner: str = "TrainConfig",
                  names: Tuple[str, str] = ("master_addr", "master_port")) -> None:
    """Refuse a host that doesn't resolve, is a wildcard or isn't this machine's (the launch serves the store
    there itself), or an explicit port already in use; named as the caller spells them (owner, names)."""
    host_name, port_name = names
    if host in WILDCARDS:
        raise refused(host_name, host, "an address of this machine that the ranks reach, such as '127.0.0.1' (a "
                      "wildcard address would listen on every interface, open to the network)", owner)
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET)
    except (socket.gaierror, UnicodeError) as e:
        raise refused(host_name, host, f"a resolvable host such as '127.0.0.1' ({e})", owner) from None
    addr = infos[0][4][0]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, 0))
        except OSError as e:
            raise refused(host_name, host, f"an address of this machine ({addr} is not: {e.strerror}); the launch "
                          "serves the rendezvous itself, so it listens here: use '127.0.0.1' for one machine (several "
                          "machines start with torchrun)", owner) from None
    if port == 0:
        return
    fix = setting(port_name, 0, owner=owner if owner.endswith("()") else "")  # master_port=0 or launch(port=0)
    if port < 1024 and hasattr(os, "geteuid") and os.geteuid() != 0:
        raise refused(port_name, port, f"a port >= 1024 (lower ones need root), or {fix} for a free one", owner)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, port))
        except OSError as e:
            raise refused(port_name, port, f"a free port; {host}:{port} can't be bound ({e.strerror}). Use {fix} "
                          "to let the OS choose one (see notebook 13, "
                          "#2-the-server-socket-has-failed-to-listen-address-already-in-use)", owner) from None


# ---------------------------------------------------------------- the plan: every check above, made once
@dataclass(frozen=True)
class RankSizes:
    """How many ranks this machine runs, and torch threads each: checked against its cores and process limits."""

    world_size: int  # on this machine
    threads: int  # per rank, resolved (None asked: the usable cores, or the CPU quota, // ranks)
    owner: str  # who names the settings in an error: "TrainConfig" or "launch()"
    machine: cores.MachineRoom = field(repr=False, compare=False)  # the facts they were checked against

    @classmethod
    def checked(cls, world_size: int, threads_per_rank: Optional[int], owner: str = "launch()",
                room: bool = True) -> "RankSizes":
        """The sizes, refused (check_world_size) where this machine can't run them; room=False: the ranks run
        already (under torchrun), so the room left for processes no longer has to hold them."""
        machine = cores.machine_room(process_room=room)  # the machine's facts, read once for every check below
        threads = threads_per_rank or default_threads(world_size, machine.budget)
        check_world_size(world_size, threads_per_rank, machine, owner)
        return cls(world_size, threads, owner, machine)

    def place(self, backend: str, bind_cores: Optional[bool], init_group: bool = True,
              layout: Optional[GpuLayout] = None) -> str:
        """The backend resolved for these ranks (their GPUs counted; layout: a running rank's, see resolve_backend)
        and their core binding checked; the backend."""
        backend = resolve_backend(backend, self.world_size, self.owner, layout)
        if init_group:
            check_binding(self.world_size, self.threads, backend, bind_cores, self.owner, self.machine)
        return backend


@dataclass(frozen=True)
class LaunchPlan:
    """What one launch runs, its arguments checked and resolved (as torch's LaunchConfig is for elastic_launch);
    built by LaunchPlan.checked, for launch() (launch_plan) and run_training alike."""

    method: str  # the start method, resolved: "forkserver", "spawn" or "fork"
    world_size: int
    backend: str  # resolved: "gloo" or "nccl"
    host: str
    port: int  # 0: a free one
    timeout_s: float
    threads: int  # per rank
    bind_cores: Optional[bool]
    init_group: bool
    run_dir: Optional[str]  # None: the launch makes one (and removes it)
    on_poll: Optional[Callable[[], None]]
    poll_s: float
    watch_shared: bool = True
    quiet: bool = False

    @property
    def mark(self) -> str:
        """The launch's mark, in every rank's environment: its run folder's name."""
        return os.path.basename(str(self.run_dir).rstrip(os.sep))

    @classmethod
    def checked(cls, sizes: RankSizes, backend: str, start_method: str = "auto", host: str = "127.0.0.1",
                port: int = 0, timeout_s: float = 60.0, bind_cores: Optional[bool] = None, init_group: bool = True,
                names: Tuple[str, str] = ("host", "port"), **rest: Any) -> "LaunchPlan":
        """The plan for ranks of these sizes, refused before any process starts where this machine can't run it:
        the start method (and this process's torch), the address, then the backend and the binding on the machine's
        facts sizes was checked against (sizes.place); rest: run_dir, on_poll, poll_s, watch_shared, quiet, taken as
        given (run_training makes them, launch_plan checks launch()'s)."""
        method = check_start_method(start_method)  # torch is imported only where the launch needs it (fork, GPUs)
        check_address(host, port, owner=sizes.owner, names=names)
        for name in ("SERVER_EXIT_S", "SETTLE_S"):
            window_s(name)  # a bad DDP_HELPERS_ override is said now, not in the middle of a failure
        backend = sizes.place(backend, bind_cores, init_group)
        rest = {"run_dir": None, "on_poll": None, "poll_s": 0.05, **rest}
        return cls(method, sizes.world_size, backend, host, port, timeout_s, sizes.threads, bind_cores, init_group,
                   **rest)


def launch_plan(fn: Callable, world_size: Any, args: Any, backend: Any, start_method: Any, host: Any, port: Any,
                timeout_s: Any, threads_per_rank: Any, on_poll: Any, poll_s: Any, bind_cores: Any, init_group: Any,
                run_dir: Any, watch_shared: Any, quiet: Any) -> LaunchPlan:
    """Every argument of launch(), checked by name before any process starts; the plan it runs."""
    check_numbers(world_size, threads_per_rank, timeout_s, poll_s, on_poll)
    sizes = RankSizes.checked(world_size, threads_per_rank, owner="launch()")
    check_fn(fn, args)
    check_port_and_backend(host, port, backend)
    check_flags(init_group=init_group, watch_shared=watch_shared, bind_cores_=bind_cores, quiet=quiet)
    check_run_dir(run_dir)
    return LaunchPlan.checked(sizes, backend, start_method, host, port, timeout_s, bind_cores, init_group,
                              run_dir=run_dir, on_poll=on_poll, poll_s=poll_s, watch_shared=watch_shared, quiet=quiet)
