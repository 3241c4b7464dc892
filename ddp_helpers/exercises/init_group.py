"""Exercise 1, init_group(rank, world_size, port): join a gloo process group that meets on `port`.

The ranks start with no process group: the learner's function makes one. Its init_process_group call is
watched, so a wrong argument is named before the ranks wait for each other at a rendezvous that can't happen.
"""
from __future__ import annotations

import datetime
import inspect
import os
import socket
import urllib.parse
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..ranks.checks import free_port
from ._errors import error_report
from ._harness import (COLLECTIVE_TIMEOUT_S, Mistake, RankReport, call_student, exercise, fail, run_ranks,
                       student_outcomes, swap_globals)

WORLD_SIZE = 2
PORT_ATTEMPTS = 3  # the free port we picked can be taken by another program before rank 0 binds it

Problem = Tuple[str, str]  # (mistake code, hint)

NUDGES = {
    "nccl_on_cpu": "these ranks have no GPUs: is your backend one that works on the CPU?",
    "bad_backend": "is your backend one that works on the CPU?",
    "wrong_rank": "two processes claim the same place in the group: which rank does each one join as?",
    "wrong_world_size": "the group is waiting for a different number of processes than are starting.",
    "no_address": "the processes don't know where to meet.",
    "fixed_port": "the processes met, but not where the checker asked them to: look at your function's "
                  "arguments.",
    "bad_host": "the address you gave is not this machine.",
    "bad_init_method": "the rendezvous address is not in a form init_process_group understands.",
    "destroyed": "the group was set up, but it is gone when your function returns.",
    "no_init": "after your function the process is not in any process group.",
    "not_one_group": "the ranks are not all in one group.",
}


def _loopback(host: Optional[str]) -> bool:
    """True when host resolves to this machine's loopback addresses only."""
    if not host:
        return False
    try:
        return all(info[4][0].startswith("127.") for info in socket.getaddrinfo(host, None, socket.AF_INET))
    except (socket.gaierror, UnicodeError):
        return False


def _backend_problem(backend: Any) -> Optional[Problem]:
    """A backend other than gloo (these ranks have CPU tensors only)."""
    if backend is not None and str(backend).lower() not in ("gloo", "cpu:gloo"):
        if "nccl" in str(backend).lower():
            return "nccl_on_cpu", ("backend='nccl' needs one GPU per rank and these ranks run on the CPU: use "
                                   "backend='gloo'.")
        return "bad_backend", f"backend={backend!r}: use 'gloo', the backend for CPU tensors."
    return None


def _membership_problem(a: Dict[str, Any], rank: int, world_size: int) -> Optional[Problem]:
    """A rank or world size other than the ones this process was given."""
    r = a.get("rank", -1)
    if r != rank:
        said = "no rank" if r in (-1, None) else f"rank={r!r}"
        return "wrong_rank", (f"rank {rank} called init_process_group with {said}: pass rank=rank (the argument "
                              "your function receives), so each process joins under its own number.")
    ws = a.get("world_size", -1)
    if ws != world_size:
        said = "no world_size" if ws in (-1, None) else f"world_size={ws!r}"
        return "wrong_world_size", (f"init_process_group got {said}, but {world_size} processes are starting: pass "
                                    "world_size=world_size, or the group waits for ranks that never come.")
    return None


def _address_problem(method: Any, port: int) -> Optional[Problem]:
    """A rendezvous that is not this machine's `port`: no address, a fixed port, another host."""
    if method is None or method == "env://":
        host, used = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not used:
            return "no_address", ("the ranks have no address to meet at: pass an init_method URL of the form "
                                  "tcp://<host>:<port> on this machine (or set MASTER_ADDR and MASTER_PORT before "
                                  "the default init_method='env://').")
        if str(used) != str(port):  # the launch's own store, set in torchrun's variables: not the one asked for
            return "no_address", (f"with no init_method, init_process_group reads MASTER_ADDR and MASTER_PORT "
                                  f"(env://), and here they name the store the check's launch opened ({used}), as "
                                  f"torchrun's would: not the `port` your function was given ({port}). Pass an "
                                  "init_method URL of the form tcp://<host>:<port> with that port.")
    elif isinstance(method, str) and method.startswith("tcp://"):
        parts = urllib.parse.urlsplit(method)
        host = parts.hostname
        try:
            used = parts.port
        except ValueError:
            used = None
        if used is None:
            return "no_address", f"init_method={method!r} has no port: add the `port` your function was given."
    elif isinstance(method, str) and method.startswith("file://"):
        return None
    else:
        return "bad_init_method", (f"init_method={method!r} is not a rendezvous URL: use one of the form "
                                   "tcp://<host>:<port>.")
    if str(used) != str(port):
        return "fixed_port", (f"the ranks met on port {used}, not on the `port` argument: a fixed port (like the "
                              "listing's 23456) collides with any other job using it. Build the URL from `port`.")
    if not _loopback(host):
        return "bad_host", f"host {host!r} is not this machine: use 127.0.0.1 (all ranks run here)."
    return None


