"""Notebook 0's two blanks, checked: `AfterBackward` (step 1) and `AsGradientsArrive` (step 2).

The learner writes a class built as `sync = Cls(model)` whose `sync.finish()` the training loop calls after
`loss.backward()` and before `optimizer.step()`. Each rank builds two objects, on two copies of the model (as a
notebook does when its training cell runs again), and runs three backward passes: the first object's, the second
object's, the first object's again; after each `finish()` it compares every p.grad with the mean of the ranks'
own gradients, and, on 2 ranks, with torch's DDP's (run first, on the same model and batches), bit for bit. Then an
optimizer step (lr 0: the weights stay) runs whatever the learner hung on `optimizer.step()`.

Each rank runs the frame of _sync_frame (which says what it records: the hooks, every collective, each
all_reduce and its wait(), the works each object still holds after finish(), the class attributes every instance
shares), with an optimizer step after each finish() and the divisions of a p.grad into a new tensor recorded too.
_core_verdicts then names what the code did, from every rank's records.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from ..lesson.handbuilt import build_net
from ._core_verdicts import diagnose
from ._harness import call_student, exercise, fail
from ._reference import rank_batch
from ._sync_checks import NUDGES as SHARED_NUDGES
from ._sync_frame import ITERATIONS, Grads, SyncRun, backward_error, check_sync, grads, params_of
from ._sync_watch import watch_divisions
from .average_gradients import _classifier

BATCH = 16
NUDGES = {
    **SHARED_NUDGES,  # the nudges worded as in notebook 3b's check (_sync_checks); then this check's own
    "no_finish": "the training loop calls sync.finish() after backward: does your object have it?",
    "read_before_wait": "an asynchronous all_reduce returns at once: when may its tensor be read?",
    "changed_in_flight": "an asynchronous all_reduce returns at once: when may its tensor be changed?",
    "rebound_divide": "the ranks agree, but not on the mean: where did your division go?",
    "wrong_divisor": "the ranks agree, but not on the mean: what did you divide by?",
    "reduced_copy": "there were all_reduces, yet every p.grad is still this rank's own: which tensor did they "
                    "change?",
    "reduced_params": "the ranks combined something, but not the gradients.",
    "some_params": "the model has twelve gradient tensors: were they all averaged?",
    "ignores_argument": "look at what your hook does with the parameter autograd calls it with.",
    "stale_state": "the first backward's gradients were right, a later one's were not: what does your object "
                   "keep from one backward to the next?",
    "second_object": "the first object's gradients were right, a second object's were not: what do your objects "
                     "share?",
    "kept_works": "your gradients are right, but look at what your object still holds after finish().",
    "shared_state": "your gradients are right, but look at where your class keeps what it collects.",
    "sync_in_step": "look at when your code runs: before or after finish() returns?",
    "after_backward": "your gradients are right, but nothing travelled while backward was running.",
}


def _model() -> torch.nn.Module:
    """Notebook 0's six-layer net, built without moving this process's random state."""
    with torch.random.fork_rng(devices=[]):
        return build_net(0)


def _references(model: torch.nn.Module, rank: int) -> Dict[str, List[Grads]]:
    """Before any of the learner's code: each iteration's gradients of torch's DDP (on a copy; the check's own
    collectives) and this rank's own (the local model, no synchronization)."""
    ddp, local = DistributedDataParallel(copy.deepcopy(model)), copy.deepcopy(model)
    out: Dict[str, List[Any]] = {"ddp": [], "local": []}
    for it in range(ITERATIONS):
        x, y = rank_batch(rank, it, BATCH)
        for key, net, inner in (("ddp", ddp, ddp.module), ("local", local, local)):
            net.zero_grad(set_to_none=True)
            F.cross_entropy(net(x), y).backward()
            out[key].append(grads(inner))
    return out


class _ClassRun(SyncRun):
    """Notebook 0's blanks in a rank: an object of the learner's class per copy of the model, its finish() after
    each backward, then an optimizer step (lr 0: the weights stay) that runs whatever the learner hung on it; a
    p.grad divided into a new tensor is recorded too."""

    def __init__(self, student_cls: Any, models: List[torch.nn.Module], rank: int, local: List[Grads]):
        super().__init__(student_cls, models, rank)
        self.local = local
        self.optimizers = [torch.optim.SGD(m.parameters(), lr=0.0) for m in models]
        self.classifiers = [_classifier(m) for m in models]

    def make(self, model: torch.nn.Module) -> Dict[str, Any]:
        return call_student(self.student, model)

    def finish_of(self, made: Any) -> Any:
        return getattr(made, "finish", None)

    def classify(self, t: torch.Tensor) -> Tuple[str, Optional[int]]:
        return self.classifiers[self.running["object"]](t)

    def batch(self, it: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return rank_batch(self.rank, it, BATCH)

    def own_grads(self, it: int, x: torch.Tensor, y: torch.Tensor) -> Grads:
        return self.local[it]

    def watch_more(self, stack: contextlib.ExitStack) -> Dict[str, List[Dict[str, Any]]]:
        return {"divisions": stack.enter_context(watch_divisions(self._running_params, self.phase))}

    def _running_params(self) -> List[torch.nn.Parameter]:
        return params_of(self.models[self.running["object"]])

    def after_finish(self, k: int, result: Dict[str, Any]) -> None:
        self.running["phase"] = "step"
        try:
            self.optimizers[k].step()  # lr 0: only what the learner hung on the step changes anything
        except Exception as e:  # noqa: BLE001 - an error in the learner's step hook becomes a hint
            if result["call"]["status"] == "ok":
                result["call"] = backward_error(e, self.student, self.running)
        self.running["phase"] = "after"


def _in_rank(rank: int, world_size: int, student_cls: Any) -> Dict[str, Any]:
    """In each rank: the references, then two objects of the learner's class and three backward passes."""
    model = _model()
    references = _references(model, rank)
    run = _ClassRun(student_cls, [model, copy.deepcopy(model)], rank, references["local"])
    return run.run(ddp=references["ddp"], batch=BATCH)


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
    sizes, outs = check_sync(_in_rank, lambda outs, size: diagnose(outs, size, step, notes), student_cls,
                             world_size, hardcoded=("no_divide", "divided_twice", "wrong_value", "some_params",
                                                    "wrong_divisor"))
    notes["how"] = how_seen(outs)
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
