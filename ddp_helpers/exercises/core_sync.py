"""Notebook 0's two blanks, checked: `AfterBackward` (step 1) and `AsGradientsArrive` (step 2).

The learner writes a class built as `sync = Cls(model)` whose `sync.finish()` the training loop calls after
`loss.backward()` and before `optimizer.step()`. Each rank builds two objects, on two copies of the model (as a
notebook does when its training cell runs again), and runs three backward passes: the first object's, the second
object's, the first object's again; after each `finish()` it compares every p.grad with the mean of the ranks'
own gradients, and, on 2 ranks, with torch's DDP's (run first, on the same model and batches), bit for bit. Then an
optimizer step (lr 0: the weights stay) runs whatever the learner hung on `optimizer.step()`.

While the learner's code runs the check records (see _watch, _sync_watch): its hooks (on which tensor, of which
kind, which one is running, what their closures hold, a post-accumulate hook that returns a value), every
collective it calls, its all_reduces (where each started, its op, asynchronous, where it was waited for), with an
asynchronous result reaching its tensor only at wait(); divisions of a p.grad into a new tensor; the works each
object still holds after finish() and the class attributes every instance shares. _core_verdicts then names what
the code did, from every rank's records.
"""
from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ..lesson.handbuilt import build_net
from ._core_verdicts import ITERATIONS, OBJECTS, diagnose
from ._harness import call_student, check_on_2_and_3_ranks, exercise, fail
from ._reference import rank_batch
from ._sync_checks import backward_error, changed_params, hook_mistake, params_of, snapshot
from ._sync_watch import held_handles, shared_containers, watch_divisions, watch_hooks
from ._watch import sentinel_read, watch_all_reduce, watch_collectives
from .average_gradients import _classifier

BATCH = 16
NUDGES = {
    "no_finish": "the training loop calls sync.finish() after backward: does your object have it?",
    "no_all_reduce": "the ranks never combined their gradients.",
    "not_all_reduce": "the ranks communicated, but did every rank end up with the sum?",
    "wrong_op": "look at the operation your all_reduce applies.",
    "unwaited": "an asynchronous all_reduce returns at once: when is its result there?",
    "read_before_wait": "an asynchronous all_reduce returns at once: when may its tensor be read?",
    "changed_in_flight": "an asynchronous all_reduce returns at once: when may its tensor be changed?",
    "no_divide": "the ranks agree, but not on the mean.",
    "rebound_divide": "the ranks agree, but not on the mean: where did your division go?",
    "divided_twice": "the ranks agree, but their gradients are too small: count the divisions.",
    "wrong_divisor": "the ranks agree, but not on the mean: what did you divide by?",
    "reduced_copy": "there were all_reduces, yet every p.grad is still this rank's own: which tensor did they "
                    "change?",
    "reduced_params": "the ranks combined something, but not the gradients.",
    "wrote_p_data": "after finish() the weights themselves had changed: where should the averages go?",
    "some_params": "the model has twelve gradient tensors: were they all averaged?",
    "ignores_argument": "look at what your hook does with the parameter autograd calls it with.",
    "stale_state": "the first backward's gradients were right, a later one's were not: what does your object "
                   "keep from one backward to the next?",
    "second_object": "the first object's gradients were right, a second object's were not: what do your objects "
                     "share?",
    "kept_works": "your gradients are right, but look at what your object still holds after finish().",
    "shared_state": "your gradients are right, but look at where your class keeps what it collects.",
    "late_binding": "your hooks were registered in a loop: which parameter does each of them use?",
    "hook_on_data": "look at the tensor you registered your hook on.",
    "tensor_hook": "look at which hook you registered, and what it is called with.",
    "hook_returned": "backward stopped in your hook: look at what it returns.",
    "sync_in_forward": "look at when your code runs: before or after the gradients exist?",
    "averaged_output": "look at what your code averages: the gradients, or something else?",
    "sync_in_step": "look at when your code runs: before or after finish() returns?",
    "blocking": "your gradients are right, but each all_reduce held up the backward pass.",
    "waited_in_hook": "your gradients are right, but each all_reduce still held up the backward pass.",
    "after_backward": "your gradients are right, but nothing travelled while backward was running.",
    "wrong_value": "the gradients are not the mean over the ranks.",
}


def _grads(model: torch.nn.Module) -> List[Optional[np.ndarray]]:
    return [None if p.grad is None else p.grad.detach().reshape(-1).double().numpy().copy()
            for p in model.parameters()]


