"""Exercise 5, average_gradients(model): every rank's p.grad must end equal to the mean over the ranks."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..engine.model import build_model
from ._harness import (Verdict, call_student, check_on_2_and_3_ranks, close, exercise, fail, student_outcomes,
                       swap_globals)
from ._reference import GRAD_BATCH, rank_batch, reference_grads

NUDGES = {
    "grad_removed": "some gradients are gone after your function.",
    "reduced_params": "the ranks combined something, but not the gradients.",
    "no_divide": "the ranks now agree, but not on the mean: what does all_reduce's default operation compute?",
    "divided_twice": "the ranks now agree, but their gradients are too small: count the divisions.",
    "op_max": "the ranks now agree, but not on the mean: which reduction did you ask all_reduce for?",
    "no_allreduce": "the ranks never combined their gradients, so they still differ.",
    "some_params": "the model has more than one parameter: were they all averaged?",
    "ranks_differ": "the ranks' gradients still differ after your function.",
}


def _grads(model: torch.nn.Module) -> List[Optional[np.ndarray]]:
    """A copy of each parameter's gradient as a flat float64 array (None where there is none)."""
    return [None if p.grad is None else p.grad.detach().clone().reshape(-1).double().numpy()
            for p in model.parameters()]


def _in_rank(rank: int, world_size: int, student_fn: Callable) -> Dict[str, Any]:
    """In each rank: local gradients, the learner's call (its all_reduces watched), the gradients afterwards."""
    model = build_model(seed=0)
    x, y = rank_batch(rank, 0, GRAD_BATCH)
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
    swap_globals(student_fn, real_all_reduce, watched)
    call = call_student(student_fn, model)
    dist.all_reduce = real_all_reduce
    call.pop("value", None)  # the function works in place; its return value is not used
    return {"call": call, "local": local, "after": _grads(model), "names": [n for n, _ in model.named_parameters()],
            "reduced": reduced}


def _labels(local: List[List[np.ndarray]], after: List[List[np.ndarray]], world_size: int) -> List[List[str]]:
    """For each rank and parameter: which candidate its gradient after the call equals ("other" for none)."""
    # The reference: one process on the global batch (every rank's batch). Equal batch sizes make it the mean.
    mean = reference_grads(world_size, [0], GRAD_BATCH)
    candidates = {
        "mean": lambda r, i: mean[i],
        "sum": lambda r, i: mean[i] * world_size,
        "twice": lambda r, i: mean[i] / world_size,
        "max": lambda r, i: np.max([local[q][i] for q in range(world_size)], axis=0),
        "local": lambda r, i: local[r][i],
        "local_div": lambda r, i: local[r][i] / world_size,
    }

    def label(r: int, i: int) -> str:
        return next((k for k, f in candidates.items() if close(after[r][i], f(r, i))), "other")

    return [[label(r, i) for i in range(len(mean))] for r in range(world_size)]


def _diagnose(outs: List[Dict[str, Any]], world_size: int) -> Optional[Verdict]:
    """The verdict for one run (None when every rank holds the mean gradient)."""
    student_outcomes(outs)
    names = outs[0]["names"]
    n_params = len(names)
    local = [[np.asarray(g) for g in o["local"]] for o in outs]
    after = [o["after"] for o in outs]
    if any(a is None for o in after for a in o):
        return fail("grad_removed", "some p.grad is None after your function: average the gradients in place "
                                    "(all_reduce p.grad, then divide), don't delete them.")
    labels = _labels(local, after, world_size)
    flat = {lab for row in labels for lab in row}
    if flat == {"mean"}:
        return None
    if flat <= {"local", "local_div"} and any("param" in o["reduced"] for o in outs):
        return fail("reduced_params", "you all_reduce'd the parameters, not their gradients: all_reduce p.grad, "
                                      "not p (or p.data).")
    if flat == {"sum"}:
        return fail("no_divide", f"rank 1's gradients equal rank 0's but are {world_size}x the mean (the sum): "
                                 "divide every p.grad by dist.get_world_size() after the all_reduce.")
    if flat == {"twice"}:
        return fail("divided_twice", f"the gradients are {world_size}x smaller than the mean: you divided twice "
                                     "(ReduceOp.AVG already divides; or a division before and after the "
                                     "all_reduce).")
    if flat == {"max"}:
        return fail("op_max", "every rank holds the element-wise maximum of the gradients: use "
                              "op=dist.ReduceOp.SUM and divide by the world size (or ReduceOp.AVG).")
    if flat == {"local"}:
        return fail("no_allreduce", "the gradients are unchanged, so rank 1's still differ from rank 0's: call "
                                    "dist.all_reduce(p.grad) for every parameter.")
    if flat == {"local_div"}:
        return fail("no_allreduce", "each rank divided its own gradient but never combined them: call "
                                    "dist.all_reduce(p.grad) before dividing.")
    ok = [names[i] for i in range(n_params) if all(labels[r][i] == "mean" for r in range(world_size))]
    if ok:
        missed = [names[i] for i in range(n_params) if names[i] not in ok]
        return fail("some_params", f"only some parameters were averaged ({', '.join(ok)}; not "
                                   f"{', '.join(missed)}): loop over all of model.parameters().")
    if any(not close(after[r][i], after[0][i]) for r in range(1, world_size) for i in range(n_params)):
        return fail("ranks_differ", "rank 1's gradients differ from rank 0's after your function: every rank must "
                                    "end with the same, averaged gradient (all_reduce, then divide by the world "
                                    "size).")
    return fail("wrong_value", "all ranks agree, but not on the mean of their gradients: all_reduce with "
                               "ReduceOp.SUM, then divide by the world size.")


@exercise("average_gradients", NUDGES)
def check_average_gradients(student_fn: Callable, world_size: Optional[int] = None) -> str:
    """Exercise 5: average_gradients(model) must leave every rank's p.grad equal to the mean over ranks."""
    sizes = check_on_2_and_3_ranks(_in_rank, _diagnose, student_fn, world_size)
    return ("after your function every rank holds the mean gradient (the single-process gradient of the global "
            f"batch), on {' and on '.join(map(str, sizes))} ranks.")


