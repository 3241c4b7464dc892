"""Exercise checks: run a learner's function on real ranks, compare with a reference, and name the mistake.

Each ``check_*`` function takes the learner's function, runs it on 2 (sometimes 3) real processes, prints one
line (PASS, NOT DONE YET, or TRY AGAIN with a hint) and returns a :class:`CheckResult`.

The learner's functions live in notebook cells, so the ranks are started with ``start_method="fork"``:
spawn would have to import the function by name from a module, while fork copies the whole kernel,
cell-defined functions included. Inside a rank nothing is printed (the launcher sends the output to a log
file), so every check collects what it needs as return values and judges it here, in the parent.
"""
from __future__ import annotations

import datetime
import dis
import functools
import inspect
import linecache
import multiprocessing
import multiprocessing.connection
import os
import socket
import tempfile
import time
import traceback
import urllib.parse
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._proc import die_with_parent
from .config import ConfigError, free_port
from .launcher import LaunchError, RankFailedError, is_comm_error, launch, stop_processes
from .model import build_model

CHECK_TIMEOUT_S = 40.0  # a whole check; a learner's deadlock ends here at the latest
COLLECTIVE_TIMEOUT_S = 8.0  # a rank waiting in a collective its peer never joins fails after this long

NOT_DONE = "not_done"
NOT_DONE_HINT = "replace the `raise NotImplementedError(...)` line with your code, then run this cell again."

__all__ = [
    "EXERCISES", "NOT_DONE", "CheckResult", "check_accumulation_step", "check_average_gradients",
    "check_global_mean", "check_init_group", "check_make_loader", "check_save_checkpoint", "check_shard_indices",
    "summarize",
]


@dataclass
class CheckResult:
    """Outcome of one check: passed, the hint (or what was verified), and a short code naming the mistake."""

    exercise: str
    passed: bool
    hint: str
    mistake: str = ""  # "" when passed, NOT_DONE for a blank, else a code such as "no_divide"

    @property
    def done(self) -> bool:
        """False while the function is still the blank."""
        return self.mistake != NOT_DONE

    @property
    def message(self) -> str:
        """The line the check prints."""
        if self.passed:
            return f"PASS  {self.exercise}: {self.hint}"
        if self.mistake == NOT_DONE:
            return f"NOT DONE YET  {self.exercise}: {self.hint}"
        return f"TRY AGAIN  {self.exercise}: {self.hint}"

    def __str__(self) -> str:
        return self.message


class _Verdict(Exception):
    """Raised anywhere inside a check to end it with this outcome."""

    def __init__(self, mistake: str, hint: str, passed: bool = False):
        super().__init__(hint)
        self.mistake, self.hint, self.passed = mistake, hint, passed


def _fail(mistake: str, hint: str) -> _Verdict:
    return _Verdict(mistake, hint)


class _Mistake(Exception):
    """Raised inside a rank by an instrumented call that has already seen the mistake (e.g. a wrong rank)."""

    def __init__(self, mistake: str, hint: str):
        super().__init__(hint)
        self.mistake, self.hint = mistake, hint


# ---------------------------------------------------------------------------------------------------- plumbing
def _model(seed: int) -> torch.nn.Module:
    """build_model for the parent's references, without moving the notebook's global random state."""
    with torch.random.fork_rng(devices=[]):
        return build_model(seed)


def _is_blank(fn: Callable) -> bool:
    """True for a function whose body is only `...`, `pass` and/or a docstring."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return False
    ops = [(i.opname, i.argval) for i in dis.get_instructions(code) if i.opname not in ("RESUME", "NOP", "CACHE")]
    return ops in ([("LOAD_CONST", None), ("RETURN_VALUE", None)], [("RETURN_CONST", None)])


def _where(exc: BaseException, fn: Callable) -> str:
    """' at `<source line>`' for the deepest frame of the learner's function in exc's traceback, else ''."""
    code = getattr(fn, "__code__", None)
    found = ""
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        if code is not None and frame.f_code.co_filename == code.co_filename:
            line = linecache.getline(frame.f_code.co_filename, lineno).strip()
            if line:
                found = f" at `{line}`"
    return found


def _call(fn: Callable, *args: Any) -> Dict[str, Any]:
    """Run the learner's function inside a rank; turn whatever it raises into data the parent can judge."""
    try:
        return {"status": "ok", "value": fn(*args)}
    except NotImplementedError:
        return {"status": NOT_DONE}
    except _Mistake as e:
        return {"status": "mistake", "mistake": e.mistake, "hint": e.hint}
    except Exception as e:  # noqa: BLE001 - any error of the learner's code becomes a hint, not a traceback
        return {"status": "error", "type": type(e).__name__, "message": str(e).strip().splitlines()[0][:300]
                if str(e).strip() else "", "where": _where(e, fn),
                "comm": is_comm_error(f"{type(e).__name__}: {e}")}


