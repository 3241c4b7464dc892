"""Start N ranks from a notebook or script, watch them, and end them all cleanly whatever happens."""
from __future__ import annotations

import datetime
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ._proc import bind_this_thread, binding_plan, die_with_parent
from .config import ConfigError, check_address, default_threads, resolve_backend

START_METHODS = ("spawn", "fork")
GRACE_S = 2.0  # after SIGTERM, this long before SIGKILL
SETTLE_S = 0.3  # after a failure, this long for the other ranks to publish their last step


class LaunchError(RuntimeError):
    """The ranks could not be started as asked (raised before any process starts)."""


class RankFailedError(RuntimeError):
    """A rank raised, exited or was killed; names the rank and keeps the original error and the partial result."""

    def __init__(self, rank: int, message: str, traceback_text: str = "", original: Optional[BaseException] = None,
                 log_tail: str = "", others: Sequence[str] = ()):
        text = f"rank {rank} failed: {message}"
        if traceback_text:
            text += f"\n--- traceback from rank {rank} ---\n{traceback_text.rstrip()}"
        if log_tail.strip():
            text += f"\n--- last output of rank {rank} ---\n{log_tail.rstrip()}"
        super().__init__(text)
        self.rank = rank
        self.message = message
        self.traceback_text = traceback_text
        self.original = original
        self.others = list(others)  # what the other ranks reported (usually "peer closed the connection")
        self.partial_result: Any = None  # run_training fills in the metrics collected before the failure


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


