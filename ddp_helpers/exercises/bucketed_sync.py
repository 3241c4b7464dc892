"""Notebook 3b's exercise, bucketed_sync(model, cap_bytes): DDP's bucketed gradient hook, built by the learner.

The learner's function registers hooks on the model's parameters and returns finish(). Each rank runs the frame of
_sync_frame on it (its function called on two copies of the check's model, then three backward passes, each
followed by finish(); what the frame records is said there) and records besides each gradient as it arrives,
before the learner's hooks see it, and, for every all_reduce the learner starts, which parameters' gradients its
tensor held, in which order (read from its values against the gradients arrived). So a hint names what was done
(a handle never waited for, no division, the last partial bucket never sent, buckets filled in forward order, the
result never written back into p.grad), not the first wrong number it caused; _bucket_verdicts names it.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ._bucket_verdicts import CAP_BYTES, diagnose, waits_seen
from ._harness import call_student, exercise
from ._sync_checks import NUDGES as SHARED_NUDGES
from ._sync_frame import ITERATIONS, Grads, SyncRun, check_sync, grads, params_of

# Linear layers (in, out): 10 tensors from 3 to 144 numbers; with CAP_BYTES, several buckets and a partial last one.
LAYERS = ((6, 10), (10, 12), (12, 12), (12, 8), (8, 3))
BATCH = 16

NUDGES = {
    **SHARED_NUDGES,  # the nudges worded as in notebook 0's check (_sync_checks); then this check's own
    "no_finish": "the exercise asks for a function back: what does the training loop call after backward?",
    "not_written_back": "there were all_reduces, yet every p.grad is still this rank's own: where does the result "
                        "end up?",
    "not_flushed": "most gradients were averaged, but not all: which bucket was never sent?",
    "stale_state": "the first backward's gradients were right, the second's were not: what does your code "
                   "remember from one backward to the next?",
    "one_bucket": "all the gradients travelled in one all_reduce.",
    "per_parameter": "every gradient travelled on its own.",
    "forward_order": "the gradients are right, but look at which parameters share a bucket.",
    "read_before_wait": "an asynchronous all_reduce returns at once: when may its buffer be read?",
    "changed_in_flight": "an asynchronous all_reduce returns at once: when may its buffer be changed?",
    "sent_before_full": "the gradients are not the mean: was every bucket complete when you sent it?",
    "stale_buffer": "the first backward's gradients were right, the second's were not: what is in your flat "
                    "buffer when the second backward starts?",
    "after_backward": "the gradients are right, but nothing travelled while backward was running.",
    "wrong_offsets": "the gradients are not the mean: where in the bucket does each gradient sit?",
    "kept_works": "your gradients are right, but look at what your code still holds after finish().",
    "second_call": "the first call's gradients were right, a second call's were not: what do your calls share?",
    "shared_state": "look at where your code keeps what it collects.",
}


def net() -> nn.Sequential:
    """The check's model: five Linear layers with ReLUs between them, the same weights on every rank."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers: List[nn.Module] = []
        for i, (a, b) in enumerate(LAYERS):
            layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(LAYERS) - 1 else [])
        return nn.Sequential(*layers)


def _batch(rank: int, iteration: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * iteration + rank)
    return torch.randn(BATCH, LAYERS[0][0], generator=g), torch.randint(0, LAYERS[-1][1], (BATCH,), generator=g)


def _layout(t: torch.Tensor, arrived: Dict[int, torch.Tensor], world_size: int) -> Optional[List[int]]:
    """Which parameters' gradients t holds, in its order (the arrived ones, divided by the world size or not);
    None when its values are not a row of arrived gradients."""
    flat, order, offset = t.detach().reshape(-1), [], 0
    while offset < flat.numel():
        for i, g in arrived.items():
            seg = flat[offset:offset + g.numel()]
            if i not in order and seg.numel() == g.numel() and (
                    torch.allclose(seg, g, rtol=1e-5, atol=1e-9) or
                    torch.allclose(seg * world_size, g, rtol=1e-5, atol=1e-9)):
                order.append(i)
                offset += g.numel()
                break
        else:
            return None
    return order


class _BucketRun(SyncRun):
    """Notebook 3b's exercise in a rank: the learner's function called on each copy of the model, the finish() it
    returns after each backward; each gradient recorded as it arrives (hooks registered before the learner's), and
    what each all_reduce's tensor held (the calls)."""

    def __init__(self, student_fn: Callable, rank: int, world_size: int):
        models = [net()]
        models.append(copy.deepcopy(models[0]))
        super().__init__(student_fn, models, rank)
        self.local_model, self.world_size = copy.deepcopy(models[0]), world_size
        self.arrivals: List[Dict[int, torch.Tensor]] = [{} for _ in models]
        self.calls: List[Dict[str, Any]] = []
        for arrived, model in zip(self.arrivals, models):
            for i, p in enumerate(model.parameters()):
                p.register_post_accumulate_grad_hook(
                    lambda p, i=i, arrived=arrived: arrived.__setitem__(i, p.grad.detach().reshape(-1).clone()))

    @property
    def arrived(self) -> Dict[int, torch.Tensor]:
        """The gradients of the model now running, as they arrived in this backward."""
        return self.arrivals[self.running["object"]]

    def make(self, model: nn.Module) -> Dict[str, Any]:
        return call_student(self.student, model, CAP_BYTES)

    def finish_of(self, made: Any) -> Any:
        return made

    def classify(self, t: torch.Tensor) -> Tuple[str, Optional[int]]:
        """What an all_reduce's tensor is: where it was started, and the parameters it held (see _layout)."""
        self.calls.append({"phase": self.phase(), "numel": t.numel(), "n_arrived": len(self.arrived),
                           "layout": _layout(t, self.arrived, self.world_size), "object": self.running["object"]})
        return "tensor", len(self.calls) - 1

    def batch(self, it: int) -> Tuple[torch.Tensor, torch.Tensor]:
        return _batch(self.rank, it)

    def own_grads(self, it: int, x: torch.Tensor, y: torch.Tensor) -> Grads:
        self.local_model.zero_grad(set_to_none=True)
        F.cross_entropy(self.local_model(x), y).backward()  # this rank's own gradients, no hooks
        return grads(self.local_model)

    def before_backward(self) -> None:
        self.arrived.clear()

    def watch_more(self, stack: contextlib.ExitStack) -> Dict[str, List[Dict[str, Any]]]:
        return {"calls": self.calls}


def _in_rank(rank: int, world_size: int, student_fn: Callable) -> Dict[str, Any]:
    """In each rank: the learner's function on two copies of the check's model, then three backward passes."""
    run = _BucketRun(student_fn, rank, world_size)
    return run.run(sizes=[p.numel() * p.element_size() for p in params_of(run.models[0])])


@exercise("bucketed_sync", NUDGES)
def check_bucketed_sync(student_fn: Callable, world_size: Optional[int] = None) -> str:
    """Notebook 3b: bucketed_sync(model, cap_bytes) must average the gradients in buckets sent during backward."""
    sizes, outs = check_sync(_in_rank, diagnose, student_fn, world_size,
                             hardcoded=("no_divide", "divided_twice", "wrong_value"))
    return (f"{ITERATIONS} backward passes left the mean gradient in every p.grad, carried in buckets filled from "
            "the last layer back, each all-reduced with async_op=True while backward was running"
            f"{waits_seen(outs)}, on {' and on '.join(map(str, sizes))} ranks.")
