"""Exercise 6, accumulation_step(ddp_model, optimizer, micro_batches): no_sync on all but the last micro-batch.

The hints follow torch's contract: DDP's forward decides whether the backward that follows all-reduces (it
reads `require_backward_grad_sync`, which no_sync() clears, in `_pre_forward`/`_post_forward` and prepares the
reducer only when it is set). So the check logs, per micro-batch, where its forward and where its backward ran.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ..engine.model import build_model
from ._compare import rel_close
from ._harness import Verdict, call_student, exercise, fail, run_ranks, student_outcomes
from ._reference import rank_batch, reference_grads, reference_model
from ._watch import record_ddp_events

ACC_MICRO, ACC_BATCH, ACC_LR = 3, 8, 0.5  # micro-batches per step, samples per micro-batch, SGD learning rate
WORLD_SIZE = 2

NUDGES = {
    "no_step": "the parameters never moved: which call applies the gradients?",
    "step_each": "the optimizer stepped more than once for one call of your function.",
    "no_sync_everywhere": "the replicas ended up different: did any backward pass communicate at all?",
    "ranks_differ": "the replicas ended up different after the step.",
    "no_no_sync": "the update is right, but count how often the ranks communicated.",
    "loss_not_scaled": "the update has the right direction but the wrong size: what does one step on the mean "
                       "loss of all micro-batches need?",
    "last_forward_inside": "the replicas ended up different: not even the last backward communicated. Which part "
                           "of the last micro-batch's step decides whether its backward all-reduces?",
    "bypassed_ddp": "the replicas ended up different: not even the last backward communicated. Which model did "
                    "the last micro-batch run through?",
    "forward_outside_no_sync": "the update is right and you used no_sync(), yet the ranks communicated more than "
                               "once: which call reads no_sync()'s setting, the forward or the backward?",
    "zero_grad_inside": "not every micro-batch's gradient made it into the step: where do gradients get reset?",
    "missing_backward": "not every micro-batch's gradient made it into the step: did each one get a backward?",
    "wrong_update": "the update is not one step on the mean loss of all the micro-batches.",
    "divided_by_world_size": "the update has the right direction but the wrong size: what does DDP's all-reduce "
                             "already do to the gradients?",
}


def _flat_params(model: torch.nn.Module) -> np.ndarray:
    """All parameters as one flat float64 vector."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().numpy()


def _in_rank(rank: int, world_size: int, student_fn: Callable) -> Dict[str, Any]:
    """In each rank: the learner's step on a DDP model, with a log of its forwards, backwards, all-reduces, steps."""
    model = build_model(seed=0)
    ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=ACC_LR)
    events = record_ddp_events(ddp, optimizer)

    def counting_hook(state, bucket):  # no annotations: DDP checks them, and here they would be strings
        events.append(("allreduce",))  # one call per bucket per synchronized backward (this model: one bucket)
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_hook)
    micro = [rank_batch(rank, k, ACC_BATCH) for k in range(ACC_MICRO)]
    call = call_student(student_fn, ddp, optimizer, micro)
    call.pop("value", None)
    return {"call": call, "events": events, "params": _flat_params(model)}


def _reference_grad(world_size: int, micro_ids: Sequence[int], scale: float) -> np.ndarray:
    """reference_grads over the given micro-batches of every rank, as one flat vector, times scale."""
    return np.concatenate(reference_grads(world_size, micro_ids, ACC_BATCH)) * scale


DOCSTRING = ("torch's no_sync docstring: 'The forward pass should be included inside the context manager, or "
             "else gradients will still be synchronized'")


@dataclass
class _Story:
    """Rank 0's event log, read: its micro-batches (one per forward, in order) and what each did."""

    ddp_sync: Dict[int, bool] = field(default_factory=dict)  # micro-batch -> sync flag of its forward through DDP
    bypassed: List[int] = field(default_factory=list)  # micro-batches whose forward called ddp_model.module
    backward_sync: Dict[int, bool] = field(default_factory=dict)  # micro-batch -> sync flag when its backward ran
    order: List[Tuple[str, int]] = field(default_factory=list)  # ("backward", k) and ("allreduce", 0), in order
    zero_grads: List[Tuple[str, int]] = field(default_factory=list)  # (who, backwards before it), before the step
    allreduces: int = 0
    steps: int = 0

    @classmethod
    def read(cls, events: Sequence[Tuple[Any, ...]]) -> "_Story":
        s, number = cls(), {}  # number: forward event id -> micro-batch number (1, 2, ...)
        for e in events:
            if e[0] in ("forward", "module_forward"):
                number[e[1]] = k = len(number) + 1
                if e[0] == "forward":
                    s.ddp_sync[k] = e[2]
                else:
                    s.bypassed.append(k)
            elif e[0] == "backward" and number[e[1]] not in s.backward_sync:
                s.backward_sync[number[e[1]]] = e[2]
                s.order.append(("backward", number[e[1]]))
            elif e[0] == "allreduce":
                s.allreduces += 1
                s.order.append(("allreduce", 0))
            elif e[0] == "zero_grad" and not s.steps:
                s.zero_grads.append((e[1], len(s.backward_sync)))
            elif e[0] == "step":
                s.steps += 1
        return s

    def forward_outside(self) -> List[int]:
        """Micro-batches whose backward ran inside no_sync() but whose forward ran outside it (so they synced)."""
        return [k for k, b in self.backward_sync.items() if not b and self.ddp_sync.get(k)]

    def forward_inside(self) -> List[int]:
        """Micro-batches whose backward ran outside no_sync() but whose forward ran inside it (so they did not)."""
        return [k for k, b in self.backward_sync.items() if b and self.ddp_sync.get(k) is False]


