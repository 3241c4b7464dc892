"""The verdicts on notebook 0's two blanks, made in the parent from every rank's records (core_sync records them).

Each verdict names what the code did, with the data the check has (the op, the divisor, the collective used, where
the code ran, the works kept); where the records do not tell a mistake apart, the hint says what was seen, not a
guess at why.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np

from ..lesson.handbuilt import agreement
from ._compare import close
from ._harness import Verdict, fail
from ._sync_checks import (LEARNING, call_verdict, divided_twice_verdict, first_value_verdict, iteration_records,
                           local_grads, mean_grads, no_finish_type, other_collective_verdict, registration_verdict,
                           timing_verdict, unwaited_on, value_labels, where_verdict)
from ._sync_frame import OBJECTS
from ._sync_watch import changed_shared


def _factor(outs: List[Dict[str, Any]], it: int) -> Optional[float]:
    """c when every rank's every p.grad is c times the mean gradient, the same c everywhere; else None."""
    mean = mean_grads(local_grads(outs, it))
    found = []
    for o in outs:
        for i, g in enumerate(o["iterations"][it]["after"]):
            if g is None or not np.any(mean[i]):
                return None
            c = float(np.dot(g, mean[i]) / np.dot(mean[i], mean[i]))
            if not close(g, c * mean[i]):
                return None
            found.append(c)
    if not found or abs(found[0]) < 1e-12 or max(abs(c - found[0]) for c in found) > 1e-4 * abs(found[0]):
        return None
    return found[0]


def _hook_strays(outs: List[Dict[str, Any]], it: int) -> Optional[Verdict]:
    """A hook that all-reduces other parameters' gradients than the one autograd called it with, some of them
    more than once in one backward."""
    for r, o in enumerate(outs):
        recs = iteration_records(o, it, "reduced")
        stray = [x for x in recs if isinstance(x.get("in_hook"), int) and x["tensor"] == "grad"
                 and x["index"] != x["in_hook"]]
        indices = [x["index"] for x in recs if x["tensor"] == "grad"]
        if stray and len(indices) > len(set(indices)):  # a gradient reduced twice: not a bucket, a mistake
            hook = stray[0]["in_hook"]
            others = sorted({x["index"] for x in stray if x["in_hook"] == hook})
            return fail("ignores_argument", f"on rank {r} the hook autograd called for parameter {hook} all-reduced "
                                            f"the gradients of parameters {others} too: {len(recs)} all_reduces in "
                                            f"one backward for {o['n_params']} gradients, so some were summed "
                                            "more than once. Autograd calls your hook with the parameter whose "
                                            "gradient is ready: reduce that one, once, not every parameter.")
    return None


def _divisor_verdict(outs: List[Dict[str, Any]], it: int, world_size: int) -> Optional[Verdict]:
    """Every p.grad a multiple of the mean, neither the sum nor the mean / world size: the divisor, named."""
    c = _factor(outs, it)
    if c is None or abs(c - 1) < 1e-6:
        return None
    batch = outs[0]["batch"]
    if abs(1 / c - batch) < 1e-3 * batch:
        return fail("wrong_divisor", f"every p.grad held the mean divided by {batch}, the batch size of each rank, "
                                     f"as the sum divided by the global batch ({world_size} x {batch}) is. The "
                                     "loss (cross_entropy) already averages over each rank's batch: divide the sum "
                                     "by the world size only.")
    return fail("wrong_divisor", f"every p.grad held {c:.4g} x the mean gradient: the sum over the ranks divided "
                                 f"by {world_size / c:.4g}, where the mean needs {world_size}, the world size "
                                 "(dist.get_world_size()).")