class _Deadline:
    """on_poll callback for launch: ends a check that takes too long (a deadlock in the learner's code)."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def __call__(self) -> None:
        if time.monotonic() > self.end:
            raise TimeoutError("check deadline")


def _timeout_verdict() -> _Verdict:
    return _fail("timeout", f"your function did not finish within {CHECK_TIMEOUT_S:.0f} s on every rank: a "
                            "collective that only some ranks call waits forever (e.g. an all_reduce inside "
                            "`if rank == 0:`). Every rank must call the same collectives in the same order.")


def _launch(harness: Callable, world_size: int, args: tuple) -> List[Dict[str, Any]]:
    """Run harness(rank, world_size, *args) on real forked ranks in a gloo group; return the per-rank dicts."""
    try:
        return launch(harness, world_size=world_size, args=args, backend="gloo", start_method="fork",
                      timeout_s=COLLECTIVE_TIMEOUT_S, threads_per_rank=1, on_poll=_Deadline(CHECK_TIMEOUT_S))
    except TimeoutError:
        raise _timeout_verdict() from None
    except (LaunchError, ConfigError) as e:
        raise _fail("cannot_launch", f"the check could not start its processes: {e}") from None
    except RankFailedError as e:
        raise _fail("rank_died", f"rank {e.rank}'s process ended before reporting ({e.message}): does your "
                                 "function call exit(), os._exit() or destroy the process group?") from None


def _student_outcomes(outs: Sequence[Dict[str, Any]], key: str = "call") -> List[Dict[str, Any]]:
    """The learner's call on each rank; raises the verdict for a blank, a known mistake or an error."""
    calls = [o[key] for o in outs]
    if any(c["status"] == NOT_DONE for c in calls):
        raise _fail(NOT_DONE, NOT_DONE_HINT)
    for c in calls:
        if c["status"] == "mistake":
            raise _fail(c["mistake"], c["hint"])
    errors = {r: c for r, c in enumerate(calls) if c["status"] == "error"}
    if errors:
        own = {r: c for r, c in errors.items() if not c["comm"]}
        if not own:  # only lost peers: someone waited in a collective the others never joined
            r = min(errors)
            others = [x for x in range(len(calls)) if x not in errors]
            who = f"rank {others[0]}" if others else "another rank"
            raise _fail("collective_mismatch",
                        f"rank {r} waited in a collective that {who} never joined: every rank must call the same "
                        "collectives (all_reduce, barrier, ...) in the same order, e.g. no all_reduce inside "
                        "`if rank == 0:`.")
        r = min(own)
        c = own[r]
        raise _fail("error", f"your function raised {c['type']} on rank {r}{c['where']}: {c['message']}")
    return calls


def _run_checked(exercise: str, body: Callable[[], str], student_fn: Any, quiet: bool) -> CheckResult:
    try:
        if not callable(student_fn):
            raise _fail("not_callable", f"pass your function itself (e.g. check(my_function)), not "
                                        f"{type(student_fn).__name__}")
        if _is_blank(student_fn):
            raise _fail(NOT_DONE, "the function body is still empty: write your code in it, then run this cell "
                                  "again.")
        result = CheckResult(exercise, True, body())
    except _Verdict as v:
        result = CheckResult(exercise, v.passed, v.hint, "" if v.passed else v.mistake)
    if not quiet:
        print(result.message)
    return result


def _exercise(name: str) -> Callable:
    """Decorator: turn a body (raising _Verdict, returning a PASS text) into a printing, CheckResult check."""

    def deco(body: Callable) -> Callable:
        @functools.wraps(body)
        def check(student_fn: Callable, quiet: bool = False) -> CheckResult:
            return _run_checked(name, lambda: body(student_fn), student_fn, quiet)

        check.exercise = name  # type: ignore[attr-defined]
        return check

    return deco


def _fmt(a: Any) -> str:
    """Short, rounded, deterministic text for a small array."""
    arr = np.asarray(a, dtype=np.float64).ravel()
    return "[" + ", ".join(f"{x:.4g}" for x in arr[:6]) + (", ..." if arr.size > 6 else "") + "]"


def _close(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-7) -> bool:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=rtol, atol=atol))


def _rel_close(a: Any, b: Any, tol: float = 2e-3) -> bool:
    """Equal up to float32 rounding amplified by a subtraction: relative error of the whole vector."""
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    if a.shape != b.shape:
        return False
    scale = max(np.linalg.norm(b), 1e-12)
    return bool(np.linalg.norm(a - b) / scale < tol)


def _swap_globals(fn: Callable, original: Any, replacement: Any) -> None:
    """Inside a forked rank only: names in fn's module bound to `original` now point at `replacement`."""
    g = getattr(fn, "__globals__", None)
    if not isinstance(g, dict):
        return
    for k, v in list(g.items()):
        if v is original:
            g[k] = replacement


# ---------------------------------------------------------------------------------- 1. init_process_group
def _loopback(host: Optional[str]) -> bool:
    if not host:
        return False
    try:
        return all(info[4][0].startswith("127.") for info in socket.getaddrinfo(host, None, socket.AF_INET))
    except (socket.gaierror, UnicodeError):
        return False


def _init_problem(a: Dict[str, Any], rank: int, world_size: int, port: int) -> Optional[Tuple[str, str]]:
    """The first mistake in the arguments of an init_process_group call, as (code, hint), or None."""
    backend = a.get("backend")
    if backend is not None and str(backend).lower() not in ("gloo", "cpu:gloo"):
        if "nccl" in str(backend).lower():
            return "nccl_on_cpu", ("backend='nccl' needs one GPU per rank and these ranks run on the CPU: use "
                                   "backend='gloo'.")
        return "bad_backend", f"backend={backend!r}: use 'gloo', the backend for CPU tensors."
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
    if a.get("store") is not None:
        return None  # the learner brought their own rendezvous store: nothing more to check here
    method = a.get("init_method")
    if method is None or method == "env://":
        host, p = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not p:
            return "no_address", ("the ranks have no address to meet at: pass init_method=f'tcp://127.0.0.1:{port}' "
                                  "(or set MASTER_ADDR and MASTER_PORT before the default init_method='env://').")
        used: Any = p
    elif isinstance(method, str) and method.startswith("tcp://"):
        parts = urllib.parse.urlsplit(method)
        host = parts.hostname
        try:
            used = parts.port
        except ValueError:
            used = None
        if used is None:
            return "no_address", f"init_method={method!r} has no port: use f'tcp://127.0.0.1:{{port}}'."
    elif isinstance(method, str) and method.startswith("file://"):
        return None
    else:
        return "bad_init_method", (f"init_method={method!r} is not a rendezvous URL: use "
                                   "f'tcp://127.0.0.1:{port}'.")
    if str(used) != str(port):
        return "fixed_port", (f"the ranks met on port {used}, not on the `port` argument: a fixed port (like the "
                              "listing's 23456) collides with any other job using it. Use "
                              "init_method=f'tcp://127.0.0.1:{port}'.")
    if not _loopback(host):
        return "bad_host", f"host {host!r} is not this machine: use 127.0.0.1 (all ranks run here)."
    return None


