"""Notebook 11's exercise, global_loss(local_loss, n_samples): the mean loss over every sample of every rank,
weighted by each rank's samples, with one collective, the caller's tensor left alone.

Besides the learner's own torch.distributed calls, each rank records the c10d collectives they ran (a call like
all_gather_object runs two all_gathers), so that the PASS line says what the answer sent.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

from ..lesson.comms import CommRecorder
from ._compare import close
from ._harness import Verdict, call_student, check_on_2_and_3_ranks, exercise, fail, student_outcomes
from ._watch import watch_collectives

# Rank r's mean loss and number of samples: the counts differ, so the plain mean of the ranks' losses is wrong,
# and every wrong combination below (sum, mean of means, / world size, / own count) gives another number.
LOSSES = (2.5, 0.5, 1.25, 3.0)
COUNTS = (7, 12, 8, 6)

NUDGES = {
    "no_return": "look at what your function gives back.",
    "wrong_shape": "the exercise asks for one number: look at what your function gives back.",
    "rank_local": "each rank got a different number: can a rank know the global loss from its own numbers alone?",
    "unweighted": "every rank got the same number, but not the loss of all the samples: do the ranks have the "
                  "same number of samples?",
    "no_divide": "every rank got the same number, but far too large: what does an all_reduce's default "
                 "operation compute?",
    "not_divided": "every rank got the same number, but far too large: what is missing to turn a sum of losses "
                   "into a mean?",
    "divided_by_world_size": "every rank got the same number, but not the mean: what do you divide the sum of "
                             "the losses by?",
    "local_count": "the ranks don't agree on the result: which number of samples do you divide by?",
    "two_collectives": "right value, but count your communication calls: the exercise asks for one.",
    "changed_input": "right value, but look at the caller's local_loss after your function returns.",
    "ranks_differ": "the ranks don't agree on the result: do they all run the same steps?",
    "wrong_value": "every rank got the same number, but not the mean loss of all the samples.",
    "reduced_to_one": "one rank got the right number and the others did not: which ranks receive the result of your "
                      "collective?",
}
# The collectives that deliver their result to one rank (dst) only.
TO_ONE_RANK = ("reduce", "gather", "gather_object")
# c10d's op names (what the ranks ran) as the torch.distributed calls a learner knows.
_WIRE_NAMES = {"allreduce_": "all_reduce", "allgather_": "all_gather", "_allgather_base_": "all_gather",
               "allgather_into_tensor_coalesced_": "all_gather", "broadcast_": "broadcast", "reduce_": "reduce",
               "gather_": "gather", "scatter_": "scatter", "reduce_scatter_": "reduce_scatter",
               "_reduce_scatter_base_": "reduce_scatter", "alltoall_base_": "all_to_all", "barrier": "barrier"}


def _loss(rank: int) -> float:
    return LOSSES[rank] if rank < len(LOSSES) else 0.75 + 0.5 * rank


def _count(rank: int) -> int:
    return COUNTS[rank] if rank < len(COUNTS) else 3 + 2 * rank


def _as_numbers(value: Any) -> Any:
    """What the learner returned, as a flat list of floats (None stays None; anything else: its type's name)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        value = value.detach()
    try:
        return torch.as_tensor(value, dtype=torch.float64).reshape(-1).tolist()
    except (TypeError, ValueError, RuntimeError):
        return type(value).__name__


def _in_rank(rank: int, world_size: int, student_fn: Callable) -> Dict[str, Any]:
    """In each rank: the learner's function on this rank's loss and count (its collectives recorded), the loss after."""
    local_loss = torch.tensor(_loss(rank))  # float32, 0-dim: what `loss.detach()` is in a training loop
    with watch_collectives(student_fn) as calls, CommRecorder() as wire:
        call = call_student(student_fn, local_loss, _count(rank))
    if call["status"] == "ok":
        call["value"] = _as_numbers(call["value"])
    return {"call": call, "input_after": local_loss.item(), "collectives": calls,
            "wire": [_WIRE_NAMES.get(c["op"], c["op"].strip("_")) for c in wire.calls]}


def _listed(counts: np.ndarray) -> str:
    """'4, 12 and 8' for the ranks' sample counts."""
    words = [f"{c:g}" for c in counts]
    return ", ".join(words[:-1]) + f" and {words[-1]}"


def _described(calls: List[Dict[str, Any]]) -> str:
    """'all_reduce, all_reduce' for the collectives a rank called."""
    return ", ".join(c["op"] for c in calls)


def _diagnose(outs: List[Dict[str, Any]], world_size: int) -> Optional[Verdict]:
    """The verdict for one run (None when every rank got the weighted global loss, with one collective)."""
    calls = student_outcomes(outs)
    losses = np.array([_loss(r) for r in range(world_size)])
    counts = np.array([_count(r) for r in range(world_size)], dtype=np.float64)
    total = float((losses * counts).sum())
    weighted = total / counts.sum()
    got = [c["value"] for c in calls]
    if any(g is None for g in got):
        return fail("no_return", "your function returned None: return the global loss (a float or a 0-dim "
                                 "tensor).")
    if any(isinstance(g, str) for g in got):
        kind = next(g for g in got if isinstance(g, str))
        return fail("wrong_shape", f"your function returned a {kind}: return one number (a float or a 0-dim "
                                   "tensor).")
    if any(len(g) != 1 for g in got):
        return fail("wrong_shape", f"your function returned {len(got[0])} numbers on rank 0: return one number, "
                                   "the mean loss of all the samples.")
    vals = [g[0] for g in got]
    colls = outs[0]["collectives"]
    if all(close(v, weighted) for v in vals):
        return _right_value(outs, colls)
    if not colls:
        own = " (its own loss)" if all(close(v, losses[r]) for r, v in enumerate(vals)) else ""
        return fail("rank_local", f"each rank returned a number of its own{own} and your function called no "
                                  "collective: the global loss needs every rank's losses and sample counts, "
                                  "combined with an all_reduce.")
    to_one = [c["op"] for c in colls if c["op"] in TO_ONE_RANK]
    right = [r for r, v in enumerate(vals) if close(v, weighted)]
    if to_one and right and len(right) < len(vals):
        wrong = next(r for r in range(len(vals)) if r not in right)
        return fail("reduced_to_one", f"rank {right[0]} got the mean loss of all the samples ({weighted:.4g}), but "
                                      f"rank {wrong} got {vals[wrong]:.4g}: dist.{to_one[0]} delivers its result to "
                                      "one rank (dst) only, and leaves the others' tensors holding whatever the "
                                      "reduction left there. Every rank needs the global loss (any rank may log it, "
                                      "and a rank that acts on it, to stop early say, must act as the others do): "
                                      "all_reduce leaves the sum on every rank.")
    if all(close(v, vals[0]) for v in vals):
        return _same_wrong_value(vals[0], losses, counts, colls)
    if all(close(v, total / counts[r]) for r, v in enumerate(vals)):
        return fail("local_count", f"each rank divided the sum of all the losses ({total:g}) by its own "
                                   f"n_samples ({_listed(counts)}): divide by the number of "
                                   "samples of all ranks, summed by the same all_reduce.")
    return fail("ranks_differ", f"the ranks disagree: rank 0 got {vals[0]:.4g}, rank 1 got {vals[1]:.4g}; every "
                                f"rank should get the mean loss of all the samples, {weighted:.4g}.")


def _right_value(outs: List[Dict[str, Any]], colls: List[Dict[str, Any]]) -> Optional[Verdict]:
    """The verdict for the right value: one collective only, and the caller's local_loss unchanged."""
    if len(colls) > 1:
        return fail("two_collectives", f"right value, but each rank made {len(colls)} collective calls "
                                       f"({_described(colls)}): every call is a round trip that waits for all "
                                       "ranks. Put the loss sum and the sample count in one tensor and all-reduce "
                                       "it once.")
    changed = [r for r, o in enumerate(outs) if not close(o["input_after"], _loss(r))]
    if changed:
        r = changed[0]
        return fail("changed_input", f"right value, but your function changed the caller's local_loss in place: "
                                     f"on rank {r} it held {outs[r]['input_after']:.4g} afterwards instead of "
                                     f"{_loss(r):g}. The caller still uses it (to log the rank's own loss, or for "
                                     "backward): compute on a new tensor (e.g. `local_loss * n_samples`, not `*=`).")
    return None


def _same_wrong_value(v: float, losses: np.ndarray, counts: np.ndarray, colls: List[Dict[str, Any]]) -> Verdict:
    """The verdict when every rank got the same wrong number: which wrong formula gives it."""
    total, w = float((losses * counts).sum()), len(losses)
    weighted = total / counts.sum()
    if close(v, losses.mean()):
        how = " (ReduceOp.AVG gives every rank's loss the same weight)" if any(
            c["reduce"] == "AVG" for c in colls) else ""
        return fail("unweighted", f"every rank got the plain mean of the ranks' losses, {v:.4g}{how}, not the loss "
                                  f"of all the samples, {weighted:.4g}: the ranks have "
                                  f"{_listed(counts)} samples, so weight each rank's loss by "
                                  "its n_samples (sum loss x n_samples and n_samples over the ranks, then divide).")
    if close(v, losses.sum()):
        return fail("no_divide", f"every rank got the sum of the ranks' losses, {v:.4g}: all_reduce adds "
                                 f"(ReduceOp.SUM), and a sum of means is not a mean; expected {weighted:.4g}.")
    if close(v, total):
        return fail("not_divided", f"every rank got {v:.4g}, the sum of the losses of all the samples (loss x "
                                   f"n_samples, summed), but never divided it by the number of samples, "
                                   f"{counts.sum():g}.")
    if close(v, total / w):
        return fail("divided_by_world_size", f"every rank got the sum of the losses of all the samples divided by "
                                             f"the number of ranks ({total:g} / {w}): divide by the number of "
                                             f"samples of all ranks ({counts.sum():g}) instead.")
    return fail("wrong_value", f"every rank got {v:.4g}, expected the mean loss of all the samples, {weighted:.4g} "
                               "(the sum of loss x n_samples over the ranks, divided by the sum of n_samples).")


def _ran(out: Dict[str, Any]) -> str:
    """'with one all_reduce', or 'with one collective call, all_gather_object, which torch ran as 2 all_gathers
    (...)': what a rank that passed called, and the collectives that call ran."""
    call = out["collectives"][0]["op"]
    wire = out["wire"]
    if wire == [call]:
        return f"with one {call}"
    ran = ", ".join(f"{n} {op}{'s' * (n > 1)}" for op, n in Counter(wire).items())
    why = " (each rank's pickled size, then the pickled bytes)" if call.endswith(("_object", "_object_list")) else ""
    return f"with one collective call, {call}, which torch ran as {ran}{why}"


@exercise("global_loss", NUDGES)
def check_global_loss(student_fn: Callable, world_size: Optional[int] = None) -> str:
    """Notebook 11: global_loss(local_loss, n_samples) must return the mean loss of all samples, on every rank."""
    runs: List[List[Dict[str, Any]]] = []

    def diagnose(outs: List[Dict[str, Any]], size: int) -> Optional[Verdict]:
        runs.append(outs)
        return _diagnose(outs, size)

    sizes = check_on_2_and_3_ranks(_in_rank, diagnose, student_fn, world_size,
                                   hardcoded=(("wrong_value", "unweighted", "divided_by_world_size"),
                                              "is a number of ranks or samples written into your code? The "
                                              "totals come from the all_reduce."))
    return (f"every rank gets the mean loss of all the samples, weighted by each rank's count, {_ran(runs[-1][0])}, "
            f"on {' and on '.join(map(str, sizes))} ranks.")