def _value_verdict(outs: List[Dict[str, Any]], it: int, world_size: int) -> Optional[Verdict]:
    """The verdict from one iteration's gradients (None when every rank holds the mean everywhere)."""
    labels = value_labels(outs, it)
    kinds = {lab for row in labels for lab in row}
    if kinds == {"mean"}:
        return None
    reduced = [r for o in outs for r in iteration_records(o, it, "reduced")]
    verdict = first_value_verdict(kinds, reduced)
    if verdict is not None:
        return verdict
    others = sorted({c["op"] for o in outs for c in iteration_records(o, it, "collectives")} - {"all_reduce"})
    if others and not reduced:
        return other_collective_verdict(others[0], [o["iterations"][it]["after"] for o in outs], local_grads(outs, it))
    if kinds == {"sum"}:
        divided = [d for o in outs for d in iteration_records(o, it, "divisions")]
        if divided:
            return fail("rebound_divide", f"every rank holds {world_size}x the mean gradient, the sum over the "
                                          f"ranks, though your code divided a gradient {len(divided)} times in "
                                          "one backward: each division made a new tensor (`g = g / w`, "
                                          "`p.grad / w`) that never reached p.grad, which kept the sum. Divide "
                                          "p.grad itself, in place, or write the result into it.")
        return fail("no_divide", f"every rank holds {world_size}x the mean gradient, the sum over the ranks: "
                                 "all_reduce adds; divide each gradient by dist.get_world_size() (before the "
                                 "all_reduce, or after it has finished).")
    if kinds == {"half"}:
        return divided_twice_verdict(world_size)
    verdict = _divisor_verdict(outs, it, world_size)
    if verdict is not None:
        return verdict
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


def _later_verdict(outs: List[Dict[str, Any]], it: int) -> Verdict:
    """A backward after the first went wrong, the first did not: state carried between objects or backwards."""
    shared = next((s for s in map(changed_shared, outs) if s), None)
    if OBJECTS[it] not in OBJECTS[:it]:
        kept = (f" {shared[0].upper()}{shared[1:]} during the run: one object every instance shares, so the "
                "second object's hooks and finish() work on the first's too." if shared else "")
        return fail("second_object", "the first object's backward left the mean in every p.grad, but a second "
                                     "object of your class, built on another copy of the model (as when the "
                                     f"training cell runs again), did not.{kept} Keep everything an object "
                                     "collects in the object itself, made in __init__.")
    if shared:
        return fail("shared_state", f"after the first backward every p.grad held the mean, after backward {it + 1} "
                                    f"(the first object's again, after a second object had run) it did not; and "
                                    f"{shared} during the run: a class attribute is one object that every instance "
                                    "shares, so the second object's __init__, hooks or finish() changed what the "
                                    "first one uses. Make it in __init__, one per object (self.name = ...).")
    held = [o["iterations"][k]["held"] for o in outs[:1] for k in range(it) if OBJECTS[k] == OBJECTS[it]]
    kept = f" After its first finish() your object still held {held[0]} works or futures." if held and held[0] else ""
    return fail("stale_state", "after the first backward every p.grad held the mean, after a later one it did not: "
                               "what your object keeps from one backward to the next (works, gradients, counts) "
                               f"changed the next one's result.{kept} Empty what your object collects in finish(), "
                               "so that each backward starts afresh.")


def _state_verdict(outs: List[Dict[str, Any]]) -> Optional[Verdict]:
    """Right gradients, but works finish() never empties, or state kept in the class, shared by every instance."""
    its = outs[0]["iterations"]
    same = [k for k in range(len(its)) if OBJECTS[k] == 0]
    held = [its[k]["held"] for k in same]
    if len(held) > 1 and held[-1] > held[0]:
        return fail("kept_works", f"after finish() your object still held {held[0]} works or futures after its "
                                  f"first backward and {held[-1]} after its second: finish() never empties what it "
                                  "collects, so it grows by a backward's works every step, and keeps them all "
                                  "alive. Empty it in finish(), once every work is done.")
    shared = next((s for s in map(changed_shared, outs) if s), None)
    if shared:
        return fail("shared_state", f"{shared} during the run: a class attribute is one object "
                                    "that every instance of your class shares, so a second object (the training "
                                    "cell run again, two models) adds to the first's. Make it in __init__, one per "
                                    "object (self.name = ...).")
    return None


