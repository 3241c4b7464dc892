"""Notebook 3b's package side: its model, the timeline of hand-built buckets, the printed comparison; and its
central claim, checked outside the notebook: buckets laid out as DDP's equal DDP bit for bit on 2 and 4 ranks."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_helpers import flat_params, launch
from ddp_helpers.lesson import timeline
from ddp_helpers.lesson.handbuilt import agreement, build_net, names_of, record_sends, tensor_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # teacher/ sits beside the package
from teacher.solutions import bucketed_sync  # noqa: E402

CAP_MB = 0.3


def test_the_net_has_twelve_tensors_and_a_partial_last_bucket_at_the_lessons_cap():
    net = build_net(0)
    params = list(net.parameters())
    assert len(params) == 12 and torch.equal(flat_params(net), flat_params(build_net(0)))
    assert not torch.equal(flat_params(net), flat_params(build_net(1)))
    cap = int(CAP_MB * 2**20)
    first_layer = tensor_bytes(params[:2])  # the last gradients backward produces: their bucket stays partial
    assert first_layer < cap < tensor_bytes(params[2:])
    assert names_of(net, params[-2:]) == ["11.weight", "11.bias"]


def test_agreement_says_bitwise_or_how_close():
    a = np.array([1.0, 2.0], dtype=np.float32)
    assert agreement(a, a.copy(), 1e-6) == "bitwise equal"
    b = a + np.float32(1e-7)
    assert agreement(a, b, 1e-6) == "not bitwise; max |difference| < 1e-06: True"
    assert agreement(a, a + 1, 1e-6).endswith("False")
    with pytest.raises(ValueError, match="shapes differ"):
        agreement(a, np.zeros(3), 1e-6)


class _TwoBuckets:
    """A minimal hand-built synchronization with .buckets, .flat and .send(i), as record_sends needs."""

    def __init__(self, model):
        params = list(model.parameters())[::-1]
        self.buckets = [params[:6], params[6:]]
        self.flat = [torch.zeros(sum(p.numel() for p in b)) for b in self.buckets]

    def send(self, i):
        return dist.all_reduce(self.flat[i], async_op=True)


def _timed_sends(rank, world_size):
    model = build_net(0)
    state = timeline.Timeline(model)
    sync = _TwoBuckets(model)
    record_sends(sync, state)
    state.start_iteration()
    works = [sync.send(i) for i in range(2)]
    for w in works:
        w.wait()
    state.mark("backward_start")
    state.mark("backward_end")
    return state.records()


@pytest.mark.slow
def test_record_sends_times_each_hand_built_bucket_like_ddps():
    rec = launch(_timed_sends, world_size=2, threads_per_rank=1)[0][0]
    assert timeline.bucket_params(rec) == [[11, 10, 9, 8, 7, 6], [5, 4, 3, 2, 1, 0]]
    assert [b["is_last"] for b in rec["buckets"]] == [False, True]
    for b in rec["buckets"]:
        assert 0 <= b["handed"] <= b["returned"] and b["handed"] <= b["done"]  # done is set once wait() returns
        assert b["nbytes"] > 0


def _train(rank, world_size, hand_built, steps=4):
    """The lesson's loop: one warm-up backward (DDP rebuilds its buckets after it), then `steps` SGD steps."""
    model = build_net(0)
    net = model if hand_built else DDP(model, bucket_cap_mb=CAP_MB)
    finish = bucketed_sync(model, int(CAP_MB * 2**20)) if hand_built else (lambda: None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for step in range(-1, steps):
        opt.zero_grad(set_to_none=True)
        x, y = torch.randn(32, 784, generator=g), torch.randint(0, 10, (32,), generator=g)
        F.cross_entropy(net(x), y).backward()
        finish()
        if step >= 0:
            opt.step()
    return flat_params(model).numpy()


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_buckets_laid_out_as_ddps_equal_ddp_bitwise(world_size):
    """The same buckets, flat layout and order as DDP's rebuilt ones, and a division by a power of two: the same
    additions in the same order, so the same bits (gloo's ring cuts the same buffers into the same chunks)."""
    ours = launch(_train, world_size=world_size, args=(True,), threads_per_rank=1)
    torchs = launch(_train, world_size=world_size, args=(False,), threads_per_rank=1)
    assert all(np.array_equal(o, ours[0]) for o in ours)
    assert np.array_equal(ours[0], torchs[0])