def _mb(ks: Sequence[int]) -> str:
    """'micro-batch 2', 'micro-batches 1 and 2', 'micro-batches 1, 2 and 3'."""
    ks = [str(k) for k in ks]
    if len(ks) == 1:
        return f"micro-batch {ks[0]}"
    return f"micro-batches {', '.join(ks[:-1])} and {ks[-1]}"


def _no_allreduce(s: _Story) -> Verdict:
    """The verdict for a step with no all-reduce at all: which forward or backward kept it from happening."""
    last = s.order[-1][1] if s.order else None
    if last in s.bypassed:
        return fail("bypassed_ddp", f"no all-reduce happened: the forward of {_mb([last])} called "
                                    "ddp_model.module(x), the model inside DDP, so DDP never saw it and its backward "
                                    "could not all-reduce. Run the last micro-batch's forward through ddp_model(x).")
    inside = s.forward_inside()
    if inside:
        return fail("last_forward_inside", f"no all-reduce happened: the backward of {_mb(inside)} ran outside "
                                           f"ddp_model.no_sync(), but {_its(inside)} ran inside it, and the "
                                           "forward decides: inside no_sync(), DDP's forward does not prepare the "
                                           f"all-reduce of the backward that follows ({DOCSTRING}). Run the last "
                                           "micro-batch's forward outside no_sync() too.")
    synced = [k for k, v in s.ddp_sync.items() if v]
    if synced:  # such a forward's backward would have all-reduced
        return fail("missing_backward", f"no all-reduce happened: {_mb(synced)} ran forward outside no_sync(), "
                                        "but never backward. Call backward() on each micro-batch's loss.")
    return fail("no_sync_everywhere", "no all-reduce happened, so each rank stepped with its own gradient and the "
                                      "replicas now differ: every forward and backward ran inside no_sync(). Run "
                                      "the last micro-batch's forward and backward outside ddp_model.no_sync().")


def _its(ks: Sequence[int]) -> str:
    """'its forward' for one micro-batch, 'their forwards' for several."""
    return "its forward" if len(ks) == 1 else "their forwards"


def _ranks_differ(s: _Story) -> Verdict:
    """The verdict for replicas that differ after the step: which gradient stayed local after the last sync."""
    cut = max((i for i, (what, _) in enumerate(s.order) if what == "allreduce"), default=-1)
    late = [k for what, k in s.order[cut + 1:] if what == "backward"]
    if late:
        return fail("ranks_differ", f"the ranks' parameters differ after the step: {_mb(late)} accumulated locally "
                                    "after the last all-reduce, so each rank stepped with its own part of the "
                                    "gradient. Run only the last micro-batch's forward and backward outside "
                                    "no_sync(), after all the others: its all-reduce carries everything "
                                    "accumulated before it.")
    return fail("ranks_differ", "the ranks' parameters differ after the step: every rank must run the same "
                                "number of synchronized backward passes.")


def _too_many(s: _Story) -> Verdict:
    """The verdict for the right update with more than one all-reduce: which micro-batches synced, and why."""
    outside = s.forward_outside()
    if outside:
        return fail("forward_outside_no_sync", f"right result, but the gradients were all-reduced {s.allreduces} "
                                               f"times: the backward of {_mb(outside)} ran inside "
                                               f"ddp_model.no_sync(), but {_its(outside)} ran outside it, and the "
                                               "forward decides: outside no_sync(), DDP's forward prepares the "
                                               f"all-reduce of the backward that follows, wherever it runs "
                                               f"({DOCSTRING}). Compute the model's output and the loss inside "
                                               "no_sync() too.")
    synced = [k for k, v in s.ddp_sync.items() if v and k != max(s.ddp_sync)]
    if len(synced) < len(s.ddp_sync) - 1:
        return fail("no_no_sync", f"right result, but the gradients were all-reduced {s.allreduces} times: "
                                  f"{_mb(synced)} ran outside ddp_model.no_sync() although not the last. Let "
                                  "every forward and backward except the last run inside it.")
    return fail("no_no_sync", f"right result, but the gradients were all-reduced {s.allreduces} times, once per "
                              "micro-batch: let every forward and backward except the last run inside DDP's "
                              "no_sync() context, so that they accumulate locally and only one all-reduce runs.")