def _init_harness(rank: int, world_size: int, student_fn: Callable, port: int) -> Dict[str, Any]:
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
            raise _Mistake(*problem)
        if a.get("timeout") is None:  # a safety net: a mismatch then ends in seconds, not the default 30 min
            a["timeout"] = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        return original(**a)

    dist.init_process_group = watched  # this rank is a forked copy: the patch never reaches the notebook
    _swap_globals(student_fn, original, watched)
    call = _call(student_fn, rank, world_size, port)
    out: Dict[str, Any] = {"call": call, "called": bool(calls), "initialized": dist.is_initialized()}
    if call["status"] == "ok" and out["initialized"]:
        out.update(rank=dist.get_rank(), world_size=dist.get_world_size(), backend=str(dist.get_backend()))
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)  # the proof that the ranks really share one group
        out["sum"] = t.item()
        dist.destroy_process_group()
    return out


def _bare_entry(rank: int, world_size: int, harness: Callable, args: tuple, results: Any) -> None:
    """A forked rank without a process group (the learner creates it); reports one dict, then exits."""
    die_with_parent()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # a rank never prints into the notebook (its C++ log lines included)
    os.dup2(devnull, 2)
    torch.set_num_threads(1)
    try:
        out = harness(rank, world_size, *args)
    except BaseException as e:  # noqa: BLE001 - report, never print
        out = {"call": {"status": "error", "type": type(e).__name__, "message": str(e)[:300], "where": "",
                        "comm": is_comm_error(str(e))}}
    results.put((rank, out))
    os._exit(0)  # skip interpreter teardown: a half-made group can hang in destructors


def _run_without_group(harness: Callable, world_size: int, args: tuple) -> List[Optional[Dict[str, Any]]]:
    """Fork world_size ranks with no process group; stop early when one reports a problem."""
    if torch.cuda.is_initialized():
        raise _fail("cannot_launch", "CUDA is initialized in this kernel, so forked ranks can't start: restart the "
                                     "kernel and run the exercises before touching CUDA.")
    ctx = multiprocessing.get_context("fork")
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=_bare_entry, args=(r, world_size, harness, args, results), daemon=True)
             for r in range(world_size)]
    outs: List[Optional[Dict[str, Any]]] = [None] * world_size
    deadline = time.monotonic() + CHECK_TIMEOUT_S
    try:
        for p in procs:
            p.start()
        while any(o is None for o in outs):
            if time.monotonic() > deadline:
                raise _timeout_verdict()
            multiprocessing.connection.wait([results._reader] + [p.sentinel for p in procs], 0.05)
            while not results.empty():
                r, out = results.get()
                outs[r] = out
            if any(o is not None and o["call"]["status"] != "ok" for o in outs):
                break  # one rank's mistake is enough; the others may be waiting for it at the rendezvous
            if any(p.exitcode is not None and outs[r] is None for r, p in enumerate(procs)):
                time.sleep(0.2)  # its report may still be in the pipe
                while not results.empty():
                    r, out = results.get()
                    outs[r] = out
                if any(p.exitcode is not None and outs[r] is None for r, p in enumerate(procs)):
                    dead = next(r for r, p in enumerate(procs) if p.exitcode is not None and outs[r] is None)
                    raise _fail("rank_died", f"rank {dead}'s process ended without reporting: does your function "
                                             "call exit() or os._exit()?")
    finally:
        stop_processes(procs, grace_s=1.0)
    return outs


def _port_taken(outs: Sequence[Optional[Dict[str, Any]]]) -> bool:
    return any(o is not None and o["call"]["status"] == "error" and "address already in use" in
               o["call"]["message"].lower() for o in outs)


@_exercise("init_group")
def check_init_group(student_fn: Callable) -> str:
    """Exercise 1: init_group(rank, world_size, port) must join a gloo process group that meets on `port`."""
    world_size = 2
    for _attempt in range(3):  # the free port we picked can be taken by another program before rank 0 binds it
        outs = _run_without_group(_init_harness, world_size, (student_fn, free_port()))
        if not _port_taken(outs):
            break
    reported = [o for o in outs if o is not None]
    _student_outcomes(reported)
    if len(reported) < world_size:
        raise _fail("error", "a rank did not finish its check")  # not reached: the loop waits for all
    for r, o in enumerate(outs):
        if not o["initialized"]:
            if o["called"]:
                raise _fail("destroyed", "the group was gone when your function returned: don't call "
                                         "destroy_process_group() here (that belongs at the end of training).")
            raise _fail("no_init", "dist.is_initialized() is False after your function: call "
                                   "dist.init_process_group(...) in it.")
        if o["rank"] != r or o["world_size"] != world_size:
            raise _fail("wrong_rank", f"process {r} joined as rank {o['rank']} of {o['world_size']}: pass "
                                      "rank=rank and world_size=world_size.")
        if o["backend"] != "gloo":
            raise _fail("bad_backend", f"the group uses {o['backend']!r}: use backend='gloo' on CPU.")
    expected = world_size * (world_size + 1) / 2
    sums = [o["sum"] for o in outs]
    if any(s != expected for s in sums):
        raise _fail("not_one_group", f"an all_reduce over your group gave {sums}, expected {expected} on every rank: "
                                     "the ranks are not in one group.")
    return (f"both ranks joined one gloo process group (rank 0 and rank 1 of {world_size}), and an all_reduce "
            f"across it gave {expected:g} = 1 + 2 on each.")


# --------------------------------------------------------------------------------------- 2. all_reduce mean
MEAN_VALUES = ([1.0, 8.0], [5.0, 2.0], [9.0, -1.0])  # rank r's tensor; sum, max, mean, min all tell apart


def _mean_harness(rank: int, world_size: int, student_fn: Callable) -> Dict[str, Any]:
    value = torch.tensor(MEAN_VALUES[rank])
    call = _call(student_fn, value)
    if call["status"] == "ok":
        v = call["value"]
        call["value"] = None if v is None else torch.as_tensor(v, dtype=torch.float64).reshape(-1).tolist()
    return {"call": call, "input_after": value.tolist()}


