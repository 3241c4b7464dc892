"""launch(): start N ranks from a notebook or script, watch them, and end them all cleanly whatever happens."""
from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any, Callable, List, Optional

from .checks import SERVER_EXIT_S, SETTLE_S, LaunchError, LaunchPlan, check_start_method, launch_plan, window_s
from .folders import log_paths, run_folder
from .ending import GRACE_S, EndOnSignals, PidsBefore, end_launch, interrupts_deferred, stop_processes
from .output_log import keeper_for, printable
from .output_shown import LaunchEcho, echo_for, name_cells
from .reports import (RankFailedError, diagnose, first_unreported, raised_in_collective, read_rank_reports,
                      returned_values)
from .startmethod import forkserver_pid
from .starting import SharedWatch, start_ranks, tensors_in

if TYPE_CHECKING:
    from .joining import RankProcesses

# torch is imported when a launch starts, not with this module: a spawned rank re-imports its program's main
# module before it reaches starting.rank_main, and `from ddp_helpers import launch` there must not take seconds.

__all__ = ["GRACE_S", "SERVER_EXIT_S", "SETTLE_S", "LaunchError", "LaunchInterrupted", "LaunchPlan", "RankFailedError",
           "check_start_method", "launch", "raised_in_collective", "run_plan", "stop_processes", "window_s"]


