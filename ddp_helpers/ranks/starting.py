"""Starting a rank: what a launch sends it (the function and its arguments, by value where a notebook cell
defined them; the data cache's tensors checked after), where the ranks meet (the store a launch hosts), and the
first code a rank runs, before anything heavy is imported: tie its life to its parent's, lead its own group; and
the launcher's side, the rank processes started (`start_ranks`).

This module imports only the standard library at the top (and two modules of the package that import only it),
so a rank started by spawn or forkserver reaches rank_main in milliseconds; torch and the function to run are
unpickled afterwards (Deferred), and rank.py (torch) is imported inside rank_main.
"""
from __future__ import annotations

import collections
import ctypes
import datetime
import gc
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import threading
import types
import warnings
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from ..common.shared import any_guarded, guarded
from .ending import interrupts_deferred, kill_group

try:
    import resource
except ImportError:  # Windows: psutil answers for the peak memory instead
    resource = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from torch.distributed import TCPStore

    from .checks import LaunchPlan
    from .joining import RankProcesses
    from .output_log import LogKeeper

SHARE_ARRAYS_FROM = 16 * 2**20  # NumPy arrays this large travel through shared memory, not one copy per rank


# --- the rank's process: its first code, its parent watched, its group, its heap ---


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so no worker outlives a crashed launcher."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the launcher's own cleanup still applies
        pass


def lead_own_group() -> None:
    """Make this process the leader of a new process group, so that it and all it starts can be ended at once."""
    if hasattr(os, "setpgid"):
        try:
            os.setpgid(0, 0)
        except OSError:  # already a group or session leader
            pass


def freeze_heap() -> None:
    """Move every object alive now out of the garbage collector's view.

    torch (and the torch._dynamo that DDP imports) leaves millions of long-lived objects; freezing them keeps
    Python's full garbage collections from walking them in the middle of a step (tens of ms each).
    """
    gc.collect()
    gc.freeze()


def peak_rss_bytes(children: bool = True) -> float:
    """Peak resident memory of this process (plus, by default, its largest finished child), in bytes; NaN if unknown.

    ru_maxrss is in KiB on Linux and in bytes on macOS; Windows has no `resource` module (psutil answers there).
    """
    if resource is None:  # Windows: psutil's peak working set (children not included)
        import psutil

        info = psutil.Process().memory_info()
        return float(getattr(info, "peak_wset", info.rss))
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if children:
        usage += resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # e.g. the listing's DataLoader workers
    return float(usage) * (1 if sys.platform == "darwin" else 1024)


def _exit_when(sentinel) -> None:
    multiprocessing.connection.wait([sentinel])
    # The parent is gone: nobody will read our result, and a rank must never outlive its job, nor what it started.
    if hasattr(os, "getpgrp") and os.getpgrp() == os.getpid():
        kill_group(os.getpid())  # this rank's group: itself and everything it started
    os._exit(1)


def watch_parent() -> None:
    """End this process when the process that launched it ends (at once if it already has)."""
    die_with_parent()  # Linux: SIGKILL from the kernel when our parent dies (under forkserver: the server)
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    # parent.sentinel becomes ready when the launching process exits, whatever the start method or platform.
    if multiprocessing.connection.wait([parent.sentinel], timeout=0):
        os._exit(1)  # it died while we were starting (a kernel restart mid-launch)
    threading.Thread(target=_exit_when, args=(parent.sentinel,), name="ddp_helpers-parent-watch",
                     daemon=True).start()


def _default_signals() -> None:
    # A forked rank inherits the launcher's SIGTERM/SIGHUP handlers (which end a launch cleanly): in a rank the
    # launcher's SIGTERM must simply end it, not be reported back as the rank's own error.
    for name in ("SIGTERM", "SIGHUP"):
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, signal.SIG_DFL)


