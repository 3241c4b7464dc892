"""Recorders for inside a rank: what the learner's code did (its all_reduces and other collectives, DDP forwards
and backwards, seeds, any call a check patches).

A hint must name the mistake made, not the first symptom of it: an unchanged gradient comes from no all_reduce
at all, or from an all_reduce of a copy; an all-reduce per micro-batch from no no_sync() at all, or from a
forward run outside it. The checks record what happened here and judge the records in the parent. Every patch
is made inside a rank's own process, so it never reaches the notebook's kernel.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist

from ._errors import IN_WAIT
from ._harness import swap_globals

Classify = Callable[[torch.Tensor], Tuple[str, Optional[int]]]


def storage_of(t: torch.Tensor) -> int:
    """The address of t's storage: the same for a tensor and its views (p.grad.data, p.grad.view(-1))."""
    return t.untyped_storage().data_ptr()


def _op_name(op: Any) -> str:
    """'SUM', 'AVG', 'MAX', ... for a ReduceOp."""
    return str(getattr(op, "name", None) or op).split(".")[-1]


Phase = Callable[[], str]  # where the check's run is now: "setup", "forward", "backward", "finish", ...


class _WatchedWork:
    """What an all_reduce(async_op=True) hands the learner: the real Work, noting whether and where it was waited
    for ("waited_in": the phase of the first wait(); "future_in": where its future was taken)."""

    def __init__(self, work: Any, record: Dict[str, Any], phase: Optional[Phase] = None):
        self._work, self._record, self._phase = work, record, phase

    def _now(self) -> Optional[str]:
        return None if self._phase is None else self._phase()

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._record["waited"] = True
        self._record.setdefault("waited_in", self._now())
        try:
            return self._work.wait(*args, **kwargs)
        except Exception as e:  # a peer that never joined: raised by C++, so no torch.distributed frame says so
            with contextlib.suppress(AttributeError):  # an exception type without a __dict__ stays unmarked
                setattr(e, IN_WAIT, True)
            raise

    def get_future(self) -> Any:
        self._record["waited"] = True  # the learner waits on the future (wait(), then(), wait_all)
        self._record.setdefault("future_in", self._now())
        return self._work.get_future()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


# What the tensor of an asynchronous all_reduce holds, in a deferred watch, until wait(): never a gradient.
SENTINEL = 2.0 ** 100
_HUGE = 2.0 ** 80  # above it, a value came from SENTINEL (divided or multiplied by a few ranks, not by 2**20)


class _DeferredWork(_WatchedWork):
    """An async all_reduce whose result reaches the learner's tensor at wait(), the latest moment torch allows.

    The real all_reduce runs on a copy; the learner's tensor holds SENTINEL until wait() (or the future's
    callbacks) puts the result in. So code that reads the tensor before wait() reads SENTINEL, and code that
    writes it while it travels (a gradient copied in after the send, a division before wait()) is seen, every
    run, instead of once in a while on a slow network.
    """

    def __init__(self, work: Any, record: Dict[str, Any], tensor: torch.Tensor, sent: torch.Tensor,
                 phase: Optional[Phase] = None):
        super().__init__(work, record, phase)
        self._tensor, self._sent, self._landed = tensor, sent, False
        record["in_flight"] = None  # "scaled": the whole tensor changed (divided) while it travelled; "filled"

    def _land(self) -> None:
        if self._landed:
            return
        self._landed = True
        now = self._tensor.detach()
        changed = now != SENTINEL
        if bool(changed.any()):
            family = bool((now[changed].abs() > _HUGE).all())  # SENTINEL scaled, not real values written in
            self._record["in_flight"] = "scaled" if family else "filled"
        with torch.no_grad():
            self._tensor.copy_(self._sent)

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = super().wait(*args, **kwargs)
        self._land()
        return out

    def get_future(self) -> Any:
        self._record["waited"] = True
        self._record.setdefault("future_in", self._now())
        tensor = self._tensor

        def land(fut: Any) -> List[torch.Tensor]:
            fut.value()  # raises the collective's error, if any
            self._land()
            return [tensor]

        return self._work.get_future().then(land)

    def is_completed(self) -> bool:
        done = bool(self._work.is_completed())
        if done:
            self._land()
        return done