def _structure_verdict(outs: List[Dict[str, Any]], step: int) -> Optional[Verdict]:
    """Step 2 only: the gradients must leave during backward, each all_reduce asynchronous, waited for after."""
    if step == 1:
        return None
    for r, o in enumerate(outs):
        recs = [x for x in o["reduced"] if x.get("phase") in ("backward", "finish")]
        if any(not x["async"] and x["phase"] == "backward" for x in recs):  # in finish(): after_backward says it
            return fail("blocking", "an all_reduce without async_op=True blocks the hook until every rank has sent "
                                    "that gradient, so backward stops there: start it with async_op=True and wait "
                                    "for it in finish().")
        early = [x for x in recs if x.get("waited_in") in ("forward", "backward")]
        if early:
            return fail("waited_in_hook", f"{len(early)} of the {len(recs)} all_reduce(..., async_op=True) on rank "
                                          f"{r} were waited for during backward (wait() in the hook): backward "
                                          "stopped there until every rank had sent that gradient, just as with a "
                                          "blocking all_reduce. Keep each work, and wait for them in finish().")
    phases = [x.get("phase") for x in iteration_records(outs[0], 0, "reduced")]
    if phases and all(ph != "backward" for ph in phases):
        return fail("after_backward", "every all_reduce started after backward had returned (in finish()): that "
                                      "is step 1. Start each gradient's all_reduce in the hook autograd calls "
                                      "once p.grad is written, and only wait in finish().")
    return None


def _early_verdict(outs: List[Dict[str, Any]]) -> Optional[Verdict]:
    """The verdict from the learner's objects themselves: no finish(), hooks on another object's parameters, and
    call_verdict's."""
    kind = no_finish_type(outs)
    if kind is not None:
        return fail("no_finish", f"the object your class builds ({kind}) has no finish() method: the training "
                                 "loop calls sync.finish() after loss.backward(), and when it returns every p.grad "
                                 "must hold the mean.")
    foreign = [h for h in outs[0]["hooks"][-1] if h["on"] == "foreign"] if len(outs[0]["hooks"]) > 1 else []
    if foreign:
        shared = changed_shared(outs[0])
        held = (f": {shared} during the run, one object every instance shares. Make it in __init__, one per "
                "object, and" if shared else ":")
        return fail("shared_state", f"building a second object of your class, on another copy of the model, "
                                    f"registered {len(foreign)} hooks on the first object's parameters too{held} "
                                    "hook only the parameters of the model the object is given.")
    return call_verdict(outs, outs[0]["hooks"][0])


def _flow_verdict(outs: List[Dict[str, Any]]) -> Optional[Verdict]:
    """Every rank's works waited for; gradients, not parameters; nothing read or written before its wait()."""
    found = unwaited_on(outs)
    if found is not None:
        r, n, total = found
        return fail("unwaited", f"{n} of the {total} all_reduce(..., async_op=True) on rank {r} were never waited "
                                "for: the sum is in the tensor only once the work is done. In finish(), call .wait() "
                                "on every work the all_reduces returned.")
    if any(x["tensor"] in ("param", "param_copy") and x.get("phase") in LEARNING for o in outs for x in o["reduced"]):
        return fail("reduced_params", "you all-reduced the parameters (p or p.data), not their gradients: "
                                      "all_reduce p.grad.")
    verdict = next((v for it in range(len(outs[0]["iterations"])) if (v := _hook_strays(outs, it))), None)
    if verdict is not None:
        return verdict
    verdict, it = timing_verdict(outs, "changed_in_flight")
    if verdict is not None and it > 0:
        return _later_verdict(outs, it)
    return verdict


def diagnose(outs: List[Dict[str, Any]], world_size: int, step: int, notes: Dict[str, Any]) -> Optional[Verdict]:
    """The verdict for one run (None: every backward left the mean in every p.grad, as the step asks)."""
    verdict = (_early_verdict(outs) or where_verdict(outs, "Sum each gradient over the ranks with dist.all_reduce, "
                                                          "then divide by the world size.") or _flow_verdict(outs))
    if verdict is not None:
        return verdict
    for it in range(len(outs[0]["iterations"])):
        verdict = _value_verdict(outs, it, world_size)
        if verdict is not None:
            return _later_verdict(outs, it) if it > 0 else (registration_verdict(outs[0]["hooks"][0]) or verdict)
    verdict = _state_verdict(outs) or _structure_verdict(outs, step)
    if verdict is None and world_size == 2:
        rank0 = outs[0]
        ours = np.concatenate([g for it in rank0["iterations"] for g in it["after"]])
        torchs = np.concatenate([g for grads in rank0["ddp"] for g in grads])
        notes["ddp"] = agreement(ours, torchs, bound=1e-6)
    return verdict

