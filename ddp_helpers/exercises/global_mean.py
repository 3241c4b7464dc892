"""Exercise 2, global_mean(value): every rank must get the element-wise mean of value over all ranks."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from ._compare import close, fmt
from ._harness import Verdict, call_student, check_on_2_and_3_ranks, exercise, fail, student_outcomes
from ._watch import Classify, storage_of, watch_all_reduce

MEAN_VALUES = ([1.0, 8.0], [5.0, 2.0], [9.0, -1.0], [-3.0, 4.0])  # rank r's; sum, max, mean, min tell apart

NUDGES = {
    "no_return": "the ranks did combine their tensors, but look at what your function gives back.",
    "no_divide": "every rank got the same numbers, but not the mean: what does all_reduce's default operation "
                 "compute?",
    "divided_twice": "every rank got the same numbers, but too small: count how many times the world size "
                     "divides them.",
    "op_max": "every rank got the same numbers, but not the mean: which reduction did you ask all_reduce for?",
    "no_allreduce": "the ranks never combined their tensors: which collective lets every rank see all the "
                    "others' values?",
    "reduced_copy": "there was an all_reduce, yet each rank got its own numbers back: which tensor holds the "
                    "sum?",
    "returned_copy": "there was an all_reduce, yet each rank got its own numbers back: which tensor did you "
                     "return?",
    "ranks_differ": "the ranks don't agree on the result: do they all run the same steps?",
}


def _value(rank: int) -> List[float]:
    """Rank r's tensor: fixed for the first ranks (their sum, max and mean all differ), a formula beyond."""
    return MEAN_VALUES[rank] if rank < len(MEAN_VALUES) else [2.5 * rank - 1.0, 7.0 - rank]


def _classifier(value: torch.Tensor) -> Classify:
    """What a tensor given to all_reduce is: the learner's `value` (or a view of it), a copy of it, or other."""
    original = value.clone()

    def classify(t: torch.Tensor) -> Tuple[str, Optional[int]]:
        if storage_of(t) == storage_of(value):
            return "value", None
        same = t.shape == original.shape and torch.equal(t.detach().to(original.dtype), original)
        return ("copy" if same else "other"), None

    return classify


def _in_rank(rank: int, world_size: int, student_fn: Callable) -> Dict[str, Any]:
    """In each rank: the learner's function on this rank's tensor (its all_reduces recorded), that tensor after."""
    value = torch.tensor(_value(rank))
    with watch_all_reduce(student_fn, _classifier(value)) as reduced:
        call = call_student(student_fn, value)
    if call["status"] == "ok":
        v = call["value"]
        call["value"] = None if v is None else torch.as_tensor(v, dtype=torch.float64).reshape(-1).tolist()
    return {"call": call, "input_after": value.tolist(), "reduced": reduced}


def _diagnose(outs: List[Dict[str, Any]], world_size: int) -> Optional[Verdict]:
    """The verdict for one run (None when every rank got the mean)."""
    calls = student_outcomes(outs)
    vals = np.array([_value(r) for r in range(world_size)])
    mean, total = vals.mean(0), vals.sum(0)
    got = [c["value"] for c in calls]
    if any(g is None for g in got):
        if all(close(o["input_after"], mean) for o in outs):
            return fail("no_return", "the mean is in the tensor you all_reduce'd, but your function returned None: "
                                     "return that tensor.")
        return fail("no_return", "your function returned None: return the averaged tensor.")
    if any(len(g) != len(mean) for g in got):
        return fail("wrong_shape", f"expected a tensor of {len(mean)} numbers, got {[len(g) for g in got]}.")
    if all(close(g, mean) for g in got):
        return None
    reduced = outs[0]["reduced"]
    ops = {r["op"] for r in reduced}
    if all(close(g, total) for g in got):
        return fail("no_divide", f"every rank got the sum {fmt(total)}, not the mean {fmt(mean)}: divide by "
                                 "dist.get_world_size() after the all_reduce.")
    if all(close(g, total / world_size ** 2) for g in got):
        how = ("ReduceOp.AVG already divides, and you divided again" if "AVG" in ops else
               "ReduceOp.SUM adds, and you divided by the world size twice")
        return fail("divided_twice", f"every rank got {fmt(total / world_size ** 2)}, world_size times smaller "
                                     f"than the mean: you divided twice ({how}).")
    if all(close(g, vals.max(0)) for g in got):
        asked = f" (you asked all_reduce for op=ReduceOp.{sorted(ops)[0]})" if ops else ""
        return fail("op_max", f"every rank got the element-wise maximum {fmt(vals.max(0))}{asked}: use "
                              "op=dist.ReduceOp.SUM (the default), then divide by the world size.")
    own = all(close(g, vals[r]) for r, g in enumerate(got))
    if own or all(close(g, vals[r] / world_size) for r, g in enumerate(got)):
        return _own_value(own, reduced)
    if not all(close(g, got[0]) for g in got):
        return fail("ranks_differ", f"the ranks disagree: rank 0 got {fmt(got[0])}, rank 1 got {fmt(got[1])}; "
                                    f"every rank should get the mean {fmt(mean)}.")
    return fail("wrong_value", f"every rank got {fmt(got[0])}, expected the mean {fmt(mean)}.")


def _own_value(undivided: bool, reduced: List[Dict[str, Any]]) -> Verdict:
    """The verdict when each rank got its own value back (undivided or divided): no all_reduce, or not of it."""
    if any(r["tensor"] == "value" for r in reduced):  # reduced in place, then e.g. a saved copy returned
        return fail("returned_copy", "you all-reduced value, but returned a tensor saved before the all_reduce: "
                                     "return value itself (all_reduce changes it in place), divided by the "
                                     "world size.")
    if reduced:
        what = "a copy of value" if reduced[0]["tensor"] == "copy" else "a tensor that is not value itself"
        returned = "value" if undivided else "value divided by the world size"
        return fail("reduced_copy", f"you all-reduced {what}, but returned {returned}, and value still holds this "
                                    "rank's own numbers: the sum is in the tensor you gave all_reduce. Return that "
                                    "one (divided), or all-reduce value itself.")
    if undivided:
        return fail("no_allreduce", "each rank returned its own value (no all_reduce was called): call "
                                    "dist.all_reduce(value) so the ranks combine their tensors.")
    return fail("no_allreduce", "each rank divided its own value but never combined them (no all_reduce was "
                                "called): call dist.all_reduce(value) before dividing.")


@exercise("global_mean", NUDGES)
def check_global_mean(student_fn: Callable, world_size: Optional[int] = None) -> str:
    """Exercise 2: global_mean(value) must return the element-wise mean of value over all ranks."""
    sizes = check_on_2_and_3_ranks(_in_rank, _diagnose, student_fn, world_size)
    return f"every rank gets the mean, on {' and on '.join(map(str, sizes))} ranks."