def _mean_diagnosis(outs: List[Dict[str, Any]], world_size: int) -> Optional[_Verdict]:
    calls = _student_outcomes(outs)
    vals = np.array(MEAN_VALUES[:world_size])
    mean, total = vals.mean(0), vals.sum(0)
    got = [c["value"] for c in calls]
    if any(g is None for g in got):
        if all(_close(o["input_after"], mean) for o in outs):
            return _fail("no_return", "the mean is in the tensor you all_reduce'd, but your function returned None: "
                                      "add `return value`.")
        return _fail("no_return", "your function returned None: return the averaged tensor.")
    if any(len(g) != len(mean) for g in got):
        return _fail("wrong_shape", f"expected a tensor of {len(mean)} numbers, got {[len(g) for g in got]}.")
    if all(_close(g, mean) for g in got):
        return None
    if all(_close(g, total) for g in got):
        return _fail("no_divide", f"every rank got the sum {_fmt(total)}, not the mean {_fmt(mean)}: divide by "
                                  "dist.get_world_size() after the all_reduce.")
    if all(_close(g, total / world_size ** 2) for g in got):
        return _fail("divided_twice", f"every rank got {_fmt(total / world_size ** 2)}, world_size times smaller "
                                      "than the mean: you divided twice (ReduceOp.AVG already divides).")
    if all(_close(g, vals.max(0)) for g in got):
        return _fail("op_max", f"every rank got the element-wise maximum {_fmt(vals.max(0))}: use "
                               "op=dist.ReduceOp.SUM (the default), then divide by the world size.")
    if all(_close(g, vals[r]) for r, g in enumerate(got)):
        return _fail("no_allreduce", "each rank returned its own value: call dist.all_reduce(value) so the ranks "
                                     "combine their tensors.")
    if all(_close(g, vals[r] / world_size) for r, g in enumerate(got)):
        return _fail("no_allreduce", "each rank divided its own value but never combined them: call "
                                     "dist.all_reduce(value) before dividing.")
    if not all(_close(g, got[0]) for g in got):
        return _fail("ranks_differ", f"the ranks disagree: rank 0 got {_fmt(got[0])}, rank 1 got {_fmt(got[1])}; "
                                     f"every rank should get the mean {_fmt(mean)}.")
    return _fail("wrong_value", f"every rank got {_fmt(got[0])}, expected the mean {_fmt(mean)}.")


def _check_on_2_and_3_ranks(harness: Callable, diagnose: Callable, student_fn: Callable) -> None:
    """Run on 2 ranks, then on 3: an answer right on 2 but wrong on 3 has the world size hard-coded."""
    verdict = diagnose(_launch(harness, 2, (student_fn,)), 2)
    if verdict is not None:
        raise verdict
    verdict = diagnose(_launch(harness, 3, (student_fn,)), 3)
    if verdict is not None:
        if verdict.mistake in ("no_divide", "divided_twice", "wrong_value"):
            raise _fail("hardcoded_world_size", "right on 2 ranks but wrong on 3: divide by dist.get_world_size(), "
                                                "not a fixed 2.")
        raise verdict


@_exercise("global_mean")
def check_global_mean(student_fn: Callable) -> str:
    """Exercise 2: global_mean(value) must return the element-wise mean of value over all ranks."""
    _check_on_2_and_3_ranks(_mean_harness, _mean_diagnosis, student_fn)
    return "every rank gets the mean, on 2 ranks and on 3."


# ------------------------------------------------------------------------------------------ 3. shard indices
SHARD_SEED = 7


def _shard_harness(rank: int, world_size: int, student_fn: Callable) -> Dict[str, Any]:
    cases = {"n12_e0": (12, 0, SHARD_SEED), "n12_e1": (12, 1, SHARD_SEED), "n12_e0_again": (12, 0, SHARD_SEED),
             "n12_seed": (12, 0, SHARD_SEED + 100), "n11_e0": (11, 0, SHARD_SEED)}
    out: Dict[str, Any] = {}
    for key, (n, epoch, seed) in cases.items():
        call = _call(student_fn, n, rank, world_size, epoch, seed)
        if call["status"] == "ok":
            try:
                call["value"] = [int(i) for i in torch.as_tensor(call["value"]).reshape(-1).tolist()]
            except (TypeError, ValueError, RuntimeError):
                call = {"status": "mistake", "mistake": "not_indices",
                        "hint": f"return a list (or tensor) of ints, not {type(call['value']).__name__}."}
        out[key] = call
        if call["status"] != "ok":
            out["call"] = call
            return out
    out["call"] = {"status": "ok"}
    return out


