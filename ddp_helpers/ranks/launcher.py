"""Start N ranks from a notebook or script, watch them, and end them all cleanly whatever happens."""
from __future__ import annotations

import collections
import datetime
import glob
import io
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessContext, ProcessException

from .boot import rank_main
from .procs import bind_this_thread, binding_plan
from ..engine.config import ConfigError, check_address, default_threads, resolve_backend
from ..engine.fileio import atomic_write
from .startmethod import START_METHODS, prepare_forkserver, resolve_start_method

LOG_DIR_PREFIX = "ddp_helpers-ranks-"  # the ranks' log folders in the temp dir (their owner's pid inside)
GRACE_S = 2.0  # after SIGTERM, this long before SIGKILL
SETTLE_S = 0.3  # after a failure, this long for the other ranks to publish their last step and report
COMM_ERROR_MARKERS = ("DistBackendError", "DistNetworkError", "Connection closed", "Connection reset", "Timed out",
                      "timed out", "Socket Timeout", "Broken pipe", "DistStoreError", "ECONNRESET")


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


def is_comm_error(text: str) -> bool:
    """True when an error's text says a collective or the store lost its peer (a consequence, not a cause)."""
    return any(m in text for m in COMM_ERROR_MARKERS)


def _dumps(obj: Any) -> bytes:
    """Pickle obj for a rank: functions from __main__ (a notebook cell) by value with cloudpickle, torch's
    shared-memory tensors as handles (multiprocessing's reducers, which torch registers), the rest as pickle does."""
    import cloudpickle
    from multiprocessing.reduction import ForkingPickler

    class RankPickler(cloudpickle.Pickler):
        dispatch_table = collections.ChainMap(ForkingPickler._extra_reducers, cloudpickle.Pickler.dispatch_table)

    buf = io.BytesIO()
    RankPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


class Deferred:
    """A value a rank unpickles itself, after its parent watch is running (not in multiprocessing's bootstrap,
    which would import torch first), and that may hold functions defined in a notebook cell."""

    def __init__(self, value: Any):
        self.value, self.blob = value, None

    def __reduce__(self):
        # Called while the process starts (spawn, forkserver), so the tensors' file handles travel with it.
        return _deferred_from_blob, (_dumps(self.value),)

    def get(self) -> Any:
        """The value (unpickled on first use)."""
        if self.blob is not None:
            self.value, self.blob = pickle.loads(self.blob), None
        return self.value


def _deferred_from_blob(blob: bytes) -> Deferred:
    d = Deferred(None)
    d.blob = blob
    return d


# ---------------------------------------------------------------------------------------------- in the child
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


