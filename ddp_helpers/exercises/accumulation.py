"""Exercise 6, accumulation_step(ddp_model, optimizer, micro_batches): no_sync on all but the last backward."""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ..engine.model import build_model
from ._harness import call_student, exercise, fail, rel_close, run_ranks, student_outcomes
from ._reference import rank_batch, reference_grads, reference_model

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
    "zero_grad_inside": "not every micro-batch's gradient made it into the step: where do gradients get reset?",
    "wrong_update": "the update is not one step on the mean loss of all the micro-batches.",
}


def _flat_params(model: torch.nn.Module) -> np.ndarray:
    """All parameters as one flat float64 vector."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double().numpy()


def _in_rank(rank: int, world_size: int, student_fn: Callable) -> Dict[str, Any]:
    """In each rank: the learner's step on a DDP model, counting its all-reduces and optimizer steps."""
    model = build_model(seed=0)
    ddp = DDP(model)
    calls = [0]

    def counting_hook(state, bucket):  # no annotations: DDP checks them, and here they would be strings
        calls[0] += 1  # one call per bucket per synchronized backward (this model fits in one bucket)
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=ACC_LR)
    steps = [0]
    optimizer.register_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
    micro = [rank_batch(rank, k, ACC_BATCH) for k in range(ACC_MICRO)]
    call = call_student(student_fn, ddp, optimizer, micro)
    call.pop("value", None)
    params = _flat_params(model)
    return {"call": call, "allreduces": calls[0], "steps": steps[0], "params": params}


def _reference_grad(world_size: int, micro_ids: Sequence[int], scale: float) -> np.ndarray:
    """reference_grads over the given micro-batches of every rank, as one flat vector, times scale."""
    return np.concatenate(reference_grads(world_size, micro_ids, ACC_BATCH)) * scale


@exercise("accumulation_step", NUDGES)
def check_accumulation_step(student_fn: Callable, world_size: Optional[int] = None) -> str:
    """Exercise 6: accumulation_step(ddp_model, optimizer, micro_batches) with no_sync on all but the last."""
    world_size = world_size or WORLD_SIZE
    outs = run_ranks(_in_rank, world_size, (student_fn,))
    student_outcomes(outs)
    steps, calls = outs[0]["steps"], outs[0]["allreduces"]
    if steps == 0:
        raise fail("no_step", "optimizer.step() was never called: call it once, after the last micro-batch's "
                              "backward.")
    if steps > 1:
        raise fail("step_each", f"optimizer.step() ran {steps} times: accumulate over all {ACC_MICRO} "
                                "micro-batches, then step once.")
    p0 = _flat_params(reference_model(0))
    used = [(p0 - o["params"]) / ACC_LR for o in outs]  # the gradient each rank's SGD step actually applied
    if calls == 0:
        raise fail("no_sync_everywhere", "no all-reduce happened, so each rank stepped with its own gradient and "
                                         "the replicas now differ: run the last micro-batch's backward outside "
                                         "ddp_model.no_sync().")
    if not all(rel_close(u, used[0], 1e-6) for u in used):
        raise fail("ranks_differ", "the ranks' parameters differ after the step: every rank must run the same "
                                   "number of synchronized backward passes.")
    expected = _reference_grad(world_size, range(ACC_MICRO), 1.0)
    if rel_close(used[0], expected):
        if calls > 1:
            raise fail("no_no_sync", f"right result, but the gradients were all-reduced {calls} times, once per "
                                     "micro-batch: let every backward except the last accumulate "
                                     "locally, inside DDP's no_sync() context, so only one all-reduce runs.")
        return (f"one all-reduce for {ACC_MICRO} micro-batches, and the update equals one SGD step on the mean "
                "gradient of the whole global batch.")
    if rel_close(used[0], expected * ACC_MICRO):
        raise fail("loss_not_scaled", f"the update is {ACC_MICRO}x too large: divide each micro-batch's loss by "
                                      "the number of micro-batches (len(micro_batches)) before backward().")
    last = [ACC_MICRO - 1]
    if rel_close(used[0], _reference_grad(world_size, last, 1.0 / ACC_MICRO)) or rel_close(
            used[0], _reference_grad(world_size, last, 1.0)):
        raise fail("zero_grad_inside", "only the last micro-batch counted: call optimizer.zero_grad() once, before "
                                       "the loop, so the micro-batches' gradients add up.")
    if not np.any(used[0]):
        raise fail("no_step", "the parameters did not change: call optimizer.step() after the last backward.")
    raise fail("wrong_update", "the update differs from one SGD step on the mean gradient of all micro-batches "
                               "of all ranks. Compare it with the one-process recipe: how often are the gradients "
                               "reset, how is each micro-batch's loss weighted, how many steps are taken?")