def _check_split(shards: List[List[int]], n: int, world_size: int) -> None:
    """Raise the verdict for the first problem of one epoch's shards (one list per rank)."""
    for r, s in enumerate(shards):
        bad = [i for i in s if not 0 <= i < n]
        if bad:
            raise _fail("out_of_range", f"rank {r} got index {bad[0]}, but the data set has indices 0..{n - 1}.")
    if all(sorted(s) == list(range(n)) for s in shards):
        raise _fail("every_rank_all", f"every rank got all {n} indices (the listing's bug: no sampler): keep only "
                                      "this rank's 1/world_size share, e.g. perm[rank::world_size].")
    lengths = [len(s) for s in shards]
    if len(set(lengths)) > 1:
        raise _fail("unequal_lengths", f"n={n}: the ranks got {lengths} indices. A rank with fewer batches "
                                       "finishes early and the others wait for it forever in the all-reduce: pad "
                                       "to ceil(n / world_size) each by repeating the first indices.")
    per_rank = -(-n // world_size)
    counts = np.bincount([i for s in shards for i in s], minlength=n)
    repeats = int((counts - 1).clip(min=0).sum())  # padding allows per_rank * world_size - n of them
    overlap = set(shards[0]).intersection(*map(set, shards[1:])) if len(shards) > 1 else set()
    if repeats > max(per_rank * world_size - n, 0):
        raise _fail("overlap", f"n={n}: ranks 0 and 1 share {len(overlap)} indices. Shuffle with the same seed on "
                               "every rank (seed + epoch, not rank), then split that one permutation: "
                               "perm[rank::world_size].")
    missing = sorted(set(range(n)) - {i for s in shards for i in s})
    if missing:
        raise _fail("not_covering", f"n={n}: indices {missing[:5]} are never used by any rank: every sample must "
                                    "be in some rank's shard (pad with repeats instead of dropping).")
    if lengths[0] != per_rank:
        raise _fail("unequal_lengths", f"n={n}: each rank got {lengths[0]} indices, expected ceil(n / world_size) "
                                       f"= {per_rank}.")


@_exercise("shard_indices")
def check_shard_indices(student_fn: Callable) -> str:
    """Exercise 3: shard_indices(n, rank, world_size, epoch, seed): disjoint, covering, equal, reshuffled."""
    outs = _launch(_shard_harness, 2, (student_fn,))
    _student_outcomes(outs)
    ranks = [{k: v["value"] for k, v in o.items() if k != "call"} for o in outs]
    _check_split([r["n12_e0"] for r in ranks], 12, 2)
    if all(r["n12_e0"] == sorted(r["n12_e0"]) for r in ranks):
        raise _fail("not_shuffled", "each rank's indices come in increasing order: shuffle them, with a "
                                    "torch.Generator seeded with seed + epoch.")
    if any(r["n12_e0_again"] != r["n12_e0"] for r in ranks):
        raise _fail("nondeterministic", "the same (n, rank, epoch, seed) gave a different order the second time, "
                                        "so the ranks can't agree on one permutation: use a torch.Generator seeded "
                                        "with seed + epoch, not the global random state.")
    _check_split([r["n12_e1"] for r in ranks], 12, 2)
    if all(r["n12_e1"] == r["n12_e0"] for r in ranks):
        raise _fail("same_every_epoch", "epoch 1 repeats epoch 0's order: mix the epoch into the generator's seed "
                                        "(that is what sampler.set_epoch(epoch) does).")
    if all(r["n12_seed"] == r["n12_e0"] for r in ranks):
        raise _fail("seed_ignored", "a different seed gave the same order: seed the generator with seed + epoch.")
    _check_split([r["n11_e0"] for r in ranks], 11, 2)
    return ("disjoint shards of equal length that cover the data set (11 samples: 6 each, one repeated), "
            "reshuffled every epoch and reproducible from the seed.")


# ----------------------------------------------------------------------------------------- 4. the DataLoader
LOADER_N, LOADER_BATCH = 40, 4


def _loader_harness(rank: int, world_size: int, student_fn: Callable) -> Dict[str, Any]:
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    # Each sample's label is its own index, so the batches say exactly which samples a rank saw.
    dataset = TensorDataset(torch.arange(LOADER_N, dtype=torch.float32).unsqueeze(1), torch.arange(LOADER_N))
    out: Dict[str, Any] = {}
    for key, epoch in (("e0", 0), ("e1", 1), ("e0_again", 0)):
        call = _call(student_fn, dataset, rank, world_size, LOADER_BATCH, epoch)
        if call["status"] == "ok":
            loader = call["value"]
            if not isinstance(loader, DataLoader):
                call = {"status": "mistake", "mistake": "not_a_loader",
                        "hint": f"return the DataLoader, not {type(loader).__name__}."}
            else:
                sampler = loader.sampler
                info: Dict[str, Any] = {"sampler": type(sampler).__name__,
                                        "distributed": isinstance(sampler, DistributedSampler)}
                if info["distributed"]:
                    info.update(rank=sampler.rank, num_replicas=sampler.num_replicas, epoch=sampler.epoch,
                                shuffle=sampler.shuffle, seed=sampler.seed)
                try:
                    batches = [[int(i) for i in y.reshape(-1).tolist()] for _, y in loader]
                except Exception as e:  # noqa: BLE001
                    batches = None
                    call = {"status": "error", "type": type(e).__name__, "message": str(e)[:300],
                            "where": " while iterating your DataLoader", "comm": False}
                info["batches"] = batches
                if call["status"] == "ok":
                    call["value"] = info
        out[key] = call
        if call["status"] != "ok":
            out["call"] = call
            return out
    out["call"] = {"status": "ok"}
    return out


@_exercise("make_loader")
def check_make_loader(student_fn: Callable) -> str:
    """Exercise 4: make_loader(dataset, rank, world_size, batch_size, epoch) with DistributedSampler + set_epoch."""
    world_size = 2
    outs = _launch(_loader_harness, world_size, (student_fn,))
    try:
        _student_outcomes(outs)
    except _Verdict as v:
        if v.mistake == "error" and "mutually exclusive" in v.hint:
            raise _fail("shuffle_and_sampler", "DataLoader(shuffle=True) can't be combined with a sampler: the "
                                               "DistributedSampler does the shuffling, so drop shuffle=True.") from None
        raise
    infos = [{k: v["value"] for k, v in o.items() if k != "call"} for o in outs]
    seen = {k: [[i for b in info[k]["batches"] for i in b] for info in infos] for k in ("e0", "e1", "e0_again")}
    e0 = infos[0]["e0"]
    if not all(info["e0"]["distributed"] for info in infos):
        if all(sorted(s) == list(range(LOADER_N)) for s in seen["e0"]):
            raise _fail("no_sampler", f"every rank iterates all {LOADER_N} samples (Listing 7.2's bug): pass "
                                      "sampler=DistributedSampler(dataset, num_replicas=world_size, rank=rank) to "
                                      "the DataLoader.")
        raise _fail("no_sampler", f"the loader uses a {e0['sampler']}: use "
                                  "torch.utils.data.DistributedSampler(dataset, num_replicas=world_size, rank=rank).")
    for r, info in enumerate(infos):
        if info["e0"]["num_replicas"] != world_size:
            raise _fail("wrong_replicas", f"rank {r}'s sampler has num_replicas={info['e0']['num_replicas']}: pass "
                                          "num_replicas=world_size.")
        if info["e0"]["rank"] != r:
            raise _fail("wrong_rank", f"rank {r}'s sampler was built with rank={info['e0']['rank']}, so two ranks "
                                      "read the same shard: pass rank=rank.")
    if len({info["e0"]["seed"] for info in infos}) > 1:
        raise _fail("seed_per_rank", "the ranks' samplers have different seeds, so their shuffles overlap: give every "
                                     "rank the same seed (the default 0 is fine).")
    sizes = [len(b) for info in infos for b in info["e0"]["batches"]]
    if sizes and sizes[0] != LOADER_BATCH:
        raise _fail("batch_size", f"the first batch has {sizes[0]} samples, expected batch_size={LOADER_BATCH}: pass "
                                  "batch_size=batch_size to the DataLoader.")
    if not all(info["e0"]["shuffle"] for info in infos):
        raise _fail("not_shuffled", "the sampler was built with shuffle=False, so every epoch has the same order: "
                                    "keep DistributedSampler's default shuffle=True.")
    if any(info["e1"]["epoch"] != 1 for info in infos) or all(a == b for a, b in zip(seen["e0"], seen["e1"])):
        raise _fail("no_set_epoch", "epoch 1 repeats epoch 0's order: call sampler.set_epoch(epoch) before "
                                    "iterating (DistributedSampler reshuffles only when told the epoch).")
    for k in ("e0", "e1"):
        union = set(seen[k][0]) | set(seen[k][1])
        if set(seen[k][0]) & set(seen[k][1]) or union != set(range(LOADER_N)):
            raise _fail("overlap", f"in epoch {k[1]} the ranks' samples overlap or miss some: pass rank=rank and "
                                   "num_replicas=world_size to DistributedSampler.")
    if seen["e0_again"] != seen["e0"]:
        raise _fail("nondeterministic", "asking for epoch 0 twice gave two different orders: let the "
                                        "DistributedSampler shuffle (seeded), not the DataLoader.")
    return (f"each rank reads its own {LOADER_N // world_size} of the {LOADER_N} samples in batches of "
            f"{LOADER_BATCH}, and set_epoch gives every epoch a new order.")


# ----------------------------------------------------------------------------------- 5. average gradients
GRAD_BATCH = 16


def _rank_batch(rank: int, k: int, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A batch that differs by rank (and by k), the same every time it is asked for."""
    g = torch.Generator().manual_seed(1000 + 97 * rank + k)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def _grads(model: torch.nn.Module) -> List[Optional[List[float]]]:
    return [None if p.grad is None else p.grad.detach().clone().reshape(-1).double().numpy() for p in model.parameters()]


def _avg_harness(rank: int, world_size: int, student_fn: Callable) -> Dict[str, Any]:
    model = build_model(seed=0)
    x, y = _rank_batch(rank, 0, GRAD_BATCH)
    F.cross_entropy(model(x), y).backward()
    local = _grads(model)
    grad_ptrs = {p.grad.data_ptr() for p in model.parameters()}
    param_ptrs = {p.data_ptr() for p in model.parameters()}
    reduced: List[str] = []  # what each all_reduce was given: "grad", "param" or "other"
    real_all_reduce = dist.all_reduce

    def watched(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
        ptr = tensor.data_ptr()
        reduced.append("grad" if ptr in grad_ptrs else "param" if ptr in param_ptrs else "other")
        return real_all_reduce(tensor, *a, **k)

    dist.all_reduce = watched  # a forked rank: the patch never reaches the notebook
    _swap_globals(student_fn, real_all_reduce, watched)
    call = _call(student_fn, model)
    dist.all_reduce = real_all_reduce
    call.pop("value", None)  # the function works in place; its return value is not used
    return {"call": call, "local": local, "after": _grads(model), "names": [n for n, _ in model.named_parameters()],
            "reduced": reduced}


def _avg_diagnosis(outs: List[Dict[str, Any]], world_size: int) -> Optional[_Verdict]:
    _student_outcomes(outs)
    names = outs[0]["names"]
    n_params = len(names)
    local = [[np.asarray(g) for g in o["local"]] for o in outs]
    after = [o["after"] for o in outs]
    if any(a is None for o in after for a in o):
        return _fail("grad_removed", "some p.grad is None after your function: average the gradients in place "
                                     "(all_reduce p.grad, then divide), don't delete them.")
    # The reference: one process on the global batch (every rank's batch). Equal batch sizes make it the mean.
    mean = _reference_grads(world_size, [0], GRAD_BATCH)
    candidates = {
        "mean": lambda r, i: mean[i],
        "sum": lambda r, i: mean[i] * world_size,
        "twice": lambda r, i: mean[i] / world_size,
        "max": lambda r, i: np.max([local[q][i] for q in range(world_size)], axis=0),
        "local": lambda r, i: local[r][i],
        "local_div": lambda r, i: local[r][i] / world_size,
    }

    def label(r: int, i: int) -> str:
        return next((k for k, f in candidates.items() if _close(after[r][i], f(r, i))), "other")

    labels = [[label(r, i) for i in range(n_params)] for r in range(world_size)]
    flat = {lab for row in labels for lab in row}
    if flat == {"mean"}:
        return None
    if flat <= {"local", "local_div"} and any("param" in o["reduced"] for o in outs):
        return _fail("reduced_params", "you all_reduce'd the parameters, not their gradients: all_reduce p.grad, "
                                       "not p (or p.data).")
    if flat == {"sum"}:
        return _fail("no_divide", f"rank 1's gradients equal rank 0's but are {world_size}x the mean (the sum): "
                                  "divide every p.grad by dist.get_world_size() after the all_reduce.")
    if flat == {"twice"}:
        return _fail("divided_twice", f"the gradients are {world_size}x smaller than the mean: you divided twice "
                                      "(ReduceOp.AVG already divides; or a division before and after the "
                                      "all_reduce).")
    if flat == {"max"}:
        return _fail("op_max", "every rank holds the element-wise maximum of the gradients: use "
                               "op=dist.ReduceOp.SUM and divide by the world size (or ReduceOp.AVG).")
    if flat == {"local"}:
        return _fail("no_allreduce", "the gradients are unchanged, so rank 1's still differ from rank 0's: call "
                                     "dist.all_reduce(p.grad) for every parameter.")
    if flat == {"local_div"}:
        return _fail("no_allreduce", "each rank divided its own gradient but never combined them: call "
                                     "dist.all_reduce(p.grad) before dividing.")
    ok = [names[i] for i in range(n_params) if all(labels[r][i] == "mean" for r in range(world_size))]
    if ok:
        missed = [names[i] for i in range(n_params) if names[i] not in ok]
        return _fail("some_params", f"only some parameters were averaged ({', '.join(ok)}; not "
                                    f"{', '.join(missed)}): loop over all of model.parameters().")
    if any(not _close(after[r][i], after[0][i]) for r in range(1, world_size) for i in range(n_params)):
        return _fail("ranks_differ", "rank 1's gradients differ from rank 0's after your function: every rank must "
                                     "end with the same, averaged gradient (all_reduce, then divide by the world "
                                     "size).")
    return _fail("wrong_value", "all ranks agree, but not on the mean of their gradients: all_reduce with "
                                "ReduceOp.SUM, then divide by the world size.")


@_exercise("average_gradients")
def check_average_gradients(student_fn: Callable) -> str:
    """Exercise 5: average_gradients(model) must leave every rank's p.grad equal to the mean over ranks."""
    _check_on_2_and_3_ranks(_avg_harness, _avg_diagnosis, student_fn)
    return ("after your function every rank holds the mean gradient (the single-process gradient of the global "
            "batch), on 2 ranks and on 3.")


# ---------------------------------------------------------------------------------- 6. no_sync accumulation
ACC_MICRO, ACC_BATCH, ACC_LR = 3, 8, 0.5


def _acc_harness(rank: int, world_size: int, student_fn: Callable) -> Dict[str, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model(seed=0)
    ddp = DDP(model)
    calls = [0]

    def counting_hook(state, bucket):  # no annotations: DDP checks them, and here they would be strings
        calls[0] += 1  # one call per bucket per synchronized backward (this model fits in one bucket)
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=ACC_LR)
    steps = [0]
    optimizer.register_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
    micro = [_rank_batch(rank, k, ACC_BATCH) for k in range(ACC_MICRO)]
    call = _call(student_fn, ddp, optimizer, micro)
    call.pop("value", None)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().numpy()
    return {"call": call, "allreduces": calls[0], "steps": steps[0], "params": params}


def _reference_grads(world_size: int, micro_ids: Sequence[int], batch: int) -> List[np.ndarray]:
    """One process, per parameter: the gradient of the mean loss over the given batches of every rank."""
    model = _model(0)
    xs, ys = zip(*[_rank_batch(r, k, batch) for r in range(world_size) for k in micro_ids])
    F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
    return [p.grad.reshape(-1).double().numpy() for p in model.parameters()]


def _reference_grad(world_size: int, micro_ids: Sequence[int], scale: float) -> np.ndarray:
    """The same over the accumulation exercise's micro-batches, as one flat vector, times scale."""
    return np.concatenate(_reference_grads(world_size, micro_ids, ACC_BATCH)) * scale


@_exercise("accumulation_step")
def check_accumulation_step(student_fn: Callable) -> str:
    """Exercise 6: accumulation_step(ddp_model, optimizer, micro_batches) with no_sync on all but the last."""
    world_size = 2
    outs = _launch(_acc_harness, world_size, (student_fn,))
    _student_outcomes(outs)
    steps, calls = outs[0]["steps"], outs[0]["allreduces"]
    if steps == 0:
        raise _fail("no_step", "optimizer.step() was never called: call it once, after the last micro-batch's "
                               "backward.")
    if steps > 1:
        raise _fail("step_each", f"optimizer.step() ran {steps} times: accumulate over all {ACC_MICRO} "
                                 "micro-batches, then step once.")
    p0 = torch.cat([p.detach().reshape(-1) for p in _model(0).parameters()]).double().numpy()
    used = [(p0 - o["params"]) / ACC_LR for o in outs]  # the gradient each rank's SGD step actually applied
    if calls == 0:
        raise _fail("no_sync_everywhere", "no all-reduce happened, so each rank stepped with its own gradient and "
                                          "the replicas now differ: run the last micro-batch's backward outside "
                                          "ddp_model.no_sync().")
    if not all(_rel_close(u, used[0], 1e-6) for u in used):
        raise _fail("ranks_differ", "the ranks' parameters differ after the step: every rank must run the same "
                                    "number of synchronized backward passes.")
    expected = _reference_grad(world_size, range(ACC_MICRO), 1.0)
    if _rel_close(used[0], expected):
        if calls > 1:
            raise _fail("no_no_sync", f"right result, but the gradients were all-reduced {calls} times, once per "
                                      "micro-batch: wrap every backward except the last in `with "
                                      "ddp_model.no_sync():` so only one all-reduce runs.")
        return (f"one all-reduce for {ACC_MICRO} micro-batches, and the update equals one SGD step on the mean "
                "gradient of the whole global batch.")
    if _rel_close(used[0], expected * ACC_MICRO):
        raise _fail("loss_not_scaled", f"the update is {ACC_MICRO}x too large: divide each micro-batch's loss by "
                                       "the number of micro-batches (len(micro_batches)) before backward().")
    last = [ACC_MICRO - 1]
    if _rel_close(used[0], _reference_grad(world_size, last, 1.0 / ACC_MICRO)) or _rel_close(
            used[0], _reference_grad(world_size, last, 1.0)):
        raise _fail("zero_grad_inside", "only the last micro-batch counted: call optimizer.zero_grad() once, before "
                                        "the loop, so the micro-batches' gradients add up.")
    if not np.any(used[0]):
        raise _fail("no_step", "the parameters did not change: call optimizer.step() after the last backward.")
    raise _fail("wrong_update", "the update differs from one SGD step on the mean gradient of all micro-batches: "
                                "zero the gradients once, backward each loss / len(micro_batches) (no_sync on all "
                                "but the last), then step once.")


# --------------------------------------------------------------------------------- 7. rank-0 checkpoint
def _ckpt_harness(rank: int, world_size: int, student_fn: Callable, path: str) -> Dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = build_model(seed=0)
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)  # momentum: real optimizer state to save
    x, y = _rank_batch(rank, 0, GRAD_BATCH)
    F.cross_entropy(ddp(x), y).backward()
    optimizer.step()
    saves: List[str] = []
    moves: List[Tuple[str, str]] = []
    real_save, real_replace, real_rename = torch.save, os.replace, os.rename

    def watched_save(obj: Any, f: Any, *a: Any, **k: Any) -> Any:
        saves.append(os.path.abspath(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else "<file object>")
        return real_save(obj, f, *a, **k)

    def watched_move(real: Callable) -> Callable:
        def move(src: Any, dst: Any, *a: Any, **k: Any) -> Any:
            moves.append((os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))))
            return real(src, dst, *a, **k)
        return move

    # A forked rank: these patches never reach the notebook. Path.replace/rename and shutil.move go through os.
    torch.save = watched_save
    os.replace, os.rename = watched_move(real_replace), watched_move(real_rename)
    for orig, new in ((real_save, watched_save), (real_replace, os.replace), (real_rename, os.rename)):
        _swap_globals(student_fn, orig, new)
    call = _call(student_fn, ddp, optimizer, 5, path)
    call.pop("value", None)
    torch.save, os.replace, os.rename = real_save, real_replace, real_rename
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"call": call, "saves": saves, "moves": moves, "params": params}


