"""Typical wrong answers to notebook 3b's checked exercise, bucketed_sync(model, cap_bytes), in PRACTICE_WRONG.

Each is the teacher's solution with one mistake people make when they build DDP's buckets: a handle never
waited for, no division, the last partial bucket never sent, buckets filled in forward order, the averaged
bucket never written back into p.grad; then a few more (state kept from the last backward, one all_reduce per
gradient, every bucket sent after backward).
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ._registry import PRACTICE_WRONG, wrong

practice = functools.partial(wrong, registry=PRACTICE_WRONG)


def _plan(params, cap_bytes, flush=True):
    """Buckets of about cap_bytes over params in the order given; the last, partial one kept if flush."""
    buckets, current, size = [], [], 0
    for p in params:
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current and flush:
        buckets.append(current)
    return buckets


def _buckets(model, cap_bytes, *, order="reverse", flush=True, divide=True, wait=True, write_back=True,
             reset=True, send_in_finish=False):
    """The solution's bucketed hooks, with the one thing the caller asks to get wrong; returns finish()."""
    params = list(model.parameters())
    buckets = _plan(params[::-1] if order == "reverse" else params, cap_bytes, flush)
    flats = [torch.zeros(sum(p.numel() for p in b)) for b in buckets]
    slot = {}
    for i, b in enumerate(buckets):
        offset = 0
        for p in b:
            slot[p] = (i, offset)
            offset += p.numel()
    missing = [len(b) for b in buckets]
    works = {}

    def send(i):
        works[i] = dist.all_reduce(flats[i], async_op=True)

    def hook(p):
        if p not in slot:  # a parameter no bucket holds (the unflushed ones): left as it is
            return
        i, offset = slot[p]
        part = flats[i][offset:offset + p.numel()].copy_(p.grad.reshape(-1))
        if divide:
            part.div_(dist.get_world_size())
        missing[i] -= 1
        if missing[i] == 0 and not send_in_finish:
            send(i)

    for p in params:
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        if send_in_finish:
            for i in range(len(buckets)):
                send(i)
        for i, work in works.items():
            if wait:
                work.wait()
            if write_back:
                for p in buckets[i]:
                    offset = slot[p][1]
                    p.grad.copy_(flats[i][offset:offset + p.numel()].view_as(p))
        if reset:
            works.clear()
            missing[:] = [len(b) for b in buckets]

    return finish


@practice("bucketed_sync", "unwaited", "never waited for")
def bucketed_no_wait(model, cap_bytes):
    return _buckets(model, cap_bytes, wait=False)  # copies the buffers back whether or not the sums are there


@practice("bucketed_sync", "no_divide", "the sum over the ranks")
def bucketed_no_divide(model, cap_bytes):
    return _buckets(model, cap_bytes, divide=False)


@practice("bucketed_sync", "not_flushed", "the one that never reached cap_bytes")
def bucketed_not_flushed(model, cap_bytes):
    return _buckets(model, cap_bytes, flush=False)  # the partial bucket at the end is dropped


@practice("bucketed_sync", "forward_order", "in forward order")
def bucketed_forward_order(model, cap_bytes):
    return _buckets(model, cap_bytes, order="forward")


@practice("bucketed_sync", "not_written_back", "stayed in your bucket's flat buffer")
def bucketed_not_written_back(model, cap_bytes):
    return _buckets(model, cap_bytes, write_back=False)


@practice("bucketed_sync", "stale_state", "after the second it did not")
def bucketed_no_reset(model, cap_bytes):
    return _buckets(model, cap_bytes, reset=False)  # the second backward finds every bucket already counted


@practice("bucketed_sync", "per_parameter", "one per gradient")
def bucketed_per_parameter(model, cap_bytes):
    works = []

    def hook(p):
        p.grad.div_(dist.get_world_size())
        works.append(dist.all_reduce(p.grad, async_op=True))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        for work in works:
            work.wait()
        works.clear()

    return finish


@practice("bucketed_sync", "after_backward", "started in finish()")
def bucketed_sent_after_backward(model, cap_bytes):
    return _buckets(model, cap_bytes, send_in_finish=True)


@practice("bucketed_sync", "no_finish", "not a function")
def bucketed_returns_nothing(model, cap_bytes):
    _buckets(model, cap_bytes)  # the hooks are there, but the loop has nothing to call after backward