def _join_group(rank: int, world_size: int, backend: str, host: str, port: int, timeout_s: float) -> None:
    """Join the parent's rendezvous store as a client and initialize the default process group."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _run_in_group(rank: int, fn: Callable, world_size: int, group: Optional[tuple], port_queue: Any,
                  plan: Optional[List[List[int]]], fn_args: tuple) -> Any:
    """fn(rank, world_size, *fn_args), inside a process group when `group` = (backend, host, timeout_s)."""
    if group is None:
        return fn(rank, world_size, *fn_args)
    backend, host, timeout_s = group
    port = port_queue.get()  # the parent starts the store after starting us (see launch) and sends its port
    _join_group(rank, world_size, backend, host, port, timeout_s)
    if plan is not None:
        # Only now, after gloo has started its communication threads, so they stay free to run on any core.
        # The training thread keeps its own core: a rank waits on its peer in every all-reduce, and on a
        # small VM the scheduler otherwise moves the waking thread around (a 31 KB gloo all-reduce took
        # 2.0 ms on average unbound, 0.9 ms bound, on the 2-core VM of the benchmark).
        bind_this_thread(plan[rank])
    try:
        return fn(rank, world_size, *fn_args)
    finally:
        dist.destroy_process_group()


def _send_report(results: Any, log_dir: str, rank: int, report: tuple) -> None:
    """Write the report to a file of the log folder, then say so on the queue in a message of a few bytes.

    A large result sent through the pipe itself could be cut in half: a rank still writing it (the pipe full,
    the parent busy ending a failed launch) is terminated mid-message, and the parent would then wait forever
    for the rest. A message this small is written in one piece, and the file is complete once renamed.
    """
    path = os.path.join(log_dir, f"report{rank}.pkl")
    atomic_write(path, lambda tmp: _write_pickle(tmp, report))
    results.put(("report", rank))


def _write_pickle(path: str, obj: Any) -> None:
    with open(path, "wb") as fh:
        pickle.dump(obj, fh)


def _report_error(results: Any, log_dir: str, rank: int, e: BaseException) -> None:
    tb = traceback.format_exc()
    try:
        payload = pickle.dumps(e)
        pickle.loads(payload)
    except Exception:  # noqa: BLE001 - unpicklable exceptions are sent as text only
        payload = None
    _send_report(results, log_dir, rank, ("error", rank, payload, tb, f"{type(e).__name__}: {e}"))


def rank_entry(rank: int, world_size: int, group: Optional[tuple], port_queue: Any, threads: int, results: Any,
               log_dir: str, plan: Optional[List[List[int]]], payload: "Deferred") -> None:
    """What each child runs (after _boot.watch_parent): join the process group if asked, call fn, report back."""
    _quiet_child(os.path.join(log_dir, f"rank{rank}.log"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it ends us cleanly
    torch.set_num_threads(threads)  # ranks share the cores: without this each would use them all
    code = 0
    try:
        fn, fn_args = payload.get()
        out = _run_in_group(rank, fn, world_size, group, port_queue, plan, fn_args)
        _send_report(results, log_dir, rank, ("ok", rank, pickle.dumps(out)))
    except BaseException as e:  # noqa: BLE001 - report everything, including SystemExit, to the parent
        _report_error(results, log_dir, rank, e)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: the result is already reported, torch's teardown takes ~1 s, and a broken
    # process group can hang in destructors.
    os._exit(code)


# ---------------------------------------------------------------------------------------------- in the parent
def _log_tail(log_dir: str, rank: int, n: int = 2000) -> str:
    try:
        with open(os.path.join(log_dir, f"rank{rank}.log"), errors="replace") as fh:
            return fh.read()[-n:]
    except OSError:
        return ""


def _join_all(procs: Sequence[Any], timeout_s: float) -> None:
    """Join every process within one shared timeout."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))


def stop_processes(procs: Sequence[Any], grace_s: float = GRACE_S) -> None:
    """SIGTERM every live process, SIGKILL those still alive after grace_s, then reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    _join_all(procs, grace_s)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()


def check_start_method(start_method: str) -> str:
    """Refuse a start method that can't work in this process; returns the one to use ('auto' resolved)."""
    if start_method not in START_METHODS:
        raise ConfigError(f"launch(start_method={start_method!r}) is not accepted: one of {START_METHODS}")
    method = resolve_start_method(start_method)
    if method not in multiprocessing.get_all_start_methods():
        raise LaunchError(f"start_method={start_method!r} is not available on {sys.platform}; use "
                          "start_method='auto' (forkserver where available, else spawn)")
    if method == "fork" and torch.cuda.is_initialized():
        raise LaunchError("start_method='fork' refused: CUDA is already initialized in this process and a "
                          "forked child can't use it. Use start_method='auto' (the default), which starts the ranks "
                          "from a clean server process")
    if method != "fork":
        _check_main_module(method)
    return method


def _check_main_module(method: str) -> None:
    # spawn and forkserver start each rank by re-importing the main program: refuse one with no file to import.
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return  # python -m package.module: re-imported by name
    path = getattr(main, "__file__", None)  # None in Jupyter, the REPL and python -c: nothing is re-imported
    if path is not None and not os.path.isfile(path):
        raise LaunchError(f"start_method={method!r} can't start ranks from a program read from {path}: each rank "
                          "re-imports the main program from its file. Save the code to a file and run that")


