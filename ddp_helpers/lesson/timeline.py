"""When DDP's buckets are handed to the communication hook and when their all-reduce completes, per iteration.

`timed(hook)` wraps a hook the way hooks.recording does: it adds one concern (timestamps) and leaves the
communication to the hook it wraps. `waiting(hook)` adds another: it waits for each all-reduce before handing
control back to backward, which removes the overlap of communication with the rest of backward.
The training loop sets its own marks (backward start and end) with Timeline.mark; records() returns plain
dicts the parent can unpickle without torch.distributed, with times in seconds since the iteration started.
"""
# No "from __future__ import annotations": DDP checks the hook's annotations at runtime.
import math
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..engine.hooks import Hook  # (process group, bucket) -> future, the signature of torch's own hooks


class Timeline:
    """State handed to a timed() hook: the loop's marks and every bucket's timestamps, one entry per iteration."""

    def __init__(self, model: torch.nn.Module, process_group: Optional[dist.ProcessGroup] = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.process_group = process_group  # None = the default group, as in torch's own hooks
        self.clock = clock
        # Buckets name their parameters by tensor; the records name them by position in model.parameters().
        self.param_index: Dict[int, int] = {id(p): i for i, p in enumerate(model.parameters())}
        self.iterations: List[dict] = []

    def start_iteration(self) -> None:
        """Open a new iteration; its "start" mark is time 0 of its record."""
        self.iterations.append({"marks": {"start": self.clock()}, "buckets": []})

    def mark(self, name: str) -> None:
        """Record that the training loop reached `name` (e.g. "backward_start") now."""
        self._current()["marks"][name] = self.clock()

    def _current(self) -> dict:
        if not self.iterations:
            raise RuntimeError("Timeline: call start_iteration() before the iteration's forward pass")
        return self.iterations[-1]

    def handed(self, bucket: dist.GradBucket) -> dict:
        """Record a bucket DDP has just handed to the hook (all its gradients are ready); returns its event."""
        return self.add_bucket(bucket.index(), bucket.buffer(), bucket.parameters(), bucket.is_last())

    def add_bucket(self, index: int, buffer: torch.Tensor, params: Sequence[torch.Tensor], is_last: bool) -> dict:
        """Record a bucket whose all-reduce starts now (DDP's, or one built by hand); returns its event."""
        event = {"index": index, "handed": self.clock(), "returned": math.nan, "done": math.nan,
                 "nbytes": buffer.numel() * buffer.element_size(), "is_last": is_last,
                 "params": [self.param_index.get(id(p), -1) for p in params]}
        self._current()["buckets"].append(event)
        return event

    def records(self) -> List[dict]:
        """Every iteration as plain dicts, times in seconds since that iteration's start mark."""
        out = []
        for it in self.iterations:
            t0 = it["marks"]["start"]
            marks = {k: v - t0 for k, v in it["marks"].items()}
            buckets = [dict(b, handed=b["handed"] - t0, returned=b["returned"] - t0, done=b["done"] - t0)
                       for b in it["buckets"]]
            out.append({"marks": marks, "buckets": buckets})
        return out


def timed(hook: Hook) -> Callable[[Timeline, dist.GradBucket], torch.futures.Future]:
    """A hook that timestamps each bucket in its Timeline state, then runs `hook` (e.g. allreduce_hook) on it.

    "done" is when the all-reduce's future completes: the moment the communication thread marks it finished
    and runs this callback (with gloo, the averaged values are in the bucket then; with NCCL it means the
    all-reduce is queued on the GPU stream, not that the GPU has finished it).
    """

    def timed_hook(state: Timeline, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        event = state.handed(bucket)

        def done(f: torch.futures.Future) -> torch.Tensor:
            event["done"] = state.clock()
            return f.value()

        # DDP waits for the returned future at the end of backward, so "done" is always recorded by then.
        # A future that is complete already (waiting()) runs `done` inside then(), before "returned".
        fut = hook(state.process_group, bucket).then(done)
        event["returned"] = state.clock()  # from here on backward goes on while the all-reduce runs
        return fut

    timed_hook.__name__ = f"timed_{getattr(hook, '__name__', 'hook')}"
    return timed_hook


def waiting(hook: Hook) -> Hook:
    """A hook that runs `hook` and waits for its all-reduce before returning: no overlap with backward."""

    def waiting_hook(process_group: Optional[dist.ProcessGroup],
                     bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        fut = hook(process_group, bucket)
        fut.wait()  # the autograd engine computes no further gradient until this bucket is averaged
        return fut

    waiting_hook.__name__ = f"waiting_{getattr(hook, '__name__', 'hook')}"
    return waiting_hook


# ---------------------------------------------------------------------------------------------- reading records
def backward_s(record: dict) -> float:
    """Seconds from the "backward_start" mark to the "backward_end" mark."""
    marks = record["marks"]
    for name in ("backward_start", "backward_end"):
        if name not in marks:
            raise KeyError(f"the record has no {name!r} mark; call Timeline.mark({name!r}) in the training loop")
    return marks["backward_end"] - marks["backward_start"]


def bucket_params(record: dict) -> List[List[int]]:
    """The parameters (positions in model.parameters()) of each bucket, in the order DDP handed them over."""
    return [b["params"] for b in record["buckets"]]


def still_running_on_return(record: dict) -> List[bool]:
    """Per bucket: was its all-reduce still running when the hook handed control back to backward?"""
    return [b["done"] > b["returned"] for b in record["buckets"]]
