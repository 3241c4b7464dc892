"""The one way into a rank: read torchrun's environment, join the group, bind, run the function, leave.

Ranks that torchrun starts (python -m ddp_helpers.train) and ranks that launch() starts both call run_rank;
they differ only in who started the process; both leave their outcome in the run folder (ranks/folders.py).
"""
from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .env import RankEnv, RankSpec, adopt_scheduler_env, gate_agent_store_flag, rank_env
from .folders import log_path
from .cores import bind_this_thread, binding_plan
from .ending import end_descendants
from .output_log import capture_output, output_to_pipe
from .reports import error_report, value_report, write_report


SETUP_GRACE_S = 5.0  # past timeout_s, before a rank stuck in set-up gives up on its own


def init_group_from_env(backend: str, timeout_s: float, env: RankEnv, store_path: Optional[str] = None) -> None:
    """init_process_group from RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as under torchrun (env://); with
    store_path, the ranks meet through a FileStore there instead (launch()'s private run folder: no socket
    listens, and only this user can open it; a TCP store on loopback is open to every user of the machine).

    gloo without GLOO_SOCKET_IFNAME listens on the address this machine's hostname resolves to, often 127.0.0.1
    (an /etc/hosts line), which peers on other machines can't reach: the interface that routes to MASTER_ADDR is
    chosen instead. The whole call is bounded: gloo's connection retries can outlast its timeout many times over.
    """
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = interface_towards(env.master_addr, env.master_port)
    timeout = datetime.timedelta(seconds=timeout_s)
    with _SetupDeadline(timeout_s + SETUP_GRACE_S, env, backend):
        store = dist.FileStore(store_path, env.world_size) if store_path else attempt_store(env, timeout)
        where = {} if store is None else {"store": store, "rank": env.rank, "world_size": env.world_size}
        dist.init_process_group(backend, timeout=timeout, **where)


def attempt_store(env: RankEnv, timeout: datetime.timedelta) -> Optional[dist.Store]:
    """After a torchrun restart, the agent's store seen through a prefix of this attempt's own; else None (env://).

    torchrun's agent hosts one store for the whole job and hands it to every restart attempt
    (``DynamicRendezvousHandler.use_agent_store``, unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), while env://
    connects the ranks to it with no per-attempt prefix (``rendezvous._create_c10d_store``: "We create a new
    TCPStore for every retry"). The restarted ranks then read the failed attempt's keys: gloo connected to a dead
    rank's address ("connectFullMesh failed ... Connection refused") and the job ended instead of resuming.
    """
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    agent = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
    return dist.PrefixStore(f"ddp_helpers/attempt{attempt}", agent)  # its keys: <prefix>/<key>


class _SetupDeadline:
    """End this process, saying what it waited for, if the block hasn't finished within limit_s."""

    def __init__(self, limit_s: float, env: RankEnv, backend: str):
        self.limit_s, self.env, self.backend = limit_s, env, backend
        self.done = threading.Event()

    def __enter__(self) -> "_SetupDeadline":
        threading.Thread(target=self._watch, name="ddp_helpers-setup-deadline", daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.done.set()

    def _watch(self) -> None:
        if self.done.wait(self.limit_s):
            return
        e = self.env
        where = f" on interface {os.environ['GLOO_SOCKET_IFNAME']} (GLOO_SOCKET_IFNAME)" if self.backend == "gloo" else ""
        print(f"rank {e.rank}: no process group after {self.limit_s:.0f} s. init_process_group waits for all "
              f"{e.world_size} ranks to reach the store at {e.master_addr}:{e.master_port}, then for each to connect "
              f"to every other{where}: a rank that failed to start, or peers that can't reach each other, leave "
              "the rest waiting here", file=sys.stderr, flush=True)
        os._exit(1)


def interface_towards(host: str, port: int) -> str:
    """The name of the network interface this machine uses to reach host (lo for a loopback host)."""
    import psutil

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port or 9))  # UDP: no packet is sent, the kernel only picks the route
        local = s.getsockname()[0]
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == local for a in addrs):
            return name
    raise RuntimeError(f"no network interface holds {local}, the address that routes to MASTER_ADDR={host}: set "
                       "GLOO_SOCKET_IFNAME to the interface the ranks should use (ip addr lists them)")