def _model() -> torch.nn.Module:
    """Notebook 0's six-layer net, built without moving this process's random state."""
    with torch.random.fork_rng(devices=[]):
        return build_net(0)


def _references(model: torch.nn.Module, rank: int) -> Dict[str, List[List[Optional[np.ndarray]]]]:
    """Before any of the learner's code: each iteration's gradients of torch's DDP (on a copy; the check's own
    collectives) and this rank's own (the local model, no synchronization)."""
    ddp, local = DistributedDataParallel(copy.deepcopy(model)), copy.deepcopy(model)
    out: Dict[str, List[Any]] = {"ddp": [], "local": []}
    for it in range(ITERATIONS):
        x, y = rank_batch(rank, it, BATCH)
        for key, net, inner in (("ddp", ddp, ddp.module), ("local", local, local)):
            net.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
            out[key].append(_grads(inner))
    return out


def _iteration(model: torch.nn.Module, sync: Any, optimizer: torch.optim.Optimizer, running: Dict[str, Any],
               rank: int, it: int, student_cls: Any) -> Dict[str, Any]:
    """zero_grad, forward, backward (the learner's hooks), sync.finish(), optimizer.step(): what came out."""
    x, y = rank_batch(rank, it, BATCH)
    params = params_of(model)
    model.zero_grad(set_to_none=True)
    before = snapshot(params)
    running.pop("returned", None)
    try:
        running["phase"] = "forward"
        loss = F.cross_entropy(model(x), y)
        running["phase"] = "backward"
        loss.backward()
    except Exception as e:  # noqa: BLE001 - an error in the learner's hook becomes a hint
        return {"call": backward_error(e, student_cls, running)}
    shared_mid = shared_containers(student_cls)
    running["phase"] = "finish"
    call = call_student(sync.finish)
    call.pop("value", None)
    running["phase"] = "after"
    result = {"call": call, "after": _grads(model), "changed": changed_params(before, params),
              "sentinel": [i for i, p in enumerate(params) if sentinel_read(p.grad)], "held": held_handles(sync),
              "shared": [shared_mid, shared_containers(student_cls)]}
    running["phase"] = "step"
    try:
        optimizer.step()  # lr 0: only what the learner hung on the step changes anything
    except Exception as e:  # noqa: BLE001 - an error in the learner's step hook becomes a hint
        if call["status"] == "ok":
            result["call"] = backward_error(e, student_cls, running)
    running["phase"] = "after"
    return result


def _build(models: List[torch.nn.Module], student_cls: Any, running: Dict[str, Any], out: Dict[str, Any]
           ) -> List[Any]:
    """One object of the learner's class per model; out["call"] says how it went, out["hooks"] what each
    registered."""
    syncs: List[Any] = []
    out["hooks"], out["call"] = [], {"status": "ok"}
    for k, model in enumerate(models):
        running["object"] = k
        others = [p for m in models if m is not model for p in params_of(m)]
        with watch_hooks(params_of(model), running, student_cls, foreign=others) as hooks:
            call = call_student(student_cls, model)
        out["hooks"].append(hooks)
        sync = call.pop("value", None)
        if call["status"] == "ok" and not callable(getattr(sync, "finish", None)):
            call = {"status": "no_finish", "type": type(sync).__name__}
        # a hook on p.data is refused as it is registered: the mistake, not torch's error, is the hint
        out["call"] = hook_mistake(hooks) or call
        if out["call"]["status"] != "ok":
            break
        syncs.append(sync)
    return syncs


