"""Exercise 5, average_gradients(model): every rank's p.grad must end equal to the mean over the ranks."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ..engine.model import build_model
from ._compare import close
from ._harness import Verdict, call_student, check_on_2_and_3_ranks, exercise, fail, student_outcomes
from ._reference import GRAD_BATCH, rank_batch, reference_grads
from ._watch import Classify, storage_of, unwaited, watch_all_reduce

NUDGES = {
    "grad_removed": "some gradients are gone after your function.",
    "reduced_params": "the ranks combined something, but not the gradients.",
    "no_divide": "the ranks now agree, but not on the mean: what does all_reduce's default operation compute?",
    "divided_twice": "the ranks now agree, but their gradients are too small: count the divisions.",
    "op_max": "the ranks now agree, but not on the mean: which reduction did you ask all_reduce for?",
    "no_allreduce": "the ranks never combined their gradients, so they still differ.",
    "reduced_copy": "there was an all_reduce, yet every p.grad is still this rank's own: which tensor did it "
                    "change?",
    "no_wait": "your all_reduces run in the background: when is their result there?",
    "some_params": "the model has more than one parameter: were they all averaged?",
    "ranks_differ": "the ranks' gradients still differ after your function.",
}


def _grads(model: torch.nn.Module) -> List[Optional[np.ndarray]]:
    """A copy of each parameter's gradient as a flat float64 array (None where there is none)."""
    return [None if p.grad is None else p.grad.detach().clone().reshape(-1).double().numpy()
            for p in model.parameters()]


def _classifier(model: torch.nn.Module) -> Classify:
    """What a tensor given to all_reduce is: a p.grad (or its view), a parameter, a copy of either, or other."""
    params = list(model.parameters())

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.detach(), b.detach())

    def classify(t: torch.Tensor) -> Tuple[str, Optional[int]]:
        s = storage_of(t)  # read now: the learner may have replaced a p.grad on the way
        for i, p in enumerate(params):
            if p.grad is not None and storage_of(p.grad) == s:
                return "grad", i
            if storage_of(p) == s:
                return "param", i
        for i, p in enumerate(params):
            if p.grad is not None and same(t, p.grad):
                return "grad_copy", i
            if same(t, p):
                return "param_copy", i
        if params and all(p.grad is not None for p in params) and t.dim() == 1 and same(
                t, torch.cat([p.grad.reshape(-1) for p in params])):
            return "flat_copy", None
        return "other", None

    return classify


def _in_rank(rank: int, world_size: int, student_fn: Callable) -> Dict[str, Any]:
    """In each rank: local gradients, the learner's call (its all_reduces recorded), the gradients afterwards."""
    model = build_model(seed=0)
    x, y = rank_batch(rank, 0, GRAD_BATCH)
    F.cross_entropy(model(x), y).backward()
    local = _grads(model)
    with watch_all_reduce(student_fn, _classifier(model)) as reduced:
        call = call_student(student_fn, model)
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


COPIES = {"grad_copy": "a copy of p.grad (a new tensor, e.g. p.grad.clone())",
          "flat_copy": "one new tensor made from all the gradients (e.g. torch.cat)",
          "other": "a tensor that is not p.grad itself"}
STATES = {"local": "never all-reduced", "local_div": "divided but never all-reduced",
          "sum": "all-reduced but not divided by the world size", "twice": "divided twice", "max": "reduced with MAX"}


def _copy_problem(reduced: List[Dict[str, Any]]) -> Optional[Verdict]:
    """The verdict when gradients are unchanged because the all_reduces went to something other than p.grad."""
    kinds = {r["tensor"] for r in reduced}
    if kinds & {"param", "param_copy"}:
        what = "the parameters" if "param" in kinds else "copies of the parameters"
        return fail("reduced_params", f"you all_reduce'd {what}, not their gradients: all_reduce p.grad, not p "
                                      "(or p.data).")
    copies = [k for k in COPIES if k in kinds]
    if copies:
        return fail("reduced_copy", f"you all-reduced {COPIES[copies[0]]}, and the result never reached p.grad, "
                                    "which still holds this rank's own gradient. all_reduce changes the tensor "
                                    "it is given in place: give it p.grad itself, or copy the result back into "
                                    "p.grad.")
    return None