class LaunchInterrupted(KeyboardInterrupt):
    """Ctrl-C (the notebook's stop button) ended a launch: every rank has ended. In a notebook it shows as one
    short message, not as a traceback through the package (IPython honours _render_traceback_)."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what
        self.partial_result: Any = None  # run_training fills in the steps recorded before the interrupt

    def _render_traceback_(self) -> List[str]:
        return [f"KeyboardInterrupt: {self.what}"]


def launch(fn: Callable, world_size: int = 2, args: tuple = (), backend: str = "gloo", start_method: str = "auto",
           host: str = "127.0.0.1", port: int = 0, timeout_s: float = 60.0, threads_per_rank: Optional[int] = None,
           on_poll: Optional[Callable[[], None]] = None, poll_s: float = 0.05,
           bind_cores: Optional[bool] = None, init_group: bool = True, run_dir: Optional[str] = None,
           watch_shared: bool = True, quiet: bool = False) -> List[Any]:
    """Run fn(rank, world_size, *args) on world_size processes in one process group; return each rank's value.

    Every rank sees torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT ...) and this process's environment as it is now. The ranks meet through a store in the launch's
    private folder (only this user can open it); with init_group=False, fn can call
    dist.init_process_group("gloo") with no arguments, as a torchrun script does: it then joins a TCP store the
    launch serves on `host` (loopback by default), which, like torchrun's, any user of this machine can reach.
    start_method="auto" (the default) forks the ranks from a server that has torch imported already (forkserver,
    Linux and macOS) and uses spawn elsewhere; "spawn" and "fork" are there too. fn may be defined in a notebook
    cell: it is sent by value (cloudpickle) when it can't be imported by name; NumPy arrays over 16 MiB that it
    or args hold reach the ranks through shared memory, read-only; the data cache's tensors reach them shared,
    and a rank that changes one is named after the launch (watch_shared; ranks/starting.py: SharedWatch).
    A rank that fails, or ends without returning, ends all of them and raises RankFailedError; Ctrl-C ends them
    all and raises LaunchInterrupted (a KeyboardInterrupt); nothing a rank started outlives the call.
    bind_cores: give each gloo rank's training thread cores of its own (None = when there are enough cores).
    run_dir: the run folder each rank leaves its log, report and rows in (ranks/folders.py); by default a new
    one in the temp dir, removed at the end. A folder the caller gives (from new_run_dir()) is the caller's to
    read and remove.
    What a rank prints (print(), warnings, C++ output) is shown here as it comes, each line prefixed "[rank r] ",
    a rank's lines in the order it wrote them, up to ranks/output_shown.py's ECHO_LINES per rank; quiet=True shows none
    (it stays in the rank's log, whose last lines a failure shows). A traceback or warning from a function
    defined in a notebook cell names the cell as IPython does ("Cell In[3], line 5").
    """
    return run_plan(launch_plan(fn, world_size, args, backend, start_method, host, port, timeout_s, threads_per_rank,
                                on_poll, poll_s, bind_cores, init_group, run_dir, watch_shared, quiet), fn, args)


def run_plan(plan: LaunchPlan, fn: Callable, args: tuple = ()) -> List[Any]:
    """launch() for a plan already checked (LaunchPlan.checked: launch()'s arguments, or run_training's settings)."""
    watch = SharedWatch(_sendable(fn, args, plan.method)) if plan.watch_shared else None  # said now, before any starts
    try:
        # the run folder: the caller's, or one made (and removed) for this launch
        with EndOnSignals(), run_folder(plan.run_dir) as run_dir:
            return _launch(dataclasses.replace(plan, run_dir=run_dir), fn, args)
    finally:
        if watch is not None:
            watch.check()


def _sendable(fn: Callable, args: tuple, method: str) -> List[Any]:
    """The tensors fn and args hold; a LaunchError now, before any rank starts, if they can't travel to the ranks
    (under fork nothing travels: a forked rank has them already)."""
    try:
        return tensors_in((fn, args))
    except Exception as e:  # noqa: BLE001 - pickle fails with TypeError, PicklingError, AttributeError...
        if method == "fork":
            return []
        raise LaunchError(f"launch() can't send the function or its arguments to the ranks ({type(e).__name__}: "
                          f"{e}). Each rank is a new process that receives them pickled: a global the function "
                          "uses, or an argument, holds something that can't be (an open file, a lock, a socket, a "
                          "generator, a model on a GPU...); make it inside the function instead, or pass what it is "
                          "made from") from None


def _launch(plan: LaunchPlan, fn: Callable, args: tuple) -> List[Any]:
    """Start the ranks, watch them, end them; the values, or the failure named, or LaunchInterrupted."""
    world_size, mark = plan.world_size, plan.mark
    procs: List[Any] = []  # each rank as it starts: an interrupt between two starts still ends those running
    open_ends: List[Callable[[], None]] = []  # _supervise's socket and logs until it closes them itself
    before = PidsBefore()  # what a rank starts is among the processes that appear from now on
    try:
        outputs = _supervise(plan, fn, args, procs, open_ends)
        # every rank reported: they exit now (in the try: a Ctrl-C on this line, before end_launch defers it,
        # still ends them and lets go of their fds)
        late = end_launch(procs, mark, wait_s=10.0, before=before)
    except KeyboardInterrupt:
        _end(procs, mark, before, open_ends)
        raise LaunchInterrupted(f"stopped; all {world_size} ranks have ended") from None
    except BaseException:
        _end(procs, mark, before, open_ends)  # nothing outlives the call
        raise
    if late:
        raise LaunchInterrupted(f"stopped as the ranks finished; all {world_size} ranks have ended")
    return outputs


def _end(procs: List[Any], mark: str, before: PidsBefore, open_ends: List[Callable[[], None]]) -> None:
    """A launch that failed or was stopped: its ranks ended, then what _supervise had no time to close (a Ctrl-C
    on the line that was to defer its closing) closed."""
    end_launch(procs, mark, wait_s=0.0, before=before)
    with interrupts_deferred():
        while open_ends:
            open_ends.pop(0)()


def _supervise(plan: LaunchPlan, fn: Callable, args: tuple, procs: List[Any],
               open_ends: List[Callable[[], None]]) -> List[Any]:
    """Start the ranks (into procs) and wait for every one, showing what they print; on the first failure end them
    all (RankProcesses.join) and raise RankFailedError. No fd of it outlives the call, whenever Ctrl-C comes: what
    it opens is in open_ends until closed here (the caller closes what is left)."""
    echo = echo_for(plan.run_dir, plan.world_size, plan.quiet)
    logs = keeper_for(log_paths(plan.run_dir, plan.world_size))  # the ranks' output, capped
    open_ends.extend(filter(None, (logs and logs.close, echo and echo.finish)))  # logs first: the ranks' last words
    ranks = listener = store = None
    late: List[int] = []  # Ctrl-C while the last output is shown: once it is, the launch is interrupted
    try:
        ranks, listener, store = start_ranks(plan, fn, args, procs, logs)
        open_ends.insert(0, listener.close)
        pollers = list(filter(None, (plan.on_poll, echo and echo.poll)))  # the caller's, then what the ranks printed
        failed = ranks.watch(pollers, plan.poll_s, window_s("SETTLE_S"))
    finally:
        with interrupts_deferred() as late:
            store = None  # noqa: F841 - the ranks have ended: the port is free for the next run
            if listener is not None:
                listener.close()
            if logs is not None:
                logs.close()  # their last words logged, before the echo's last look
            if echo is not None:
                echo.finish()  # every line the ranks wrote, before their values or the error
            open_ends.clear()
    if late:
        raise KeyboardInterrupt
    if failed is None:  # every rank exited with 0: each reported its value, or the first that didn't is blamed
        if plan.on_poll is not None:
            plan.on_poll()
        reports = read_rank_reports(plan.run_dir, plan.world_size)
        failed = first_unreported(reports, plan.world_size)
        if failed is None:
            return returned_values(reports, plan.world_size)
    err = _failure(failed, ranks, plan.method, plan.run_dir, plan.world_size, echo)
    raise err from err.__cause__  # the rank's own exception, not RankExited


def _failure(first: int, context: RankProcesses, method: str, run_dir: str, world_size: int,
             echo: Optional[LaunchEcho] = None) -> RankFailedError:
    codes = [p.exitcode for p in context.processes]
    server = context.forkserver_pid
    reports = read_rank_reports(run_dir, world_size)
    for report in reports.values():  # a learner's cell as IPython names it; no control character reaches the cell
        report.traceback_text = name_cells(printable(report.traceback_text))
        report.text = printable(report.text)
    err = diagnose(reports, run_dir, world_size, first=first, codes=codes,
                   server_died=_forkserver_died(method, codes, server))
    return _tail_shown(err, echo)


def _tail_shown(err: RankFailedError, echo: Optional[LaunchEcho]) -> RankFailedError:
    """The error without the failed rank's last output when every line of it is already in the cell above."""
    if echo is None or not echo.shown_all(err.rank) or f"--- last output of rank {err.rank} ---" not in str(err):
        return err
    lean = RankFailedError(err.rank, err.message, err.traceback_text, err.original, others=err.others,
                           log_tail=f"(shown above, in its [rank {err.rank}] lines)")
    lean.__cause__ = err.__cause__
    return lean


def _forkserver_died(method: str, codes: List[Optional[int]], server: Optional[int]) -> bool:
    """True when the forkserver that forked the ranks is gone: they then read as exit code 255
    (popen_forkserver.poll), whether the server is a zombie, reaped, or already replaced by a new one."""
    if method != "forkserver" or 255 not in codes or server is None:
        return False
    if forkserver_pid() != server:
        return True
    import psutil

    # The ranks read as 255 once the server's end of their pipes closes, which a dying process does before it
    # becomes a zombie (tearing down torch's mappings takes a while): give it that long. Not reaped here:
    # multiprocessing's next ensure_running() does that and starts a new server.
    deadline = time.monotonic() + window_s("SERVER_EXIT_S")
    while True:
        try:
            if psutil.Process(server).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        if time.monotonic() > deadline:
            return False  # the server lives: a rank's own exit code 255
        time.sleep(0.02)