def check_launch(world_size: int, backend: str, host: str, port: int) -> str:
    """Everything that can be refused before a process starts (but the start method); returns the backend."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"launch(world_size={world_size!r}) is not accepted: an int >= 1")
    backend = resolve_backend(backend, world_size)
    check_address(host, port, host_setting="launch(host={})", port_setting="launch(port={})")
    return backend


class _Reports:
    """What the ranks sent back: each one's value, or its error (payload, traceback, one-line text)."""

    def __init__(self, queue: Any, world_size: int, log_dir: str):
        self.queue = queue
        self.log_dir = log_dir
        self.outputs: List[Any] = [None] * world_size
        self.done: set = set()
        self.errors: Dict[int, Tuple[Optional[bytes], str, str]] = {}

    def drain(self) -> None:
        """Read every report waiting in the queue."""
        while not self.queue.empty():
            _, rank = self.queue.get()
            with open(os.path.join(self.log_dir, f"report{rank}.pkl"), "rb") as fh:
                msg = pickle.load(fh)
            if msg[0] == "ok":
                self.outputs[msg[1]] = pickle.loads(msg[2])
                self.done.add(msg[1])
            else:
                self.errors[msg[1]] = msg[2:]


class _QuietTermination(logging.Filter):
    """Drop torch's "Terminating process <pid> via signal SIGTERM" warnings: RankFailedError tells the story,
    and a pid printed into a cell changes on every run."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "process" not in record.getMessage().lower()


def _supervise(context: ProcessContext, reports: _Reports, log_dir: str, on_poll: Optional[Callable[[], None]],
               poll_s: float) -> List[Any]:
    """Wait for every rank; on the first failure end them all (torch's join) and raise RankFailedError."""
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    quiet = _QuietTermination()
    spawn_log.addFilter(quiet)
    try:
        while True:
            if on_poll is not None:
                on_poll()
            try:
                # join waits only on ranks still running (a finished rank's sentinel would wake it at once);
                # on a failure it gives the others SETTLE_S to report their side, then terminates them.
                finished = context.join(timeout=poll_s, grace_period=SETTLE_S)
            except ProcessException as e:
                reports.drain()
                codes = [p.exitcode for p in context.processes]
                err = _failure(e.error_index, codes, reports, log_dir)
                raise err from err.__cause__  # the rank's own exception, not torch's ProcessExitedException
            reports.drain()
            if finished or len(reports.done) == len(reports.outputs):
                break
    finally:
        spawn_log.removeFilter(quiet)
    if on_poll is not None:
        on_poll()
    return reports.outputs


def _start_ranks(method: str, world_size: int, child_args: tuple, payload: Deferred, log_dir: str) -> ProcessContext:
    """Start the rank processes; torch's ProcessContext then watches them (its error files are never written:
    ranks report through the results queue)."""
    if method == "fork":
        # DDP's constructor imports torch._dynamo (~3 s here). Importing it once in the parent means every
        # forked rank inherits it: later launches from the same notebook start in a fraction of a second.
        import torch._dynamo  # noqa: F401
    elif method == "forkserver":
        prepare_forkserver()
    ctx = multiprocessing.get_context(method)
    procs = []
    for rank in range(world_size):
        p = ctx.Process(target=rank_main, args=(rank, *child_args, payload), name=f"ddp_helpers-rank{rank}",
                        daemon=False)
        p.start()
        procs.append(p)
    return ProcessContext(procs, [os.path.join(log_dir, f"rank{r}.err") for r in range(world_size)])


class _EndOnSignals:
    """While the ranks run, SIGTERM and SIGHUP end the launch as Ctrl-C does: the ranks are stopped and the log
    folder removed, then the process exits (128 + signal). Without it, the default action would kill this process
    at once, skipping that cleanup (and Python would warn about leaked semaphores)."""

    def __init__(self) -> None:
        self.saved: dict = {}

    def __enter__(self) -> "_EndOnSignals":
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            for name in ("SIGTERM", "SIGHUP"):
                sig = getattr(signal, name, None)  # Windows has no SIGHUP
                if sig is not None and signal.getsignal(sig) == signal.SIG_DFL:  # never replace someone's handler
                    self.saved[sig] = signal.signal(sig, self._exit)
        return self

    @staticmethod
    def _exit(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)


def _new_log_dir() -> str:
    """A private folder for the ranks' logs, marked with its owner, after removing those of dead owners."""
    _remove_stale_log_dirs()
    log_dir = tempfile.mkdtemp(prefix=LOG_DIR_PREFIX)
    with open(os.path.join(log_dir, "owner"), "w") as fh:
        fh.write(f"{os.getpid()} {_started(os.getpid())}")
    return log_dir


def _started(pid: int) -> float:
    import psutil

    return psutil.Process(pid).create_time()


def _remove_stale_log_dirs() -> None:
    """Remove log folders whose owning process is gone (a kernel restart or SIGKILL skips the cleanup)."""
    import psutil

    for folder in glob.glob(os.path.join(tempfile.gettempdir(), LOG_DIR_PREFIX + "*")):
        try:
            with open(os.path.join(folder, "owner")) as fh:
                pid, started = fh.read().split()
            alive = psutil.pid_exists(int(pid)) and abs(_started(int(pid)) - float(started)) < 1e-3
        except (OSError, ValueError, psutil.Error):
            continue  # not ours (no owner file), or being written, or its owner just left: leave it
        if not alive:  # the pid is gone, or reused by a process that started later
            shutil.rmtree(folder, ignore_errors=True)


def launch(fn: Callable, world_size: int = 2, args: tuple = (), backend: str = "gloo", start_method: str = "auto",
           host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0, threads_per_rank: Optional[int] = None,
           on_poll: Optional[Callable[[], None]] = None, poll_s: float = 0.05,
           bind_cores: Optional[bool] = None, init_group: bool = True) -> List[Any]:
    """Run fn(rank, world_size, *args) on world_size processes in one process group; return each rank's value.

    start_method="auto" (the default) forks the ranks from a server that has torch imported already (forkserver,
    Linux and macOS) and uses spawn elsewhere; "spawn" and "fork" are there too. fn may be defined in a notebook
    cell: it is sent by value (cloudpickle) when it can't be imported by name.
    A rank that fails ends all of them and raises RankFailedError; Ctrl-C ends them all and re-raises.
    bind_cores: give each gloo rank's training thread cores of its own (None = when there are enough cores).
    init_group=False starts the ranks without a process group (fn sets one up itself, as an exercise does).
    """
    method = check_start_method(start_method)
    backend = check_launch(world_size, backend, host, port)
    threads = threads_per_rank or default_threads(world_size)
    try:
        plan = binding_plan(world_size, threads, backend, bind_cores) if init_group else None
    except ValueError as e:
        raise LaunchError(f"launch(bind_cores=True) refused: {e}. Use bind_cores=None to bind only when possible, "
                          "or fewer ranks or threads_per_rank") from None
    ctx_mp = multiprocessing.get_context(method)
    results, port_queue = ctx_mp.SimpleQueue(), ctx_mp.SimpleQueue()
    log_dir = _new_log_dir()
    group = (backend, host, timeout_s) if init_group else None
    child_args = (world_size, group, port_queue, threads, results, log_dir, plan)
    context = None
    with _EndOnSignals():
        try:
            context = _start_ranks(method, world_size, child_args, Deferred((fn, args)), log_dir)
            return _run_job(context, init_group, host, port, timeout_s, world_size, results, log_dir, on_poll,
                            poll_s, port_queue)
        finally:
            _end_launch(context, results, port_queue, log_dir)


def _end_launch(context: Optional[ProcessContext], results: Any, port_queue: Any, log_dir: str) -> None:
    """Reap or stop every rank, close the queues and remove the log folder: nothing of the launch outlives it."""
    try:
        if context is not None:
            _join_all(context.processes, 10.0)  # a rank that reported its value exits at once; one that doesn't ...
            stop_processes(context.processes)  # ... is ended here: nothing outlives the call
    finally:
        results.close()  # release the queues' pipes and locks now, not at interpreter exit
        port_queue.close()
        shutil.rmtree(log_dir, ignore_errors=True)


def _run_job(context: ProcessContext, init_group: bool, host: str, port: int, timeout_s: float, world_size: int,
             results: Any, log_dir: str, on_poll: Optional[Callable[[], None]], poll_s: float,
             port_queue: Any) -> List[Any]:
    store = None
    try:
        if init_group:
            # The store is the rendezvous: port 0 lets the OS pick a free port, and holding it open while the ranks
            # run means two launches at once never collide (the listing's fixed 23456 can). It starts only now,
            # after the ranks exist: a forked child must not inherit the store's server thread (it could hold a
            # lock at the moment of the fork, and the child would then hang in the rendezvous).
            store = dist.TCPStore(host, port, world_size, is_master=True,
                                  timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)
            for _ in range(world_size):
                port_queue.put(store.port)
        return _supervise(context, _Reports(results, world_size, log_dir), log_dir, on_poll, poll_s)
    except BaseException:
        stop_processes(context.processes)  # KeyboardInterrupt included: nothing outlives the call
        raise
    finally:
        store = None  # noqa: F841 - frees the port for the next run


def _killed(first: int, codes: Sequence[Optional[int]], errors: dict) -> Optional[int]:
    """The rank a signal ended before anyone stopped it, or None.

    torch's join names the first rank it saw exit; the others it then ended with SIGTERM. A rank ended by
    another signal (SIGKILL from the OOM killer, a segfault) died on its own, even if join saw a peer first.
    """
    if first not in errors and codes[first] is not None and codes[first] < 0:
        return first
    own = [r for r, c in enumerate(codes) if c is not None and c < 0 and c != -signal.SIGTERM and r not in errors]
    return own[0] if own else None


def _failure(first: int, codes: Sequence[Optional[int]], reports: _Reports, log_dir: str) -> RankFailedError:
    """Describe the failure: the rank that failed first (not one that merely lost its peer)."""
    errors, done = reports.errors, reports.done
    others = [f"rank {r}: {text}" for r, (_, _, text) in sorted(errors.items())]
    killed = _killed(first, codes, errors)
    if killed is not None:
        code = codes[killed]
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return RankFailedError(killed, f"process was killed by signal {name} (exit code {code})",
                               log_tail=_log_tail(log_dir, killed), others=others)
    first_code = codes[first]
    if errors:
        return _reported_failure(errors, done, log_dir, len(reports.outputs), others)
    if not os.path.exists(os.path.join(log_dir, f"rank{first}.log")):
        # The log is the first thing a rank opens: this one died while Python was still starting it.
        return RankFailedError(first, f"process exited with code {first_code} before it reached the training "
                                      "function. With start_method 'spawn' or 'forkserver' each rank first "
                                      "re-imports the main script; a script that starts training at import time, "
                                      "or fails to import, ends the rank there (its error is printed above). Put "
                                      "the launch under `if __name__ == \"__main__\":`", others=others)
    return RankFailedError(first, f"process exited with code {first_code} without reporting",
                           log_tail=_log_tail(log_dir, first), others=others)


def _reported_failure(errors: dict, done: set, log_dir: str, world_size: int, others: List[str]) -> RankFailedError:
    silent = [r for r in range(world_size) if r not in errors and r not in done]
    if silent and all(is_comm_error(tb) for _, tb, _ in errors.values()):
        # Everyone who spoke only lost a peer; a rank that neither finished nor failed is the one stuck.
        r = silent[0]
        return RankFailedError(r, "stopped responding: the other ranks timed out waiting for it in a collective "
                                  "(a hang, a deadlock, or a rank that skipped a collective); it was then terminated",
                               log_tail=_log_tail(log_dir, r), others=others)
    primary = [r for r, (_, tb, _) in sorted(errors.items()) if not is_comm_error(tb)]
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
