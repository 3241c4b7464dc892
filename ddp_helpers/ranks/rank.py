"""The one way into a rank: read torchrun's environment, join the group, bind, run the function, leave.

Ranks that torchrun starts (python -m ddp_helpers.train) and ranks that launch() starts both call run_rank;
they differ only in who started the process and how its result gets back (rank_entry: a report file).
"""
from __future__ import annotations

import datetime
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch
import torch.distributed as dist

from .env import RankEnv
from .procs import bind_this_thread, binding_plan, kill_descendants
from .report import error_report, value_report, write_report


def init_group_from_env(backend: str, timeout_s: float) -> None:
    """init_process_group from RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as under torchrun (env://)."""
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def run_rank(fn: Callable, args: tuple, backend: str, timeout_s: float, threads: int,
             bind_cores: Optional[bool] = None, init_group: bool = True) -> Any:
    """fn(rank, world_size, *args) in this process, inside the job's process group unless init_group=False."""
    env = RankEnv.from_environ()
    torch.set_num_threads(threads)  # ranks share the cores: without this each would use them all
    if not init_group:
        return fn(env.rank, env.world_size, *args)
    init_group_from_env(backend, timeout_s)
    try:
        plan = binding_plan(env.local_world_size, threads, backend, bind_cores)
        if plan is not None:
            # Only now, after gloo has started its communication threads, so they stay free to run on any core.
            # The training thread keeps its own core: a rank waits on its peer in every all-reduce, and on a
            # small VM the scheduler otherwise moves the waking thread around (a 31 KB gloo all-reduce took
            # 2.0 ms on average unbound, 0.9 ms bound, on the 2-core VM of the benchmark).
            bind_this_thread(plan[env.local_rank])
        return fn(env.rank, env.world_size, *args)
    finally:
        dist.destroy_process_group()


@dataclass(frozen=True)
class RankSpec:
    """What launch() tells every rank besides its function."""

    env: Dict[str, str]  # torchrun's variables, but RANK and LOCAL_RANK (set per rank)
    log_dir: str
    backend: str
    timeout_s: float
    threads: int
    bind_cores: Optional[bool]
    init_group: bool


def _quiet_child(log_path: str) -> None:
    """Send this process's stdout/stderr (Python and C++ alike) to a log file: children never print in cells."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)


def rank_entry(rank: int, spec: RankSpec, payload: Any) -> None:
    """What each launched child runs (after boot.rank_main): the rank, then its report, then exit."""
    _quiet_child(os.path.join(spec.log_dir, f"rank{rank}.log"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends us cleanly
    os.environ.update(spec.env, RANK=str(rank), LOCAL_RANK=str(rank))
    code = 0
    try:
        fn, fn_args = payload.get()
        out = run_rank(fn, fn_args, spec.backend, spec.timeout_s, spec.threads, spec.bind_cores, spec.init_group)
        write_report(spec.log_dir, rank, value_report(out))
    except BaseException as e:  # noqa: BLE001 - report everything, including SystemExit, to the parent
        write_report(spec.log_dir, rank, error_report(e))
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    kill_descendants()  # nothing this rank started outlives it (a subprocess, a worker that lost its way)
    # Skip interpreter teardown: the result is already reported, torch's teardown takes ~1 s, and a broken
    # process group can hang in destructors.
    os._exit(code)