def _init_problem(a: Dict[str, Any], rank: int, world_size: int, port: int) -> Optional[Problem]:
    """The first mistake in the arguments of an init_process_group call, or None."""
    problem = _backend_problem(a.get("backend")) or _membership_problem(a, rank, world_size)
    if problem is not None or a.get("store") is not None:
        return problem  # with a rendezvous store of the learner's own there is no address to check
    return _address_problem(a.get("init_method"), port)


def _watch_and_test(rank: int, world_size: int, student_fn: Callable, port: int) -> Dict[str, Any]:
    """In a rank with no process group yet: watch the learner's init_process_group call, then test the group."""
    original = dist.init_process_group
    signature = inspect.signature(original)
    calls: List[Dict[str, Any]] = []

    def watched(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        a = dict(bound.arguments)
        calls.append(a)
        problem = _init_problem(a, rank, world_size, port)
        if problem is not None:
            raise Mistake(*problem)
        if a.get("timeout") is None:  # a safety net: a mismatch then ends in seconds, not the default 30 min
            a["timeout"] = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        result = original(**a)
        # Every rank's group complete before any learner code runs on: a rank that destroys the group at once
        # (the "destroyed" mistake) would otherwise cut off a peer still connecting, whose error would read as
        # a collective it waited in alone (seen on a loaded machine, 2 runs in 30).
        dist.barrier()
        return result

    dist.init_process_group = watched  # this rank is a forked copy: the patch never reaches the notebook
    swap_globals(student_fn, original, watched)
    call = call_student(student_fn, rank, world_size, port)
    out: Dict[str, Any] = {"call": call, "called": bool(calls), "initialized": dist.is_initialized()}
    if call["status"] == "ok" and out["initialized"]:
        out.update(rank=dist.get_rank(), world_size=dist.get_world_size(), backend=str(dist.get_backend()))
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)  # the proof that the ranks really share one group
        out["sum"] = t.item()
        dist.destroy_process_group()
    return out


def _in_rank(rank: int, world_size: int, student_fn: Callable, port: int) -> Dict[str, Any]:
    """In each rank: the learner's call and the test of its group; a problem ends all the ranks at once."""
    # The exercise is the listing's rendezvous: rank 0 hosts the store on `port`. Under torchrun's flag (which
    # launch sets) env:// would make every rank a client of a store at MASTER_ADDR:MASTER_PORT: a learner who
    # sets MASTER_PORT=port, as mp.spawn's scripts do, would then wait for a server nobody starts.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        out = _watch_and_test(rank, world_size, student_fn, port)
    except BaseException as e:  # noqa: BLE001 - e.g. SystemExit, or our all_reduce over a broken group: a report
        out = {"call": error_report(e, student_fn)}
    if out["call"]["status"] != "ok":
        # One rank's mistake is enough, and its peers may be waiting for it at the rendezvous until their timeout.
        raise RankReport(out)
    return out


def _port_taken(outs: Sequence[Optional[Dict[str, Any]]]) -> bool:
    """True when a rank could not bind the port: another program took it after free_port() picked it."""
    return any(o is not None and o["call"]["status"] == "error" and "address already in use" in
               o["call"]["message"].lower() for o in outs)


def _run_on_a_free_port(student_fn: Callable, world_size: int) -> List[Optional[Dict[str, Any]]]:
    """The ranks' reports (None for a rank stopped early); on a new port if another program took ours."""
    for _attempt in range(PORT_ATTEMPTS):
        outs = run_ranks(_in_rank, world_size, (student_fn, free_port()), init_group=False)
        if not _port_taken(outs):
            break
    return outs


@exercise("init_group", NUDGES)
def check_init_group(student_fn: Callable, world_size: Optional[int] = None) -> str:
    """Exercise 1: init_group(rank, world_size, port) must join a gloo process group that meets on `port`."""
    world_size = world_size or WORLD_SIZE
    outs = _run_on_a_free_port(student_fn, world_size)
    student_outcomes(outs)  # a rank stopped early (None) means another reported a problem: this raises its verdict
    for r, o in enumerate(outs):
        if not o["initialized"]:
            if o["called"]:
                raise fail("destroyed", "the group was gone when your function returned: don't call "
                                        "destroy_process_group() here (that belongs at the end of training).")
            raise fail("no_init", "dist.is_initialized() is False after your function: call "
                                  "dist.init_process_group(...) in it.")
        if o["rank"] != r or o["world_size"] != world_size:
            raise fail("wrong_rank", f"process {r} joined as rank {o['rank']} of {o['world_size']}: pass "
                                     "rank=rank and world_size=world_size.")
        if o["backend"] != "gloo":
            raise fail("bad_backend", f"the group uses {o['backend']!r}: use backend='gloo' on CPU.")
    expected = world_size * (world_size + 1) / 2
    sums = [o["sum"] for o in outs]
    if any(s != expected for s in sums):
        raise fail("not_one_group", f"an all_reduce over your group gave {sums}, expected {expected} on every rank: "
                                    "the ranks are not in one group.")
    terms = " + ".join(str(r + 1) for r in range(world_size))
    return (f"all {world_size} ranks joined one gloo process group under their own numbers, and an all_reduce "
            f"across it gave {expected:g} = {terms} on each.")