def rank_main(rank: int, *args) -> None:
    """Process target: lead a process group of its own, watch the parent, then run the rank (rank.rank_entry)."""
    # First: Ctrl-C is the launcher's to handle. In Jupyter it reaches the kernel's whole process group, this
    # rank too until lead_own_group: a KeyboardInterrupt here would print its traceback into a notebook cell.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A forked rank holds a copy of its parent's heap, garbage included: collected here, a torch object's C++
    # destructor would run in a process without the threads it owns (std::terminate: "Fatal Python error:
    # Aborted" in freeze_heap's collection). Frozen, the parent's objects are never collected in the rank (and
    # their pages stay shared); what the rank makes from now on is collected as usual.
    gc.freeze()
    _default_signals()
    lead_own_group()  # the launcher ends this group at the end: whatever the rank starts goes with it
    watch_parent()
    from .rank import rank_entry  # torch is imported only now

    rank_entry(rank, *args)


# --- what a launch sends each rank ---


def _readonly_array(tensor: Any) -> Any:
    array = tensor.numpy()
    array.flags.writeable = False  # the ranks share these pages: a write would change every rank's copy
    return array


def _reducer(shared: Dict[int, Any]):
    """Large arrays as shared-memory tensors, one copy for all ranks (kept alive in `shared` until the ranks have
    mapped them); the rest as pickle writes them."""
    def reduce(array: Any) -> Any:
        import numpy as np
        import torch

        if array.nbytes >= SHARE_ARRAYS_FROM and array.dtype.kind in "biufc":
            if id(array) not in shared:
                try:
                    shared[id(array)] = (array, torch.from_numpy(np.ascontiguousarray(array)).share_memory_())
                except TypeError:  # a dtype torch can't hold
                    return array.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
            return _readonly_array, (shared[id(array)][1],)
        return array.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return reduce


def _code_reducer(cloudpickles: Any):
    """Code objects as cloudpickle sends them, but with their file name: cloudpickle renames every one
    "<dynamic-code>" (its payload then doesn't depend on where a function was defined), and a rank's traceback
    and warnings could then not name the learner's cell (ranks/output_shown.py names it in the launching kernel)."""
    def reduce(code: types.CodeType) -> Any:
        if code.co_filename == "<dynamic-code>":
            return cloudpickles(code)
        return _named_code, (code.replace(co_filename="<dynamic-code>"), code.co_filename)
    return reduce


def _named_code(code: types.CodeType, filename: str) -> types.CodeType:
    return code.replace(co_filename=filename)


def tensors_in(obj: Any) -> List[Any]:
    """Every torch tensor obj holds, found by pickling it to nowhere as dumps would (closures and globals of cell
    functions too), the tensors themselves left out; raises what pickling obj would raise."""
    import cloudpickle

    found: List[Any] = []

    class Finder(cloudpickle.Pickler):
        def reducer_override(self, o: Any) -> Any:
            if type(o).__module__.startswith("torch") and type(o).__name__ in ("Tensor", "Parameter"):
                found.append(o)
                return int, ()  # not its bytes: only where it is
            return super().reducer_override(o)

    Finder(io.BytesIO(), protocol=5, buffer_callback=lambda _: None).dump(obj)  # arrays out of band: not copied
    return found


def dumps(obj: Any, shared: Optional[Dict[int, Any]] = None) -> bytes:
    """Pickle obj for a rank: functions from __main__ (a notebook cell) by value with cloudpickle, torch's
    shared-memory tensors as handles (multiprocessing's reducers, which torch registers), large NumPy arrays
    as shared memory (read-only in the ranks), the rest as pickle does."""
    import cloudpickle
    import numpy as np
    own = {np.ndarray: _reducer({} if shared is None else shared)}
    code_reduce = cloudpickle.Pickler.dispatch_table.get(types.CodeType)
    if code_reduce is not None:
        own[types.CodeType] = _code_reducer(code_reduce)

    class RankPickler(cloudpickle.Pickler):
        dispatch_table = collections.ChainMap(own, ForkingPickler._extra_reducers, cloudpickle.Pickler.dispatch_table)

    buf = io.BytesIO()
    RankPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


