"""DDP communication hooks that record each bucket's local gradient, then hand it to one of torch's own hooks.

`recording(hook)` wraps a standard hook the way torch's `fp16_compress_wrapper` wraps one: it adds one concern
(looking at the gradient before it is averaged) and leaves the communication to the hook it wraps.
"""
# No "from __future__ import annotations": DDP checks the hook's annotations at runtime.
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

Hook = Callable[[Optional[dist.ProcessGroup], dist.GradBucket], torch.futures.Future]

# comm_hook setting -> (torch's hook, the dtype it sends, None = the bucket's own)
# allreduce_hook divides the float32 bucket by the world size W, then all-reduces the sum: the mean.
# fp16_compress_hook casts the bucket to float16 FIRST, then divides by W (in float16), all-reduces the float16
# sum and copies it back into the float32 bucket. Dividing before summing keeps the sum of W values from
# overflowing float16 (largest 65504), but the cast comes first: an entry above 65504 is already inf, one
# below 6.1e-5 (the smallest normal float16) keeps fewer digits, one below ~3e-8 is already 0, and the division
# then pushes small entries further into subnormals or to 0 (underflow). Normal-sized entries keep about 3
# significant digits. torch's bf16_compress_hook (not offered here) sends bfloat16 instead: the same
# halving of bytes with float32's exponent range (no overflow or underflow worth mentioning), but only about
# 2-3 significant digits, and it needs NCCL >= 2.9.6 on GPUs.
COMM_HOOKS: Dict[str, Tuple[Hook, Optional[torch.dtype]]] = {
    "allreduce": (default_hooks.allreduce_hook, None),  # bucket / W, then all-reduce the sum: the exact mean
    "fp16": (default_hooks.fp16_compress_hook, torch.float16),  # cast, / W, sum in float16: half the bytes
}


class GradRecorder:
    """State handed to the hook: what it saw in this backward pass, and what it sent in total."""

    def __init__(self, record: bool = True, wire_dtype: Optional[torch.dtype] = None,
                 process_group: Optional[dist.ProcessGroup] = None):
        self.record = record  # False = only count calls and bytes, no norms
        self.wire_dtype = wire_dtype  # the dtype the wrapped hook sends (None = the bucket's own)
        self.process_group = process_group  # None = the default group, as in torch's own hooks
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

    def see(self, bucket: dist.GradBucket) -> None:
        """Record a bucket before it is averaged: its squared norm, and every gradient when capturing."""
        buf = bucket.buffer()  # this rank's gradients for the bucket, flattened: still local at this point
        self.calls += 1
        self.bytes_sent += buf.numel() * (self.wire_dtype or buf.dtype).itemsize
        if not self.record:
            return
        self.local_sq.append(buf.dot(buf))  # squared L2 norm, one op (half the cost of vector_norm().square())
        self.buckets.append(buf)
        if self.capture:
            for p, g in zip(bucket.parameters(), bucket.gradients()):
                self.local_grads[id(p)] = g.detach().clone()

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


def recording(hook: Hook) -> Callable[[GradRecorder, dist.GradBucket], torch.futures.Future]:
    """A hook that records each bucket in its GradRecorder state, then runs `hook` on it."""

    def recording_hook(state: GradRecorder, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        state.see(bucket)
        return hook(state.process_group, bucket)  # e.g. allreduce_hook: bucket /= world size, then all_reduce

    recording_hook.__name__ = f"recording_{getattr(hook, '__name__', 'hook')}"
    return recording_hook


def attach_recorder(ddp: torch.nn.parallel.DistributedDataParallel, comm_hook: str, record: bool) -> GradRecorder:
    """Register recording(COMM_HOOKS[comm_hook]) on ddp and return its state.

    With record=False and the plain all-reduce, nothing is registered: DDP keeps its built-in C++ all-reduce
    (the bare loop), and the recorder's counts stay 0.
    """
    hook, wire_dtype = COMM_HOOKS[comm_hook]
    recorder = GradRecorder(record=record, wire_dtype=wire_dtype)
    if record or comm_hook != "allreduce":
        ddp.register_comm_hook(recorder, recording(hook))
    return recorder
