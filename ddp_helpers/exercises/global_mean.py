"""Exercise 2, global_mean(value): every rank must get the element-wise mean of value over all ranks."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

from ._harness import (Verdict, call_student, check_on_2_and_3_ranks, close, exercise, fail, fmt,
                       student_outcomes)

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
    "ranks_differ": "the ranks don't agree on the result: do they all run the same steps?",
}


def _value(rank: int) -> List[float]:
    """Rank r's tensor: fixed for the first ranks (their sum, max and mean all differ), a formula beyond."""
    return MEAN_VALUES[rank] if rank < len(MEAN_VALUES) else [2.5 * rank - 1.0, 7.0 - rank]


def _in_rank(rank: int, world_size: int, student_fn: Callable) -> Dict[str, Any]:
    """In each rank: the learner's function on this rank's tensor, and that tensor afterwards."""
    value = torch.tensor(_value(rank))
    call = call_student(student_fn, value)
    if call["status"] == "ok":
        v = call["value"]
        call["value"] = None if v is None else torch.as_tensor(v, dtype=torch.float64).reshape(-1).tolist()
    return {"call": call, "input_after": value.tolist()}


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
    if all(close(g, total) for g in got):
        return fail("no_divide", f"every rank got the sum {fmt(total)}, not the mean {fmt(mean)}: divide by "
                                 "dist.get_world_size() after the all_reduce.")
    if all(close(g, total / world_size ** 2) for g in got):
        return fail("divided_twice", f"every rank got {fmt(total / world_size ** 2)}, world_size times smaller "
                                     "than the mean: you divided twice (ReduceOp.AVG already divides).")
    if all(close(g, vals.max(0)) for g in got):
        return fail("op_max", f"every rank got the element-wise maximum {fmt(vals.max(0))}: use "
                              "op=dist.ReduceOp.SUM (the default), then divide by the world size.")
    if all(close(g, vals[r]) for r, g in enumerate(got)):
        return fail("no_allreduce", "each rank returned its own value: call dist.all_reduce(value) so the ranks "
                                    "combine their tensors.")
    if all(close(g, vals[r] / world_size) for r, g in enumerate(got)):
        return fail("no_allreduce", "each rank divided its own value but never combined them: call "
                                    "dist.all_reduce(value) before dividing.")
    if not all(close(g, got[0]) for g in got):
        return fail("ranks_differ", f"the ranks disagree: rank 0 got {fmt(got[0])}, rank 1 got {fmt(got[1])}; "
                                    f"every rank should get the mean {fmt(mean)}.")
    return fail("wrong_value", f"every rank got {fmt(got[0])}, expected the mean {fmt(mean)}.")


@exercise("global_mean", NUDGES)
def check_global_mean(student_fn: Callable, world_size: Optional[int] = None) -> str:
    """Exercise 2: global_mean(value) must return the element-wise mean of value over all ranks."""
    sizes = check_on_2_and_3_ranks(_in_rank, _diagnose, student_fn, world_size)
    return f"every rank gets the mean, on {' and on '.join(map(str, sizes))} ranks."


