"""launch()'s arguments, each checked by name before any process starts: a value that would fail only inside
the ranks, fail raw, or be silently taken for something else is refused here with a one-line error."""
from __future__ import annotations

import inspect
import math
import os
from typing import Any, Callable, Optional

from ..common.errors import ConfigError, refused
from .limits import check_world_size

LAUNCH_BACKENDS = ("gloo", "nccl", "auto")
MAX_POLL_S = 60.0  # between two looks at the ranks (on_poll's period), at most


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
    """Each of these is True or False (None too where named with a trailing '?': bind_cores?)."""
    for name, value in flags.items():
        optional = name.endswith("_")
        if not (isinstance(value, bool) or (optional and value is None)):
            name = name.rstrip("_")
            raise _refuse(name, value, ("None (automatic), " if optional else "") + "True or False")


def check_polling(poll_s: Any, on_poll: Any) -> None:
    """poll_s: a finite number of seconds, more than 0 and at most MAX_POLL_S; on_poll: None or a callable."""
    ok = isinstance(poll_s, (int, float)) and not isinstance(poll_s, bool) and math.isfinite(poll_s)
    if not ok or not 0 < poll_s <= MAX_POLL_S:
        raise _refuse("poll_s", poll_s, f"seconds between looks at the ranks, a number with 0 < poll_s <= "
                                        f"{MAX_POLL_S:g} (e.g. 0.05)")
    if on_poll is not None and not callable(on_poll):
        raise _refuse("on_poll", on_poll, "None, or a function with no arguments called between looks")


def check_port_and_backend(host: Any, port: Any, backend: Any) -> None:
    """The types and ranges before placement's checks of this machine (which bind the port)."""
    if not isinstance(host, str):
        raise _refuse("host", host, "an address string such as '127.0.0.1'")
    if not _is_int(port) or not 0 <= port <= 65535:
        raise _refuse("port", port, "0 (a free port) or a port number from 1 to 65535")
    if backend not in LAUNCH_BACKENDS:
        raise _refuse("backend", backend, f"one of {LAUNCH_BACKENDS} (gloo: CPU ranks; nccl: one GPU per rank)")


def check_run_dir(run_dir: Any) -> None:
    """None (a new private folder), or an existing folder of this user (ranks/cleanup.new_run_dir())."""
    if run_dir is None:
        return
    if not isinstance(run_dir, (str, os.PathLike)) or not os.path.isdir(run_dir):
        raise _refuse("run_dir", run_dir, "None (a new private folder, removed at the end) or an existing "
                                          "folder, as ddp_helpers.ranks.cleanup.new_run_dir() makes")
    from ..common.trusted import fix_for, path_problem

    problem = path_problem(os.fspath(run_dir))
    if problem:  # another user could swap it, or a folder on its way, for theirs: reports are unpickled from it
        raise _refuse("run_dir", run_dir, f"a folder no other user can change ({problem}); {fix_for(problem)}")


def check_sizes(world_size: Any, threads_per_rank: Any) -> None:
    """world_size an int >= 1, threads_per_rank None or an int >= 1, both within what this machine can run."""
    if not _is_int(world_size) or world_size < 1:
        raise _refuse("world_size", world_size, "an int >= 1")
    if threads_per_rank is not None and (not _is_int(threads_per_rank) or threads_per_rank < 1):
        raise _refuse("threads_per_rank", threads_per_rank, "None (automatic: usable cores // ranks) or an int >= 1")
    check_world_size(world_size, threads_per_rank, owner="launch()")


def check_launch_arguments(fn: Callable, world_size: int, args: Any, backend: Any, host: Any, port: Any,
                           threads_per_rank: Optional[int], on_poll: Any, poll_s: Any, bind_cores: Any,
                           init_group: Any, run_dir: Any, watch_shared: Any) -> None:
    """Every argument of launch() but the start method and timeout (checked beside), by name."""
    check_sizes(world_size, threads_per_rank)
    check_fn(fn, args)
    check_port_and_backend(host, port, backend)
    check_polling(poll_s, on_poll)
    check_flags(init_group=init_group, watch_shared=watch_shared, bind_cores_=bind_cores)
    check_run_dir(run_dir)
