"""Notebook 0's two blanks, checked: `AfterBackward` (step 1) and `AsGradientsArrive` (step 2).

The learner writes a class built as `sync = Cls(model)` whose `sync.finish()` the training loop calls after
`loss.backward()` and before `optimizer.step()`. The check runs two backward passes on every rank with it and,
before any of the learner's code, two with torch's DDP on the same model and batches; after each `finish()` it
compares every p.grad with the mean of the ranks' own gradients, and, on 2 ranks, with DDP's, bit for bit.
While the learner's code runs it records its hooks (on which tensor, what their closures hold) and its
all_reduces (on what, during backward or in finish(), asynchronous and waited for), with the result of an
asynchronous one reaching its tensor only at wait() (see _watch). A hint then names what the code did.
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ..lesson.handbuilt import agreement, build_net
from ._compare import close
from ._harness import Verdict, call_student, check_on_2_and_3_ranks, error_report, exercise, fail, student_outcomes
from ._reference import rank_batch
from ._sync_checks import (changed_params, hook_mistake, params_of, registration_verdict, snapshot,
                           timing_verdict)
from ._watch import sentinel_read, unwaited, watch_all_reduce, watch_hooks
from .average_gradients import _classifier

ITERATIONS = 2
BATCH = 16
NUDGES = {
    "no_finish": "the training loop calls sync.finish() after backward: does your object have it?",
    "no_all_reduce": "the ranks never combined their gradients.",
    "unwaited": "an asynchronous all_reduce returns at once: when is its result there?",
    "read_before_wait": "an asynchronous all_reduce returns at once: when may its tensor be read?",
    "changed_in_flight": "an asynchronous all_reduce returns at once: when may its tensor be changed?",
    "no_divide": "the ranks agree, but not on the mean.",
    "divided_twice": "the ranks agree, but their gradients are too small: count the divisions.",
    "reduced_copy": "there were all_reduces, yet every p.grad is still this rank's own: which tensor did they "
                    "change?",
    "reduced_params": "the ranks combined something, but not the gradients.",
    "wrote_p_data": "after finish() the weights themselves had changed: where should the averages go?",
    "some_params": "the model has twelve gradient tensors: were they all averaged?",
    "stale_state": "the first backward's gradients were right, the second's were not: what does your object "
                   "keep from one backward to the next?",
    "late_binding": "your hooks were registered in a loop: which parameter does each of them use?",
    "hook_on_data": "look at the tensor you registered your hook on.",
    "tensor_hook": "look at which hook you registered, and what it is called with.",
    "blocking": "your gradients are right, but each all_reduce held up the backward pass.",
    "after_backward": "your gradients are right, but nothing travelled while backward was running.",
    "wrong_value": "the gradients are not the mean over the ranks.",
}


STALE = fail("stale_state", "after the first backward every p.grad held the mean, after the second it did not: "
                            "finish() went over what the first backward left (its works, or its gradients) again. "
                            "Empty what your object collects in finish(), so that each backward starts afresh.")


def _grads(model: torch.nn.Module) -> List[Optional[np.ndarray]]:
    return [None if p.grad is None else p.grad.detach().reshape(-1).double().numpy().copy()
            for p in model.parameters()]


def _model() -> torch.nn.Module:
    """Notebook 0's six-layer net, built without moving this process's random state."""
    with torch.random.fork_rng(devices=[]):
        return build_net(0)


def _ddp_grads(model: torch.nn.Module, rank: int) -> List[List[Optional[np.ndarray]]]:
    """torch's DDP on a copy of the model, the check's own collectives, all made before the learner's code runs:
    the gradients each iteration leaves."""
    ddp = DistributedDataParallel(copy.deepcopy(model))
    out = []
    for it in range(ITERATIONS):
        x, y = rank_batch(rank, it, BATCH)
        ddp.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x), y).backward()
        out.append(_grads(ddp.module))
    return out


def _iteration(model: torch.nn.Module, local: torch.nn.Module, sync: Any, phase: Dict[str, str], rank: int,
               it: int, student_cls: Any) -> Dict[str, Any]:
    """zero_grad, forward, backward (the learner's hooks), sync.finish(): what came out."""
    x, y = rank_batch(rank, it, BATCH)
    local.zero_grad(set_to_none=True)
    F.cross_entropy(local(x), y).backward()  # this rank's own gradients: the reference
    params = params_of(model)
    model.zero_grad(set_to_none=True)
    before, phase["now"] = snapshot(params), "backward"
    try:
        F.cross_entropy(model(x), y).backward()
    except Exception as e:  # noqa: BLE001 - an error in the learner's hook becomes a hint
        return {"call": error_report(e, student_cls)}
    phase["now"] = "finish"
    call = call_student(sync.finish)
    call.pop("value", None)
    phase["now"] = "after"
    return {"call": call, "local": _grads(local), "after": _grads(model), "changed": changed_params(before, params),
            "sentinel": [i for i, p in enumerate(params) if sentinel_read(p.grad)]}


def _in_rank(rank: int, world_size: int, student_cls: Any) -> Dict[str, Any]:
    """In each rank: DDP's gradients, then the learner's class on the same model and batches."""
    model = _model()
    out: Dict[str, Any] = {"ddp": _ddp_grads(model, rank), "iterations": [], "phases": []}
    local, phase = copy.deepcopy(model), {"now": "setup"}
    classify = _classifier(model)

    def classified(t: torch.Tensor) -> Any:
        out["phases"].append(phase["now"])
        return classify(t)

    with watch_all_reduce(student_cls, classified, deferred=True) as reduced:
        with watch_hooks(params_of(model)) as hooks:
            call = call_student(student_cls, model)
        sync = call.pop("value", None)
        if call["status"] == "ok" and not callable(getattr(sync, "finish", None)):
            call = {"status": "no_finish", "type": type(sync).__name__}
        # a hook on p.data is refused as it is registered: the mistake, not torch's error, is the hint
        out["call"] = hook_mistake(hooks) or call
        for it in range(ITERATIONS if out["call"]["status"] == "ok" else 0):
            first = len(reduced)
            result = _iteration(model, local, sync, phase, rank, it, student_cls)
            result["reduced"] = list(range(first, len(reduced)))
            out["iterations"].append(result)
            if result["call"]["status"] != "ok":
                out["call"] = result["call"]
                break
    out.update(reduced=reduced, hooks=hooks)
    return out


# ------------------------------------------------------------------------------------------------ the parent
def _labels(outs: List[Dict[str, Any]], it: int, world_size: int) -> List[List[str]]:
    """For each rank and parameter after iteration it: "mean", "sum", "half", "local", "local_div", "none" or
    "other"."""
    local = [[np.asarray(g) for g in o["iterations"][it]["local"]] for o in outs]
    mean = [sum(local[r][i] for r in range(world_size)) / world_size for i in range(len(local[0]))]

    def label(r: int, i: int) -> str:
        g = outs[r]["iterations"][it]["after"][i]
        if g is None:
            return "none"
        for name, want in (("mean", mean[i]), ("sum", mean[i] * world_size), ("half", mean[i] / world_size),
                           ("local", local[r][i]), ("local_div", local[r][i] / world_size)):
            if close(g, want):
                return name
        return "other"

    return [[label(r, i) for i in range(len(mean))] for r in range(world_size)]


def _value_verdict(labels: List[List[str]], reduced: List[Dict[str, Any]], world_size: int) -> Optional[Verdict]:
    """The verdict from one iteration's gradients (None when every rank holds the mean everywhere)."""
    kinds = {lab for row in labels for lab in row}
    if kinds == {"mean"}:
        return None
    if "none" in kinds:
        return fail("wrong_value", "some p.grad was None after finish(): leave every gradient in p.grad, averaged.")
    if kinds == {"sum"}:
        return fail("no_divide", f"every rank holds {world_size}x the mean gradient, the sum over the ranks: "
                                 "all_reduce adds; divide each gradient by dist.get_world_size() (before the "
                                 "all_reduce, or after it has finished).")
    if kinds == {"half"}:
        return fail("divided_twice", f"every rank holds the mean divided by {world_size} once more: you divided "
                                     "by the world size twice (before the all_reduce and after it, or "
                                     "ReduceOp.AVG and a division). Divide once.")
    if kinds <= {"local", "local_div"} and not any(r["tensor"] == "grad" for r in reduced):
        return fail("reduced_copy", "your all_reduces went to a copy of the gradients (a new tensor, e.g. "
                                    "p.grad.clone() or torch.cat), and the result never reached p.grad, which still "
                                    "holds this rank's own gradient. all_reduce changes the tensor it is given, in "
                                    "place: give it p.grad itself.")
    fine = [i for i in range(len(labels[0])) if all(row[i] == "mean" for row in labels)]
    if fine:
        left = [i for i in range(len(labels[0])) if i not in fine]
        return fail("some_params", f"only {len(fine)} of the {len(labels[0])} gradients hold the mean; parameters "
                                   f"{left} of model.parameters() do not: every parameter's gradient needs the "
                                   "same all_reduce and the same division.")
    return fail("wrong_value", "after finish() the gradients were neither each rank's own nor the mean over the "
                               "ranks: sum them with all_reduce and divide by the world size, in p.grad.")


def _structure_verdict(rank0: Dict[str, Any], step: int) -> Optional[Verdict]:
    """Step 2 only: the gradients must leave during backward, each all_reduce asynchronous."""
    if step == 1:
        return None
    if any(not r["async"] for r in rank0["reduced"]):
        return fail("blocking", "an all_reduce without async_op=True blocks the hook until every rank has sent "
                                "that gradient, so backward stops there: start it with async_op=True and wait "
                                "for it in finish().")
    phases = [rank0["phases"][k] for k in rank0["iterations"][0]["reduced"]]
    if phases and all(ph != "backward" for ph in phases):
        return fail("after_backward", "every all_reduce started after backward had returned (in finish()): that "
                                      "is step 1. Start each gradient's all_reduce in the hook autograd calls "
                                      "once p.grad is written, and only wait in finish().")
    return None


def _early_verdict(outs: List[Dict[str, Any]]) -> Optional[Verdict]:
    """The verdict from the learner's object itself: no finish(), hooks registered the wrong way, errors."""
    if any(o["call"]["status"] == "no_finish" for o in outs):
        kind = next(o["call"]["type"] for o in outs if o["call"]["status"] == "no_finish")
        return fail("no_finish", f"the object your class builds ({kind}) has no finish() method: the training "
                                 "loop calls sync.finish() after loss.backward(), and when it returns every p.grad "
                                 "must hold the mean.")
    bad = [o for o in outs if o["call"]["status"] not in ("ok", "not_done", "mistake")]
    verdict = registration_verdict(outs[0]["hooks"]) if bad else None
    if verdict is not None:
        return verdict
    student_outcomes(outs)
    rank0 = outs[0]
    if not rank0["reduced"]:
        return registration_verdict(rank0["hooks"]) or fail(
            "no_all_reduce", "no all_reduce was called: every rank kept its own gradients. Sum each gradient over "
                             "the ranks with dist.all_reduce, then divide by the world size.")
    pending = unwaited(rank0["reduced"])
    if pending:
        return fail("unwaited", f"{len(pending)} of the {len(rank0['reduced'])} all_reduce(..., async_op=True) "
                                "on rank 0 were never waited for: the sum is in the tensor only once the work is "
                                "done. In finish(), call .wait() on every work the all_reduces returned.")
    if any(r["tensor"] in ("param", "param_copy") for r in rank0["reduced"]):
        return fail("reduced_params", "you all-reduced the parameters (p or p.data), not their gradients: "
                                      "all_reduce p.grad.")
    its = rank0["iterations"]
    verdict, it = timing_verdict(rank0["reduced"], its, [r["reduced"] for r in its], "changed_in_flight")
    return STALE if verdict is not None and it > 0 else verdict


def _diagnose(outs: List[Dict[str, Any]], world_size: int, step: int, notes: Dict[str, str]) -> Optional[Verdict]:
    """The verdict for one run (None: both backward passes left the mean in every p.grad, as the step asks)."""
    verdict = _early_verdict(outs)
    if verdict is not None:
        return verdict
    rank0 = outs[0]
    for it in range(ITERATIONS):
        reduced = [rank0["reduced"][k] for k in rank0["iterations"][it]["reduced"]]
        verdict = _value_verdict(_labels(outs, it, world_size), reduced, world_size)
        if verdict is not None and it > 0:
            return STALE
        if verdict is not None:
            return registration_verdict(rank0["hooks"]) or verdict
    verdict = _structure_verdict(rank0, step)
    if verdict is None and world_size == 2:
        ours = np.concatenate([g for it in rank0["iterations"] for g in it["after"]])
        torchs = np.concatenate([g for grads in rank0["ddp"] for g in grads])
        notes["ddp"] = agreement(ours, torchs, bound=1e-6)
    return verdict


def _check(student_cls: Any, world_size: Optional[int], step: int) -> str:
    """Run the learner's class on 2 and on 3 ranks (or on world_size); the PASS line."""
    if not isinstance(student_cls, type):
        raise fail("not_a_class", f"pass your class itself (e.g. check(AfterBackward)), not a "
                                  f"{type(student_cls).__name__}: the check builds one per rank, as train() does.")
    notes: Dict[str, str] = {}
    diagnose = functools.partial(_diagnose, step=step, notes=notes)
    sizes = check_on_2_and_3_ranks(_in_rank, diagnose, student_cls, world_size,
                                   hardcoded=(("no_divide", "divided_twice", "wrong_value", "some_params"),
                                              "divide by dist.get_world_size(), not a fixed number."))
    how = ("sent during backward, each with async_op=True and waited for in finish()" if step == 2 else
           "after backward")
    ddp = f"; on 2 ranks {notes['ddp']} to torch's DDP's" if "ddp" in notes else ""
    return (f"{ITERATIONS} backward passes left the mean gradient in every p.grad, {how}, on "
            f"{' and on '.join(map(str, sizes))} ranks{ddp}.")


@exercise("after_backward", NUDGES)
def check_after_backward(student_cls: Any, world_size: Optional[int] = None) -> str:
    """Notebook 0, step 1: AfterBackward(model).finish() leaves the mean over the ranks in every p.grad."""
    return _check(student_cls, world_size, step=1)


@exercise("as_gradients_arrive", NUDGES)
def check_as_gradients_arrive(student_cls: Any, world_size: Optional[int] = None) -> str:
    """Notebook 0, step 2: AsGradientsArrive(model)'s hooks send each gradient during backward, asynchronously;
    finish() waits, and every p.grad holds the mean."""
    return _check(student_cls, world_size, step=2)