class Deferred:
    """A value a rank unpickles itself, after its parent watch is running (not in multiprocessing's bootstrap,
    which would import torch first), and that may hold functions defined in a notebook cell."""

    def __init__(self, value: Any):
        self.value, self.blob = value, None
        self.shared: Dict[int, Any] = {}  # the arrays sent through shared memory, alive as long as the launch

    def __reduce__(self):
        # Called while each process starts (spawn, forkserver), so the tensors' file handles travel with it.
        return _deferred_from_blob, (dumps(self.value, self.shared),)

    def get(self) -> Any:
        """The value (unpickled on first use)."""
        if self.blob is not None:
            self.value, self.blob = pickle.loads(self.blob), None
        return self.value


def _deferred_from_blob(blob: bytes) -> Deferred:
    d = Deferred(None)
    d.blob = blob
    return d


# --- the data cache's tensors a launch hands its ranks, checked after it ---


class SharedDataChanged(UserWarning):
    """A rank changed data that this process shares with every rank (the data cache's tensors)."""


warnings.simplefilter("always", SharedDataChanged)  # every time: each launch that does it is a new corruption


def _digest(storage: Any) -> int:
    import torch
    import xxhash

    raw = torch.empty(0, dtype=torch.uint8).set_(storage)  # the storage's bytes, whatever the tensor's dtype
    return xxhash.xxh3_64_intdigest(raw.numpy())


class SharedWatch:
    """The guarded storages among the tensors a launch sends (tensors_in), with their digests before it."""

    def __init__(self, tensors: List[Any]):
        self.before: Dict[int, Tuple[Any, int, str, Callable[[], None]]] = {}
        if not any_guarded():
            return
        for t in tensors:
            storage = t.untyped_storage()
            name = guarded(storage.data_ptr()) if t.device.type == "cpu" else None
            if name is not None and storage.data_ptr() not in self.before:
                self.before[storage.data_ptr()] = (storage, _digest(storage), *name)

    def check(self) -> List[str]:
        """Name every guarded tensor a rank changed (a SharedDataChanged warning each) and drop its cache."""
        changed = []
        for storage, digest, what, forget in self.before.values():
            if _digest(storage) != digest:
                changed.append(what)
                forget()
                warnings.warn(
                    f"a rank changed {what} in place, and this process's copy with it: the ranks map the same memory "
                    "(an in-place op such as x.sub_(...) or images[:] -= ... on that tensor or a slice of it). The data "
                    "cache was dropped, so the next load_data reads the files again; tensors you took from it before "
                    "(e.g. a global IMAGES) still hold the changed values: load them again. In the rank, change a copy: "
                    "x = x.clone() first, or x = x - mean", SharedDataChanged, stacklevel=3)
        return changed


# --- the rendezvous store a launch hosts, listening only on the interface of its host address ---


def bind_listener(host: str, port: int, listen: bool = True) -> socket.socket:
    """A socket bound to host:port (0 = a free port the OS picks), on that address only; listening if `listen`
    (bound alone it holds the port, and a connection to it is refused).

    TCPStore(host, port, is_master=True) listens on every interface whatever host says; given a socket bound here
    (master_listen_fd) it serves on this one: a loopback host keeps the store unreachable from other machines.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    addr = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)[0][4]
    sock = None
    try:
        # Ctrl-C waits for the socket to exist and be named: raised inside socket.socket() it left the new
        # descriptor open, held by the traceback a notebook keeps (issue 61, N8)
        with interrupts_deferred() as pending:
            sock = socket.socket(family, socket.SOCK_STREAM)
        if pending:
            raise KeyboardInterrupt
        sock.bind(addr)
        if listen:
            sock.listen(128)
        return sock
    except BaseException:  # Ctrl-C too: no socket outlives the call
        if sock is not None:
            sock.close()
        raise


def serve_store(sock: socket.socket, host: str, world_size: int, timeout_s: float) -> TCPStore:
    """Start the store's server on the bound socket; the ranks join it as clients (see env.launched_env)."""
    import torch.distributed as dist  # here, not at import: launcher imports this module (see there)

    port = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the descriptor from here on, and closes it when it ends (or fails)
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=fd, use_libuv=True)