@_exercise("save_checkpoint")
def check_save_checkpoint(student_fn: Callable) -> str:
    """Exercise 7: save_checkpoint(ddp_model, optimizer, step, path): rank 0 only, atomic, no 'module.' prefix."""
    world_size = 2
    with tempfile.TemporaryDirectory(prefix="ddp-exercise-") as folder:
        path = os.path.join(folder, "checkpoint.pt")
        outs = _launch(_ckpt_harness, world_size, (student_fn, path))
        _student_outcomes(outs)
        writers = [r for r, o in enumerate(outs) if o["saves"]]
        if writers and writers != [0]:
            others = [r for r in writers if r != 0]
            if 0 in writers:
                raise _fail("every_rank_writes", f"rank {others[0]} wrote a checkpoint too: the replicas are "
                                                 "identical, so only rank 0 should save (`if dist.get_rank() == 0:`); "
                                                 "several writers race on the same file.")
            raise _fail("not_rank0", f"rank {others[0]} wrote the checkpoint: let rank 0 do it "
                                     "(`if dist.get_rank() == 0:`).")
        if not os.path.exists(path):
            raise _fail("no_file", "there is no file at `path` after your function: save with torch.save(..., tmp) "
                                   "on rank 0, then os.replace(tmp, path).")
        target = os.path.abspath(path)
        if target in outs[0]["saves"] or not any(dst == target for _, dst in outs[0]["moves"]):
            raise _fail("not_atomic", "rank 0 wrote straight to the final path: a crash mid-write leaves a broken "
                                      "checkpoint. Save to a temporary file next to it, then os.replace(tmp, path).")
        leftovers = sorted(set(os.listdir(folder)) - {"checkpoint.pt"})
        if leftovers:
            raise _fail("temp_left", f"{len(leftovers)} extra file(s) left next to the checkpoint: move the temporary "
                                     "file into place with os.replace(tmp, path) instead of copying it.")
        try:
            ckpt = torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001 - any refusal means objects were pickled
            raise _fail("not_weights_only", "torch.load(path, weights_only=True) refuses the file: save state_dict()s "
                                            "(tensors), not the model or optimizer objects.") from None
    if not isinstance(ckpt, dict) or not {"step", "model", "optimizer"} <= set(ckpt):
        keys = sorted(ckpt) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise _fail("format", f"save a dict with the keys 'step', 'model' and 'optimizer' (got {keys}).")
    state = ckpt["model"]
    if not isinstance(state, dict) or not state:
        raise _fail("format", "ckpt['model'] should be the model's state_dict().")
    if any(str(k).startswith("module.") for k in state):
        raise _fail("module_prefix", "the model's keys start with 'module.' (the DDP wrapper's names), so a plain "
                                     "model can't load them: save ddp_model.module.state_dict().")
    fresh = _model(1)
    try:
        fresh.load_state_dict(state)
    except (RuntimeError, TypeError, KeyError) as e:
        raise _fail("format", f"ckpt['model'] does not load into the model: {str(e).splitlines()[0]}") from None
    if any(not torch.equal(fresh.state_dict()[k], v) for k, v in outs[0]["params"].items()):
        raise _fail("stale_weights", "the saved weights are not the model's current weights.")
    if ckpt["step"] != 5:
        raise _fail("format", f"ckpt['step'] is {ckpt['step']!r}, expected the step argument (5).")
    opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    try:
        opt.load_state_dict(ckpt["optimizer"])
    except Exception as e:  # noqa: BLE001
        raise _fail("format", f"ckpt['optimizer'] does not load into an SGD optimizer ({type(e).__name__}): save "
                              "optimizer.state_dict().") from None
    if not opt.state_dict()["state"]:
        raise _fail("format", "ckpt['optimizer'] has no state (momentum buffers): save optimizer.state_dict().")
    return ("only rank 0 wrote, through a temporary file and os.replace, and the file loads with weights_only=True "
            "into a plain (unwrapped) model and optimizer.")


# ------------------------------------------------------------------------------------------------ overview
EXERCISES: Dict[str, Callable[..., CheckResult]] = {
    "init_group": check_init_group,
    "global_mean": check_global_mean,
    "shard_indices": check_shard_indices,
    "make_loader": check_make_loader,
    "average_gradients": check_average_gradients,
    "accumulation_step": check_accumulation_step,
    "save_checkpoint": check_save_checkpoint,
}


def summarize(results: Sequence[CheckResult]) -> str:
    """One line per exercise plus a total, e.g. for the end of the exercise notebook."""
    lines = []
    for r in results:
        state = "done" if r.passed else ("not started" if r.mistake == NOT_DONE else "try again")
        lines.append(f"{r.exercise:<18} {state}")
    lines.append(f"{sum(r.passed for r in results)} of {len(results)} exercises pass")
    return "\n".join(lines)
