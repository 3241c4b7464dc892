"""Notebook 0's two hand-built synchronizations, worked: the code stop 5 runs until the learner's own classes pass
their checks, and the solution its "Stuck?" boxes show (tests/lesson/test_core_sync.py keeps the two the same).

The learner writes both in the notebook; `ddp_helpers.exercises.core_sync` checks what they wrote.
"""
from __future__ import annotations

import torch.distributed as dist


class AfterBackward:
    """Step 1: after backward, all-reduce every gradient and divide it by the world size."""

    def __init__(self, model):
        self.model = model

    def finish(self):
        for p in self.model.parameters():
            dist.all_reduce(p.grad)  # the sum over the ranks, on every rank
            p.grad /= dist.get_world_size()  # the mean


class AsGradientsArrive:
    """Step 2: a hook on each parameter starts its all-reduce as soon as autograd
    has its gradient; finish() waits for them."""

    def __init__(self, model):
        self.works = []
        for p in model.parameters():
            # called with p once p.grad holds this backward's gradient
            p.register_post_accumulate_grad_hook(self.ready)

    def ready(self, p):
        p.grad /= dist.get_world_size()  # divided first, as DDP does: the sum is then the mean
        # async_op=True returns at once; gloo's own thread sends
        self.works.append(dist.all_reduce(p.grad, async_op=True))

    def finish(self):
        for work in self.works:
            work.wait()  # when it returns, this gradient holds the mean
        self.works.clear()  # the next backward starts with no works