# --- the rank processes of a launch, started ---


def start_ranks(plan: LaunchPlan, fn: Callable, args: tuple, procs: List[Any],
                logs: Optional[LogKeeper]) -> Tuple[RankProcesses, socket.socket, Optional[TCPStore]]:
    """Start the plan's ranks on fn(rank, world_size, *args): the ranks, the socket, the store (None: init_group).
    Each is appended to procs as it starts (an interrupt between two still ends those running), with its end of a
    pipe for its output (logs); the socket is bound first (its port is in their environment), the store served last."""
    from .joining import RankProcesses
    from .startmethod import forkserver_pid

    # It listens, with a TCP store behind it, only for a function that joins through env:// itself (init_group=False).
    listener = _listen(plan.host, plan.port, listen=not plan.init_group)
    try:
        _start_processes(plan, listener.getsockname()[1], Deferred((fn, args)), procs, logs)
        # Only now, after the ranks exist: a forked child must not inherit the store's server thread (it could
        # hold a lock at the moment of the fork, and the child would hang in the rendezvous).
        store = None if plan.init_group else serve_store(listener, plan.host, plan.world_size, plan.timeout_s)
        return RankProcesses(procs, forkserver_pid() if plan.method == "forkserver" else None), listener, store
    except BaseException:  # Ctrl-C up to the return included: the caller never holds the socket to close it
        listener.close()
        raise


def _listen(host: str, port: int, listen: bool) -> socket.socket:
    from .checks import LaunchError

    try:
        return bind_listener(host, port, listen)
    except OSError as e:  # taken between LaunchPlan.checked and now
        raise LaunchError(f"launch(port={port}) can't listen on {host}: {e}; use port=0 (a free port)") from None


def _start_processes(plan: LaunchPlan, port: int, payload: Deferred, procs: List[Any],
                     logs: Optional[LogKeeper]) -> None:
    """Start the rank processes, appending each to procs, each with its end of a pipe for its output (logs) and
    torchrun's variables for a rendezvous at port in its environment."""
    from .ending import LAUNCH_MARK
    from .env import RankSpec, launched_env

    method, world_size = plan.method, plan.world_size
    mark = plan.mark
    env = {**launched_env(world_size, plan.host, port, f"ddp_helpers-{mark}", plan.threads), LAUNCH_MARK: mark}
    spec = RankSpec(dict(os.environ), env, plan.run_dir, plan.backend, plan.timeout_s, plan.threads, plan.bind_cores,
                    plan.init_group)
    if method == "fork":
        # DDP's constructor imports torch._dynamo (seconds: docs/benchmarks.md). Importing it once in the parent: every
        # forked rank inherits it: later launches from the same notebook start in a fraction of a second.
        import torch._dynamo  # noqa: F401
    elif method == "forkserver":
        from .startmethod import prepare_forkserver

        prepare_forkserver()
    ctx = multiprocessing.get_context(method)
    for rank in range(world_size):
        with interrupts_deferred() as pending:  # a rank forked as Ctrl-C comes is in procs, so it is ended too
            pipe = logs.pipe_for(rank) if logs is not None else None
            p = ctx.Process(target=rank_main, args=(rank, spec, payload, pipe), name=f"ddp_helpers-rank{rank}",
                            daemon=False)
            p.start()
            procs.append(p)
            if logs is not None:
                logs.sent(rank)
        if pending:
            raise KeyboardInterrupt
    if logs is not None:
        logs.start()  # only now: a forked rank must not inherit its thread