def _start(real: Callable, bound: inspect.BoundArguments, record: Dict[str, Any], deferred: bool,
           phase: Optional[Phase] = None) -> Any:
    """The real all_reduce; deferred and asynchronous: on a copy, the learner's tensor SENTINEL until wait()."""
    tensor = bound.arguments.get("tensor")
    if not (deferred and record["async"] and isinstance(tensor, torch.Tensor) and tensor.is_floating_point()):
        work = real(*bound.args, **bound.kwargs)
        return _WatchedWork(work, record, phase) if record["async"] and work is not None else work
    sent = tensor.detach().clone()
    bound.arguments["tensor"] = sent
    work = real(*bound.args, **bound.kwargs)
    with torch.no_grad():
        tensor.fill_(SENTINEL)
    return _DeferredWork(work, record, tensor, sent, phase)


@contextlib.contextmanager
def watch_all_reduce(student_fn: Callable, classify: Classify, deferred: bool = False,
                     phase: Optional[Phase] = None,
                     note: Optional[Callable[[], Dict[str, Any]]] = None) -> Iterator[List[Dict[str, Any]]]:
    """While inside: every dist.all_reduce is recorded (what classify calls its tensor, op, async, waited).

    deferred: an async all_reduce's result lands in its tensor only at wait() (see _DeferredWork).
    phase: where the run is; then each record has "phase" (where it started) and "waited_in" (where it was
    first waited for: a wait() during backward holds backward up as a blocking all_reduce does).
    note: more to record with each call (e.g. which parameter's hook was running).
    """
    real = dist.all_reduce
    signature = inspect.signature(real)
    records: List[Dict[str, Any]] = []

    def watched(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        a = bound.arguments
        # anything but a tensor: all_reduce's own check refuses it below, and that error is the learner's to see
        kind, index = classify(a["tensor"]) if isinstance(a.get("tensor"), torch.Tensor) else ("not_a_tensor", None)
        record = {"tensor": kind, "index": index, "op": _op_name(a.get("op", dist.ReduceOp.SUM)),
                  "async": bool(a.get("async_op", False)), "waited": False}
        if phase is not None:
            record["phase"] = phase()
        record.update(note() if note is not None else {})
        records.append(record)
        return _start(real, bound, record, deferred, phase)

    dist.all_reduce = watched
    swap_globals(student_fn, real, watched)  # `from torch.distributed import all_reduce` too
    try:
        yield records
    finally:
        dist.all_reduce = real
        swap_globals(student_fn, watched, real)  # a later watch in the same rank finds the real one again


def sentinel_read(t: Optional[torch.Tensor]) -> bool:
    """True when t holds a value read from a deferred all_reduce's tensor before its wait()."""
    return t is not None and t.is_floating_point() and bool((t.detach().abs() > _HUGE).any())


def unwaited(records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The async all_reduces the learner never waited for."""
    return [r for r in records if r["async"] and not r["waited"]]


# ------------------------------------------------------------------------------------------------ DDP events
def record_ddp_events(ddp: torch.nn.Module, optimizer: torch.optim.Optimizer) -> List[Tuple[Any, ...]]:
    """A log, filled while the learner's step runs, of what decides DDP's communication.

    ("forward", i, sync): forward i through DDP, sync = require_backward_grad_sync then (False inside no_sync);
    ("module_forward", i): forward i through ddp.module, around DDP; ("backward", i, sync): the backward
    reached forward i's output, sync = the flag at that moment (False: backward() called inside no_sync);
    ("zero_grad", who) and ("step",). The caller adds ("allreduce",) from its comm hook.
    """
    events: List[Tuple[Any, ...]] = []
    depth = [0]  # > 0 while DDP's own forward runs (it calls the inner module's forward)
    model = ddp.module

    def backward_of(i: int) -> Callable[[torch.Tensor], None]:
        return lambda grad: events.append(("backward", i, bool(ddp.require_backward_grad_sync)))

    def watch_output(out: Any, i: int) -> None:
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(backward_of(i))

    def ddp_pre(module: Any, args: Any) -> None:
        depth[0] += 1
        events.append(("forward", len(events), bool(ddp.require_backward_grad_sync)))

    def ddp_post(module: Any, args: Any, out: Any) -> None:
        depth[0] -= 1
        watch_output(out, next(e[1] for e in reversed(events) if e[0] == "forward"))

    def module_post(module: Any, args: Any, out: Any) -> None:
        if depth[0] == 0:  # the learner called ddp.module(x): DDP never saw this forward
            i = len(events)
            events.append(("module_forward", i))
            watch_output(out, i)

    ddp.register_forward_pre_hook(ddp_pre)
    ddp.register_forward_hook(ddp_post)
    model.register_forward_hook(module_post)
    for who, obj in (("optimizer", optimizer), ("ddp_model", ddp), ("ddp_model.module", model)):
        real = obj.zero_grad

        def zero_grad(*args: Any, _real: Callable = real, _who: str = who, **kwargs: Any) -> Any:
            events.append(("zero_grad", _who))
            return _real(*args, **kwargs)

        obj.zero_grad = zero_grad  # an instance attribute: only this rank's objects
    optimizer.register_step_post_hook(lambda *_: events.append(("step",)))
    return events


# ------------------------------------------------------------------------------------------------------ seeds
def record_seeds(student_fn: Callable) -> List[Tuple[str, int]]:
    """From now on in this rank, every torch.Generator(...).manual_seed(s) and torch.manual_seed(s) is logged."""
    seeds: List[Tuple[str, int]] = []
    real_generator, real_manual_seed = torch.Generator, torch.manual_seed

    class Generator(real_generator):  # type: ignore[misc, valid-type]
        def manual_seed(self, seed: int) -> "Generator":
            seeds.append(("generator", int(seed)))
            return super().manual_seed(seed)

    def manual_seed(seed: int) -> Any:
        seeds.append(("global", int(seed)))
        return real_manual_seed(seed)

    torch.Generator, torch.manual_seed = Generator, manual_seed  # a forked rank: never undone, never seen outside
    swap_globals(student_fn, real_generator, Generator)
    swap_globals(student_fn, real_manual_seed, manual_seed)
    return seeds


# ------------------------------------------------------------------------------------------- any call at all
@contextlib.contextmanager
def patched(student_fn: Callable, owner: Any, name: str, wrap: Callable[[Callable], Callable]) -> Iterator[Callable]:
    """While inside: owner.name, and any global of student_fn bound to it, is wrap(the real one); undone after."""
    real = getattr(owner, name)
    fake = wrap(real)
    setattr(owner, name, fake)
    swap_globals(student_fn, real, fake)  # `from torch.distributed import barrier` too
    try:
        yield fake
    finally:
        setattr(owner, name, real)
        swap_globals(student_fn, fake, real)  # a later watch of the same rank finds the real one again


# The torch.distributed calls a learner may make; the ones a version lacks are skipped. Only the learner's own
# calls are seen: torch's internals (all_gather_object's all_gathers) call distributed_c10d's, not these names.
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
               "broadcast_object_list", "reduce", "gather", "gather_object", "scatter", "scatter_object_list",
               "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
               "monitored_barrier", "send", "recv", "isend", "irecv")
_TENSOR_ARGS = ("tensor", "input_tensor", "input")  # the argument that holds what a rank sends


def _collective_record(name: str, signature: inspect.Signature, args: tuple, kwargs: dict) -> Dict[str, Any]:
    """What a collective call is: its name, its reduction (SUM when left out), the tensor it sends (numel, dtype)."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:  # the real call will say what is wrong
        return {"kind": "collective", "op": name, "reduce": None, "numel": None, "dtype": None}
    bound.apply_defaults()
    a = bound.arguments
    t = next((a[k] for k in _TENSOR_ARGS if isinstance(a.get(k), torch.Tensor)), None)
    return {"kind": "collective", "op": name, "reduce": _op_name(a["op"]) if a.get("op") is not None else None,
            "numel": None if t is None else t.numel(), "dtype": None if t is None else str(t.dtype).split(".")[-1]}


@contextlib.contextmanager
def watch_collectives(student_fn: Callable, on_call: Optional[Callable[[Dict[str, Any]], None]] = None,
                      records: Optional[List[Dict[str, Any]]] = None) -> Iterator[List[Dict[str, Any]]]:
    """While inside: every torch.distributed collective the learner calls is appended to records (a new list if
    None) before it runs: its name, the reduction, the numel and dtype of the tensor it sends; then on_call(it)."""
    records = [] if records is None else records

    def wrap(name: str) -> Callable[[Callable], Callable]:
        def make(real: Callable) -> Callable:
            signature = inspect.signature(real)

            def watched(*args: Any, **kwargs: Any) -> Any:
                record = _collective_record(name, signature, args, kwargs)
                records.append(record)
                if on_call is not None:
                    on_call(record)
                return real(*args, **kwargs)
            return watched
        return make

    with contextlib.ExitStack() as stack:
        for name in COLLECTIVES:
            if hasattr(dist, name):
                stack.enter_context(patched(student_fn, dist, name, wrap(name)))
        yield records