def _lost_micro_batches(s: _Story) -> Optional[Verdict]:
    """The verdict when some micro-batches' gradients never reached the step: reset, or never backward."""
    reset = [(who, n) for who, n in s.zero_grads if n > 0]
    if reset:
        who, n = reset[0]
        return fail("zero_grad_inside", f"only the last micro-batch counted: {who}.zero_grad() ran after "
                                        f"{_mb(range(1, n + 1))}'s backward, inside the loop, and threw those "
                                        "gradients away. Call optimizer.zero_grad() once, before the loop, so the "
                                        "micro-batches' gradients add up.")
    forwards = sorted(set(s.ddp_sync) | set(s.bypassed))
    missing = [k for k in forwards if k not in s.backward_sync]
    if missing:
        return fail("missing_backward", f"{_mb(missing)} ran forward but never backward, so their gradients are "
                                        "not in the step: call backward() on each micro-batch's loss, inside the "
                                        "loop.")
    return None


def _judge_update(s: _Story, used: Sequence[np.ndarray], world_size: int) -> str:
    """The PASS text, or the verdict for the update the ranks applied (they agree with each other)."""
    expected = _reference_grad(world_size, range(ACC_MICRO), 1.0)
    if rel_close(used[0], expected):
        if s.allreduces > 1:
            raise _too_many(s)
        return (f"one all-reduce for {ACC_MICRO} micro-batches, and the update equals one SGD step on the mean "
                "gradient of the whole global batch.")
    if rel_close(used[0], expected * ACC_MICRO):
        raise fail("loss_not_scaled", f"the update is {ACC_MICRO}x too large: divide each micro-batch's loss by "
                                      "the number of micro-batches (len(micro_batches)) before backward().")
    by_ranks = _divided_by_world_size(used[0], expected, world_size)
    if by_ranks is not None:
        raise by_ranks
    lost = _lost_micro_batches(s)
    if lost is not None:
        raise lost
    last = [ACC_MICRO - 1]
    if rel_close(used[0], _reference_grad(world_size, last, 1.0 / ACC_MICRO)) or rel_close(
            used[0], _reference_grad(world_size, last, 1.0)):
        raise fail("zero_grad_inside", "only the last micro-batch counted: the earlier micro-batches' gradients "
                                       "were reset before the step (p.grad = None or zero_() inside the loop?). "
                                       "Reset the gradients once, before the loop, so they add up.")
    if not np.any(used[0]):
        raise fail("no_step", "the parameters did not change: call optimizer.step() after the last backward.")
    raise fail("wrong_update", "the update differs from one SGD step on the mean gradient of all micro-batches "
                               "of all ranks. Compare it with the one-process recipe: how often are the gradients "
                               "reset, how is each micro-batch's loss weighted, how many steps are taken?")


def _divided_by_world_size(used: np.ndarray, expected: np.ndarray, world_size: int) -> Optional[Verdict]:
    """The verdict for a loss divided by the world size, too or instead of by the number of micro-batches."""
    avg = "DDP's all-reduce already averages the gradients over the ranks (it divides their sum by the world size)"
    if rel_close(used, expected / world_size):
        return fail("divided_by_world_size", f"the update is {world_size}x too small: you divided each "
                                             "micro-batch's loss by the world size as well as by the number of "
                                             f"micro-batches, but {avg}. Divide by len(micro_batches) only.")
    if rel_close(used, expected * ACC_MICRO / world_size):
        return fail("divided_by_world_size", f"the update is {ACC_MICRO}/{world_size} of the right one: you divided "
                                             "each micro-batch's loss by the world size instead of by the number of "
                                             f"micro-batches, but {avg}. Divide by len(micro_batches) instead.")
    return None


@exercise("accumulation_step", NUDGES)
def check_accumulation_step(student_fn: Callable, world_size: Optional[int] = None) -> str:
    """Exercise 6: accumulation_step(ddp_model, optimizer, micro_batches) with no_sync on all but the last."""
    world_size = world_size or WORLD_SIZE
    outs = run_ranks(_in_rank, world_size, (student_fn,))
    student_outcomes(outs)
    s = _Story.read(outs[0]["events"])
    if s.steps == 0:
        raise fail("no_step", "optimizer.step() was never called: call it once, after the last micro-batch's "
                              "backward.")
    if s.steps > 1:
        raise fail("step_each", f"optimizer.step() ran {s.steps} times: accumulate over all {ACC_MICRO} "
                                "micro-batches, then step once.")
    p0 = _flat_params(reference_model(0))
    used = [(p0 - o["params"]) / ACC_LR for o in outs]  # the gradient each rank's SGD step actually applied
    if s.allreduces == 0:
        raise _no_allreduce(s)
    if not all(rel_close(u, used[0], 1e-6) for u in used):
        raise _ranks_differ(s)
    return _judge_update(s, used, world_size)