def _in_rank(rank: int, world_size: int, student_cls: Any) -> Dict[str, Any]:
    """In each rank: the references, then two objects of the learner's class and three backward passes."""
    model = _model()
    out: Dict[str, Any] = {**_references(model, rank), "iterations": [],
                           "shared_before": shared_containers(student_cls)}
    models = [model, copy.deepcopy(model)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.0) for m in models]
    running: Dict[str, Any] = {"phase": "setup", "object": 0, "hook": None}
    classify = [_classifier(m) for m in models]
    phase = functools.partial(running.__getitem__, "phase")

    def note() -> Dict[str, Any]:
        return {"object": running["object"], "in_hook": running.get("hook")}

    def noted(record: Dict[str, Any]) -> None:
        record.update(phase=phase(), **note())

    with contextlib.ExitStack() as stack:
        reduced = stack.enter_context(watch_all_reduce(
            student_cls, lambda t: classify[running["object"]](t), deferred=True, phase=phase, note=note))
        collectives = stack.enter_context(watch_collectives(student_cls, on_call=noted))
        divisions = stack.enter_context(watch_divisions(lambda: params_of(models[running["object"]]), phase))
        syncs = _build(models, student_cls, running, out)
        for it, k in enumerate(OBJECTS if out["call"]["status"] == "ok" else ()):
            running["object"] = k
            first = (len(reduced), len(collectives), len(divisions))
            result = _iteration(models[k], syncs[k], optimizers[k], running, rank, it, student_cls)
            result.update(object=k, reduced=list(range(first[0], len(reduced))),
                          collectives=list(range(first[1], len(collectives))),
                          divisions=list(range(first[2], len(divisions))))
            out["iterations"].append(result)
            if result["call"]["status"] != "ok":
                out["call"] = result["call"]
                break
    for handle in running["handles"]:  # the learner's global hooks end with the check
        handle.remove()
    out.update(reduced=reduced, collectives=collectives, divisions=divisions, n_params=len(params_of(model)),
               batch=BATCH)
    return out


def how_seen(outs: List[Dict[str, Any]]) -> str:
    """What was seen of a passing answer's communication: where it started, asynchronous, where waited for."""
    recs = [x for o in outs for x in o["reduced"] if x.get("phase") in ("backward", "finish")]
    starts = {x["phase"] for x in recs}
    how = {"backward": "all-reduced during backward", "finish": "all-reduced in finish(), after backward"}.get(
        next(iter(starts)) if len(starts) == 1 else "", "all-reduced during backward and in finish()")
    if recs and all(x["async"] for x in recs):
        waits = {x.get("waited_in") for x in recs} - {None}
        how += ", with async_op=True"
        if waits == {"finish"}:
            how += ", waited for in finish()"
        elif any(x.get("future_in") for x in recs):
            how += ", followed through their futures"
    others = sorted({c["op"] for o in outs for c in o["collectives"] if c.get("phase") in ("backward", "finish")}
                    - {"all_reduce"})
    if others:
        how += ", with dist." + ", dist.".join(others)
    if not recs:
        how = "with dist." + ", dist.".join(others) if others else "without an all_reduce"
    return how


def pass_line(notes: Dict[str, Any], sizes: Sequence[int]) -> str:
    """The PASS line: only what the check saw."""
    ddp = f"; on 2 ranks {notes['ddp']} to torch's DDP's" if "ddp" in notes else ""
    return (f"{ITERATIONS} backward passes, on two objects of your class, left the mean gradient in every p.grad "
            f"({notes.get('how', 'all-reduced')}), on {' and on '.join(map(str, sizes))} ranks{ddp}.")


def _check(student_cls: Any, world_size: Optional[int], step: int) -> str:
    """Run the learner's class on 2 and on 3 ranks (or on world_size); the PASS line."""
    if not isinstance(student_cls, type):
        raise fail("not_a_class", f"pass your class itself (e.g. check(AfterBackward)), not a "
                                  f"{type(student_cls).__name__}: the check builds one per rank, as train() does.")
    notes: Dict[str, Any] = {}
    def judged(outs: List[Dict[str, Any]], size: int) -> Any:
        verdict = diagnose(outs, size, step, notes)
        notes["how"] = how_seen(outs) if verdict is None else notes.get("how")
        return verdict

    sizes = check_on_2_and_3_ranks(_in_rank, judged, student_cls,
                                   world_size,
                                   hardcoded=(("no_divide", "divided_twice", "wrong_value", "some_params",
                                               "wrong_divisor"),
                                              "divide by dist.get_world_size(), not a fixed number."))
    return pass_line(notes, sizes)


@exercise("after_backward", NUDGES)
def check_after_backward(student_cls: Any, world_size: Optional[int] = None) -> str:
    """Notebook 0, step 1: AfterBackward(model).finish() leaves the mean over the ranks in every p.grad."""
    return _check(student_cls, world_size, step=1)


@exercise("as_gradients_arrive", NUDGES)
def check_as_gradients_arrive(student_cls: Any, world_size: Optional[int] = None) -> str:
    """Notebook 0, step 2: AsGradientsArrive(model)'s hooks send each gradient during backward, asynchronously;
    finish() waits, and every p.grad holds the mean."""
    return _check(student_cls, world_size, step=2)
