"""A DDP communication hook that records each bucket's local gradient, then all-reduces it as DDP would."""
# No "from __future__ import annotations": DDP checks the hook's annotations at runtime.
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist


class GradRecorder:
    """State handed to the hook: what it saw in this backward pass, and what it sent in total."""

    def __init__(self, compress: str = "allreduce", record: bool = True,
                 group: Optional[dist.ProcessGroup] = None):
        self.compress = compress  # "allreduce" (exact, float32) or "fp16" (half the bytes, rounded)
        self.record = record  # False = the bare loop: only count, no norms
        self.group = group  # the process group to average over (None = the default group, as DDP's own hooks)
        self.capture = False  # set for steps whose full local gradient is kept
        self.local_sq: List[torch.Tensor] = []  # squared L2 norm of each bucket before the all-reduce
        self.buckets: List[torch.Tensor] = []  # the bucket buffers: after backward they hold the averaged gradient
        self.local_grads: Dict[int, torch.Tensor] = {}  # id(param) -> local gradient copy, when capturing
        self.bytes_sent = 0  # payload handed to all-reduce, summed over the run
        self.calls = 0  # hook calls = buckets all-reduced

    def start_step(self, capture: bool) -> None:
        """Forget the previous step's buckets."""
        self.local_sq.clear()
        self.buckets.clear()
        self.local_grads.clear()
        self.capture = capture

    def squared_norms(self) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
        """Squared L2 norms (local, synced) of the whole gradient, as 0-d tensors; call after backward().

        None when no all-reduce ran. Squared, so that the caller can fetch them with the loss in one transfer
        and take the square roots in Python.
        """
        if not self.local_sq:
            return None
        # Read the synchronized values here, in the training thread, rather than in the future's callback
        # (which runs on a communication thread and would have to take the GIL in the middle of backward).
        synced_sq = [b.dot(b) for b in self.buckets]
        if len(self.local_sq) == 1:  # the usual case for small models: one bucket, no extra ops
            return self.local_sq[0], synced_sq[0]
        return torch.stack(self.local_sq).sum(), torch.stack(synced_sq).sum()


def recording_allreduce_hook(state: GradRecorder, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Record the bucket's local gradient, then average it across ranks (what DDP's default hook does)."""
    buf = bucket.buffer()  # this rank's gradients for the bucket, flattened: still local at this point
    if state.record:
        state.local_sq.append(buf.dot(buf))  # squared L2 norm, one op (half the cost of vector_norm().square())
        state.buckets.append(buf)
        if state.capture:
            for p, g in zip(bucket.parameters(), bucket.gradients()):
                state.local_grads[id(p)] = g.detach().clone()
    state.calls += 1
    group = state.group or dist.group.WORLD
    world = group.size()
    if state.compress == "fp16":
        # Send half the bytes: divide first so the fp16 sum can't overflow, then decompress into the bucket.
        payload = buf.to(torch.float16).div_(world)
        state.bytes_sent += payload.numel() * payload.element_size()
        fut = group.allreduce([payload]).get_future()

        def decompress(f: torch.futures.Future) -> torch.Tensor:
            return buf.copy_(f.value()[0])

        return fut.then(decompress)
    buf.div_(world)  # sum of (g_r / N) over ranks = the mean gradient, identical on every rank
    state.bytes_sent += buf.numel() * buf.element_size()
    # group.allreduce([t]) is the collective that dist.all_reduce(t, async_op=True) runs (SUM by default), minus
    # that function's per-call argument checks: ~50 us here, and a hook runs on every step.
    fut = group.allreduce([buf]).get_future()  # in place: buf becomes the averaged gradient
    return fut.then(lambda f: f.value()[0])