def _uniform_problem(kind: str, reduced: List[Dict[str, Any]], world_size: int) -> Optional[Verdict]:
    """The verdict when every gradient of every rank is the same wrong candidate (kind)."""
    ops = {r["op"] for r in reduced}
    if kind == "sum":
        return fail("no_divide", f"rank 1's gradients equal rank 0's but are {world_size}x the mean (the sum): "
                                 "divide every p.grad by dist.get_world_size() after the all_reduce.")
    if kind == "twice":
        how = ("ReduceOp.AVG already divides by the world size, and you divided again" if "AVG" in ops else
               "ReduceOp.SUM adds the gradients, and they were divided by the world size twice (once before "
               "the all_reduce and once after?)")
        return fail("divided_twice", f"the gradients are {world_size}x smaller than the mean: you divided twice. "
                                     f"{how}: divide once.")
    if kind == "max":
        asked = f" (you asked all_reduce for op=ReduceOp.{sorted(ops)[0]})" if ops else ""
        return fail("op_max", f"every rank holds the element-wise maximum of the gradients{asked}: use "
                              "op=dist.ReduceOp.SUM and divide by the world size (or ReduceOp.AVG).")
    if kind in ("local", "local_div") and not reduced:
        if kind == "local":
            return fail("no_allreduce", "no all_reduce was called, so the gradients are unchanged and rank 1's "
                                        "still differ from rank 0's: call dist.all_reduce(p.grad) for every "
                                        "parameter.")
        return fail("no_allreduce", "each rank divided its own gradient but never combined them (no all_reduce "
                                    "was called): call dist.all_reduce(p.grad) before dividing.")
    return None


def _some_params(names: List[str], labels: List[List[str]], reduced: List[Dict[str, Any]]) -> Optional[Verdict]:
    """The verdict when some parameters hold the mean and others don't: what happened to each of the others."""
    ok = [n for i, n in enumerate(names) if all(row[i] == "mean" for row in labels)]
    if not ok:
        return None
    touched = {r["index"] for r in reduced if r["tensor"] == "grad"}
    missed = [(n, labels[0][i], i in touched) for i, n in enumerate(names) if n not in ok]
    said = "; ".join(f"{n} {STATES.get(lab, 'ended with another value')}" for n, lab, _ in missed)
    fix = (" loop over all of model.parameters()." if any(not t for _, _, t in missed) else
           " every gradient needs the same all_reduce and the same division.")
    return fail("some_params", f"only some parameters were averaged ({', '.join(ok)}; {said}):{fix}")


def _diagnose(outs: List[Dict[str, Any]], world_size: int) -> Optional[Verdict]:
    """The verdict for one run (None when every rank holds the mean gradient), from the gradients and the
    record of what the learner all-reduced."""
    student_outcomes(outs)
    names = outs[0]["names"]
    local = [[np.asarray(g) for g in o["local"]] for o in outs]
    after = [o["after"] for o in outs]
    reduced = [r for o in outs for r in o["reduced"]]
    if any(a is None for o in after for a in o):
        return fail("grad_removed", "some p.grad is None after your function: average the gradients in place "
                                    "(all_reduce p.grad, then divide), don't delete them.")
    pending = unwaited(outs[0]["reduced"])
    if pending:
        n = len(pending)
        return fail("no_wait", f"{n} all_reduce(..., async_op=True) call{'s' if n > 1 else ''} on rank 0 "
                               f"{'were' if n > 1 else 'was'} never waited for: they finish in the background, "
                               "whenever, so what p.grad holds when your function returns is luck. Call .wait() "
                               "on the work each one returns before you use p.grad.")
    labels = _labels(local, after, world_size)
    flat = {lab for row in labels for lab in row}
    if flat == {"mean"}:
        return None
    if flat <= {"local", "local_div"} and not any(r["tensor"] == "grad" for r in reduced):
        found = _copy_problem(reduced)
        if found is not None:
            return found
    verdict = _uniform_problem(next(iter(flat)), reduced, world_size) if len(flat) == 1 else None
    verdict = verdict or _some_params(names, labels, reduced)
    if verdict is not None:
        return verdict
    if any(not close(after[r][i], after[0][i]) for r in range(1, world_size) for i in range(len(names))):
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


