"""What notebook 3b's check rests on: its model gives buckets that tell forward order from reverse, under either
closing rule, with a partial last bucket; and it reads which gradients a flat buffer holds, in which order."""
from __future__ import annotations

import torch

from ddp_helpers.exercises.bucketed_sync import CAP_BYTES, _layout, net


def _plan(sizes, cap, close_at_cap):
    """Buckets of indices over sizes (bytes): closed once they reach cap (DDP), or before they would pass it."""
    buckets, current, size = [], [], 0
    for i, s in sizes:
        if not close_at_cap and current and size + s > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += s
        if close_at_cap and size >= cap:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def test_the_check_model_makes_several_buckets_of_several_gradients_and_a_partial_last_one():
    params = list(net().parameters())
    sizes = [(i, p.numel() * p.element_size()) for i, p in enumerate(params)]
    for close_at_cap in (True, False):
        plan = _plan(sizes[::-1], CAP_BYTES, close_at_cap)
        assert len(plan) >= 3 and any(len(b) > 1 for b in plan), plan
        last = sum(dict(sizes)[i] for i in plan[-1])
        assert last < CAP_BYTES, "the last bucket must be partial, or forgetting to flush it goes unnoticed"
        assert all(b == sorted(b, reverse=True) for b in plan)  # reverse order: indices fall in every bucket


def test_layout_reads_the_gradients_a_buffer_holds_divided_or_not():
    g = {0: torch.tensor([1.0, 2.0, 3.0]), 1: torch.tensor([5.0]), 2: torch.tensor([-7.0, 11.0])}
    assert _layout(torch.cat([g[2], g[1]]), g, 2) == [2, 1]
    assert _layout(torch.cat([g[0], g[2]]) / 2, g, 2) == [0, 2]
    assert _layout(torch.cat([g[1], torch.tensor([9.0])]), g, 2) is None
    assert _layout(torch.tensor([5.0]) * 3, g, 2) is None  # neither the gradient nor it / world size


def test_a_bucketing_is_judged_by_its_grouping_not_by_the_layout_inside_a_buffer():
    from ddp_helpers.exercises._bucket_verdicts import _grouping_verdict

    sizes = [p.numel() * p.element_size() for p in net().parameters()]
    n = len(sizes)
    backward = list(range(n))[::-1]
    for close_at_cap in (True, False):
        ddp = _plan([(i, sizes[i]) for i in backward], CAP_BYTES, close_at_cap)
        assert _grouping_verdict(ddp, sizes) is None  # buffers laid out backward
        assert _grouping_verdict([sorted(b) for b in ddp], sizes) is None  # laid out in model order
        forward = _plan(list(enumerate(sizes)), CAP_BYTES, close_at_cap)
        for layout in (forward, [b[::-1] for b in forward]):
            verdict = _grouping_verdict(layout, sizes)
            assert verdict is not None and verdict.mistake == "forward_order", layout
            assert "buckets filled from the first layer" in verdict.hint