def run_rank(fn: Callable, args: tuple, backend: str, timeout_s: float, threads: int,
             bind_cores: Optional[bool] = None, init_group: bool = True, store_path: Optional[str] = None) -> Any:
    """fn(rank, world_size, *args) in this process, inside the job's process group unless init_group=False
    (store_path: where the ranks meet, see init_group_from_env)."""
    adopt_scheduler_env()  # an srun task's: env:// in init_process_group reads torchrun's variables
    env = RankEnv.from_environ()
    # init_process_group returns on a rank once its own connections are made (torch adds no barrier unless
    # TORCH_DIST_INIT_BARRIER=1: distributed_c10d._store_based_barrier). A rank whose fn then returns at once
    # exits and closes its sockets while a slower peer is still finishing gloo's connectFullMesh, which fails
    # ("Connection closed by peer", rarely on a busy machine, often with one rank niced: docs/benchmarks.md).
    # With the barrier no rank leaves init_process_group before every rank's group exists: ours below, and an
    # fn's own (init_group=False).
    os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "1")
    torch.set_num_threads(threads)  # ranks share the cores: without this each would use them all
    if not init_group:
        gate_agent_store_flag()  # torch < 2.14: the flag would also apply to the fn's own tcp:// endpoint
        return fn(env.rank, env.world_size, *args)
    init_group_from_env(backend, timeout_s, env, store_path)
    try:
        plan = binding_plan(env.local_world_size, threads, backend, bind_cores)
        if plan is not None:
            # Only now, after gloo has started its communication threads, so they stay free to run on any core.
            # The training thread keeps its own core: a rank waits on its peer in every all-reduce, and on a
            # small VM the scheduler otherwise moves the waking thread around (a small gloo all-reduce takes about
            # twice as long unbound: docs/benchmarks.md).
            bind_this_thread(plan[env.local_rank])
        return fn(env.rank, env.world_size, *args)
    finally:
        if dist.is_initialized():  # a torchrun script's fn may end with its own destroy_process_group()
            dist.destroy_process_group()


def apply_debug_level() -> None:
    """Read TORCH_DISTRIBUTED_DEBUG again, from the environment just applied: torch reads it once, when
    torch.distributed is imported (its __init__ calls set_debug_level_from_env), and a forkserver's rank imported
    it with the server, before a notebook set the variable after warm_up()."""
    reread = getattr(dist, "set_debug_level_from_env", None)  # absent where torch.distributed is unavailable
    if reread is not None:
        reread()


def rank_entry(rank: int, spec: RankSpec, payload: Any, log_pipe: Any = None) -> None:
    """What each launched child runs (after starting.rank_main): the rank, then its report, then exit. Its output goes
    to log_pipe, the launcher's pipe to its log (output_log.LogKeeper), or with none (Windows) to the log itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends us cleanly
    # The launcher's environment as it is now (a forkserver's ranks would otherwise see the server's, from its
    # start: a variable set in the notebook after warm_up() never reached them), then torchrun's variables.
    os.environ.clear()
    os.environ.update(spec.environ, **spec.env, **rank_env(rank))
    try:
        if log_pipe is None:
            capture_output(log_path(spec.run_dir, rank))
        else:
            output_to_pipe(log_pipe, log_path(spec.run_dir, rank))
    except OSError:
        # The run folder is gone: the launch ended (an interrupt during its start) before this rank got here.
        # Nobody reads this rank; its traceback on the inherited stderr would land in a later notebook cell.
        os._exit(1)
    code = 0
    try:
        apply_debug_level()
        fn, fn_args = payload.get()
        store = os.path.join(spec.run_dir, "store") if spec.init_group else None
        out = run_rank(fn, fn_args, spec.backend, spec.timeout_s, spec.threads, spec.bind_cores, spec.init_group,
                       store)
        report = value_report(out)
    except BaseException as e:  # noqa: BLE001 - report everything, including SystemExit, to the parent
        report, code = error_report(e), 1
    write_report(spec.run_dir, rank, report)
    sys.stdout.flush()
    sys.stderr.flush()
    end_descendants()  # nothing this rank started outlives it, nor holds a pid once it has exited
    # Skip interpreter teardown: the result is already reported, torch's teardown takes long, and a broken
    # process group can hang in destructors.
    os._exit(code)
