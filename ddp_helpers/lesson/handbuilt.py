"""What notebook 3b needs besides the code it builds: its model, its bucket timelines and its comparisons.

The hand-built synchronization itself (an all-reduce after backward, per-parameter hooks, buckets, no_sync) is
written in the notebook's cells, where the learner reads it; this module holds the parts that are not the
lesson: a model with several parameter tensors of different sizes, so that buckets matter; a wrapper that
records each hand-built bucket in a Timeline the way timeline.timed() records DDP's; and the comparison the
notebook prints for every step (bitwise, or within a stated bound).
"""
from __future__ import annotations

from typing import Any, List, Sequence

import numpy as np
import torch
from torch import nn

from .timeline import Timeline

# in -> out features of each Linear layer: a narrow first layer, so that its weight (the last gradient backward
# produces) is smaller than the hidden layers' together, and a bucket cap of 0.3 MB leaves a partial last bucket.
LAYERS = ((784, 64), (64, 256), (256, 256), (256, 256), (256, 256), (256, 10))


def build_net(seed: int = 0) -> nn.Sequential:
    """Flatten, then six Linear layers with ReLUs between them: 12 parameter tensors, the same on every rank."""
    torch.manual_seed(seed)
    layers: List[nn.Module] = [nn.Flatten()]
    for i, (a, b) in enumerate(LAYERS):
        layers.append(nn.Linear(a, b))
        if i < len(LAYERS) - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """How many bytes the tensors hold together (a bucket's size)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def names_of(model: nn.Module, tensors: Sequence[torch.Tensor]) -> List[str]:
    """The names model.named_parameters() gives these tensors, in their order."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id.get(id(t), "?") for t in tensors]


class _TimedWork:
    """A hand-built bucket's all-reduce as the notebook's code waits for it: wait() returns once "done" is set."""

    def __init__(self, chained: torch.futures.Future):
        self._chained = chained

    def wait(self) -> bool:
        self._chained.wait()  # the callback that records "done" has run when this returns
        return True


def record_sends(sync: Any, state: Timeline) -> None:
    """Make sync.send(i), a hand-built bucket's all-reduce, record that bucket in state as timed() records DDP's.

    sync needs .buckets (the parameters of each bucket), .flat (each bucket's flat buffer) and .send(i), which
    starts bucket i's all-reduce and returns its Work. The times land in the Timeline's current iteration, so
    the figure for DDP's buckets (figures.buckets.plot_timeline) draws these too.
    """
    real_send = sync.send

    def send(i: int) -> _TimedWork:
        event = state.add_bucket(i, sync.flat[i], sync.buckets[i], is_last=i == len(sync.buckets) - 1)

        def done(fut: torch.futures.Future) -> Any:
            event["done"] = state.clock()
            return fut.value()

        chained = real_send(i).get_future().then(done)
        event["returned"] = state.clock()  # from here on backward goes on while the bucket travels
        return _TimedWork(chained)

    sync.send = send


def agreement(ours: np.ndarray, torchs: np.ndarray, bound: float) -> str:
    """'bitwise equal', or how close the two are: what the notebook prints for each comparison with DDP."""
    ours, torchs = np.asarray(ours), np.asarray(torchs)
    if ours.shape != torchs.shape:
        raise ValueError(f"agreement: shapes differ ({ours.shape} vs {torchs.shape}): compare the same parameters")
    if np.array_equal(ours, torchs):
        return "bitwise equal"
    return f"not bitwise; max |difference| < {bound:g}: {bool(np.abs(ours - torchs).max() < bound)}"