def _rank_entry(rank: int, fn: Callable, world_size: int, backend: str, host: str, port_queue: Any,
                timeout_s: float, threads: int, results: Any, log_dir: str, fn_args: tuple,
                plan: Optional[List[List[int]]] = None) -> None:
    """What each child runs: join the process group, call fn(rank, world_size, *fn_args), report back."""
    die_with_parent()
    _quiet_child(os.path.join(log_dir, f"rank{rank}.log"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends us cleanly
    torch.set_num_threads(threads)  # ranks share the cores: without this each would use them all
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        port = port_queue.get()  # the parent starts the store after starting us (see launch) and sends its port
        # The parent owns the rendezvous store (it picked the port), so ranks join as clients.
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        if plan is not None:
            # Only now, after gloo has started its communication threads, so they stay free to run on any core.
            # The training thread keeps its own core: a rank waits on its peer in every all-reduce, and on a
            # small VM the scheduler otherwise moves the waking thread around (a 31 KB gloo all-reduce took
            # 2.0 ms on average unbound, 0.9 ms bound, on the 2-core VM of the README's benchmark).
            bind_this_thread(plan[rank])
        try:
            out = fn(rank, world_size, *fn_args)
        finally:
            dist.destroy_process_group()
        results.put(("ok", rank, pickle.dumps(out)))
    except BaseException as e:  # noqa: BLE001 - report everything, including SystemExit, to the parent
        tb = traceback.format_exc()
        try:
            payload = pickle.dumps(e)
            pickle.loads(payload)
        except Exception:  # noqa: BLE001 - unpicklable exceptions are sent as text only
            payload = None
        results.put(("error", rank, payload, tb, f"{type(e).__name__}: {e}"))
        sys.stdout.flush()
        os._exit(1)  # skip interpreter teardown: a broken process group can hang in destructors
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the result is already in the pipe; skipping torch's slow interpreter teardown saves ~1 s


def _log_tail(log_dir: str, rank: int, n: int = 2000) -> str:
    try:
        with open(os.path.join(log_dir, f"rank{rank}.log"), errors="replace") as fh:
            return fh.read()[-n:]
    except OSError:
        return ""


def _is_comm_error(text: str) -> bool:
    markers = ("DistBackendError", "DistNetworkError", "Connection closed by peer", "Connection reset",
               "Timed out", "timed out", "Broken pipe", "DistStoreError", "ECONNRESET")
    return any(m in text for m in markers)


def stop_processes(procs: Sequence[Any], grace_s: float = GRACE_S) -> None:
    """SIGTERM every live process, SIGKILL those still alive after grace_s, then reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join()


def check_start_method(start_method: str) -> None:
    """Refuse a start method that can't work in this process (fork after CUDA, spawn of a script with no file)."""
    if start_method not in START_METHODS:
        raise ConfigError(f"launch(start_method={start_method!r}) is not accepted: one of {START_METHODS}")
    if start_method == "fork":
        if sys.platform == "win32":
            raise LaunchError("start_method='fork' is not available on Windows; use start_method='spawn' with a "
                              "function defined in an importable module")
        if torch.cuda.is_initialized():
            raise LaunchError("start_method='fork' refused: CUDA is already initialized in this process and a "
                              "forked child can't use it. Restart the kernel and launch before touching CUDA, or use "
                              "start_method='spawn' with a function from an importable module")
        return
    # spawn starts each rank by re-importing the main program: refuse one that has no file to re-import.
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return  # python -m package.module: re-imported by name
    path = getattr(main, "__file__", None)  # None in Jupyter, the REPL and python -c: nothing is re-imported
    if path is not None and not os.path.isfile(path):
        raise LaunchError(f"start_method='spawn' can't start ranks from a program read from {path}: each rank "
                          "re-imports the main program from its file. Save the code to a file and run that, or use "
                          "start_method='fork'")


def check_launch(world_size: int, backend: str, start_method: str, host: str, port: int) -> str:
    """Everything that can be refused before a process starts; returns the resolved backend."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"launch(world_size={world_size!r}) is not accepted: an int >= 1")
    check_start_method(start_method)
    backend = resolve_backend(backend, world_size)
    check_address(host, port, host_setting="launch(host={})", port_setting="launch(port={})")
    return backend


def launch(fn: Callable, world_size: int = 2, args: tuple = (), backend: str = "gloo", start_method: str = "spawn",
           host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0, threads_per_rank: Optional[int] = None,
           on_poll: Optional[Callable[[], None]] = None, poll_s: float = 0.05,
           bind_cores: Optional[bool] = None) -> List[Any]:
    """Run fn(rank, world_size, *args) on world_size processes in one process group; return each rank's value.

    spawn (the default) pickles fn by name, so fn must live in an importable module; fork copies this process
    and so also runs functions defined in a notebook cell (refused once CUDA is initialized).
    A rank that fails ends all of them and raises RankFailedError; Ctrl-C ends them all and re-raises.
    bind_cores: give each gloo rank's training thread cores of its own (None = when there are enough cores).
    """
    backend = check_launch(world_size, backend, start_method, host, port)
    if start_method == "fork":
        # DDP's constructor imports torch._dynamo (~3 s here). Importing it once in the parent means every
        # forked rank inherits it: later launches from the same notebook start in a fraction of a second.
        import torch._dynamo  # noqa: F401
    threads = threads_per_rank or default_threads(world_size)
    try:
        plan = binding_plan(world_size, threads, backend, bind_cores)
    except ValueError as e:
        raise LaunchError(f"launch(bind_cores=True) refused: {e}. Use bind_cores=None to bind only when possible, "
                          "or fewer ranks or threads_per_rank") from None
    timeout = datetime.timedelta(seconds=timeout_s)
    ctx_mp = mp.get_context(start_method)
    results = ctx_mp.SimpleQueue()
    port_queue = ctx_mp.SimpleQueue()
    log_dir = tempfile.mkdtemp(prefix="ddp_helpers-")
    child_args = (fn, world_size, backend, host, port_queue, timeout_s, threads, results, log_dir, args, plan)
    context = mp.start_processes(_rank_entry, args=child_args, nprocs=world_size, join=False,
                                 start_method=start_method)
    procs = context.processes
    store = None
    outputs: List[Any] = [None] * world_size
    done: set = set()
    errors: dict = {}

    def drain() -> List[int]:
        """Read every waiting report; return the ranks that ended without reporting success."""
        while not results.empty():
            msg = results.get()
            if msg[0] == "ok":
                outputs[msg[1]] = pickle.loads(msg[2])
                done.add(msg[1])
            else:
                errors[msg[1]] = msg[2:]
        return [r for r, p in enumerate(procs) if p.exitcode is not None and r not in done]

    try:
        # The store is the rendezvous: binding port 0 lets the OS pick a free port, and holding it open while the
        # ranks run means two launches at once can never collide (the listing's fixed 23456 can). It starts only
        # now, after the ranks exist: a forked child must not inherit the store's server thread (it could hold a
        # lock at the moment of the fork, and the child would then hang in the rendezvous).
        store = dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        for _ in range(world_size):
            port_queue.put(store.port)
        while len(done) < world_size:
            if on_poll is not None:
                on_poll()
            multiprocessing.connection.wait([results._reader] + [p.sentinel for p in procs], poll_s)
            exited = drain()
            if errors or exited:
                # Something went wrong. Let the others finish the step they are on and report their side
                # (a survivor is usually blocked in a collective by now), then end them all.
                time.sleep(SETTLE_S)
                if drain() or errors:
                    codes = [p.exitcode for p in procs]  # before we stop the rest: who ended on their own
                    stop_processes(procs)
                    raise _failure(codes, errors, done, log_dir)
        if on_poll is not None:
            on_poll()
        for p in procs:
            p.join(timeout=10)
        return outputs
    except BaseException:
        stop_processes(procs)  # KeyboardInterrupt included: nothing outlives the call
        raise
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        store = None  # frees the port for the next run
        results.close()  # release the queues' pipes and locks now, not at interpreter exit
        port_queue.close()
        shutil.rmtree(log_dir, ignore_errors=True)


def _failure(codes: Sequence[Optional[int]], errors: dict, done: set, log_dir: str) -> RankFailedError:
    """Pick the rank that failed first (not one that merely lost its peer) and describe it."""
    killed = [r for r, c in enumerate(codes) if c is not None and c < 0 and r not in errors]
    others = [f"rank {r}: {text}" for r, (_, _, text) in sorted(errors.items())]
    if killed:
        r = killed[0]
        try:
            name = signal.Signals(-codes[r]).name
        except ValueError:
            name = str(-codes[r])
        err = RankFailedError(r, f"process was killed by signal {name} (exit code {codes[r]})",
                              log_tail=_log_tail(log_dir, r), others=others)
        return err
    silent = [r for r, c in enumerate(codes) if c is None and r not in errors and r not in done]
    if errors and silent and all(_is_comm_error(tb) for _, tb, _ in errors.values()):
        # Everyone who spoke only lost a peer; a rank that neither finished nor failed is the one stuck.
        r = silent[0]
        return RankFailedError(r, "stopped responding: the other ranks timed out waiting for it in a collective "
                                  "(a hang, a deadlock, or a rank that skipped a collective); it was then terminated",
                               log_tail=_log_tail(log_dir, r), others=others)
    if errors:
        primary = [r for r, (_, tb, _) in sorted(errors.items()) if not _is_comm_error(tb)]
        r = primary[0] if primary else min(errors)
        payload, tb, text = errors[r]
        original = None
        if payload is not None:
            try:
                original = pickle.loads(payload)
            except Exception:  # noqa: BLE001
                original = None
        err = RankFailedError(r, text, traceback_text=tb, original=original, log_tail="", others=others)
        if original is not None:
            err.__cause__ = original
        return err
    r = min(r for r, c in enumerate(codes) if c is not None and r not in done)
    if not os.path.exists(os.path.join(log_dir, f"rank{r}.log")):
        # The log is the first thing a rank opens: this one died while Python was still starting it.
        return RankFailedError(r, f"process exited with code {codes[r]} before it reached the training function. "
                                  "With start_method='spawn' each rank first re-imports the main script; a script "
                                  "that starts training at import time, or fails to import, ends the rank there "
                                  "(its error is printed above). Put the launch under "
                                  "`if __name__ == \"__main__\":`, or use start_method='fork'", others=others)
    return RankFailedError(r, f"process exited with code {codes[r]} without reporting",
                           log_tail=_log_tail(log_dir, r), others=others)
