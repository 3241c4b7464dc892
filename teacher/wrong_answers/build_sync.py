"""Typical wrong answers to notebook 3b's checked exercise, bucketed_sync(model, cap_bytes), in PRACTICE_WRONG.

Each is the teacher's solution with one mistake people make when they build DDP's buckets: a handle never
waited for, no division, the last partial bucket never sent, buckets filled in forward order, the averaged
bucket never written back into p.grad; then a few more (state kept from the last backward, one all_reduce per
gradient, every bucket sent after backward); and the mistakes a trial of issue 50 found misjudged (divided
twice, read before wait(), sent before full, a rank-0-only all_reduce, the late-binding closure, a stale +=
buffer, writing to p.data, buckets grouped in forward order but laid out backward).
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


def _slots(buckets):
    """Each parameter's (bucket, offset in the bucket's flat buffer)."""
    slot = {}
    for i, b in enumerate(buckets):
        offset = 0
        for p in b:
            slot[p] = (i, offset)
            offset += p.numel()
    return slot


def _buckets(model, cap_bytes, *, order="reverse", flush=True, divide=True, wait=True, write_back=True,
             reset=True, send_in_finish=False, **mistake):
    """The solution's bucketed hooks, with the one thing the caller asks to get wrong; returns finish().

    mistake: one of divide_again, copy_before_wait, send_early, accumulate, to_data, rank0_only, late_binding,
    layout_reversed (True).
    """
    params = list(model.parameters())
    buckets = _plan(params[::-1] if order == "reverse" else params, cap_bytes, flush)
    if mistake.get("layout_reversed"):
        buckets = [b[::-1] for b in buckets]  # the same grouping, each buffer in the other order
    flats = [torch.zeros(sum(p.numel() for p in b)) for b in buckets]
    slot = _slots(buckets)
    missing = [len(b) for b in buckets]
    works = {}

    def send(i):
        if not mistake.get("rank0_only") or dist.get_rank() == 0:
            works[i] = dist.all_reduce(flats[i], async_op=True)

    def hook(p):
        if p not in slot:  # a parameter no bucket holds (the unflushed ones): left as it is
            return
        i, offset = slot[p]
        missing[i] -= 1
        if mistake.get("send_early") and missing[i] == 0:
            send(i)  # sent before this last gradient is copied in
        part = flats[i][offset:offset + p.numel()]
        if mistake.get("accumulate"):
            part.add_(p.grad.reshape(-1))
        else:
            part.copy_(p.grad.reshape(-1))
        if divide:
            part.div_(dist.get_world_size())
        if missing[i] == 0 and not send_in_finish and not mistake.get("send_early"):
            send(i)

    for p in params:
        if mistake.get("late_binding"):
            p.register_post_accumulate_grad_hook(lambda _: hook(p))  # every lambda sees the loop's last p
        else:
            p.register_post_accumulate_grad_hook(hook)

    return _finish(buckets, flats, slot, missing, works, send, send_in_finish=send_in_finish, wait=wait,
                   write_back=write_back, reset=reset, **mistake)


def _finish(buckets, flats, slot, missing, works, send, *, send_in_finish, wait, write_back, reset, **mistake):
    """_buckets' finish(), with the same mistakes asked for."""

    def finish():
        if send_in_finish:
            for i in range(len(buckets)):
                send(i)
        for i, work in works.items():
            if wait and not mistake.get("copy_before_wait"):
                work.wait()
            if write_back:
                for p in buckets[i]:
                    offset = slot[p][1]
                    target = p.data if mistake.get("to_data") else p.grad
                    target.copy_(flats[i][offset:offset + p.numel()].view_as(p))
                    if mistake.get("divide_again"):
                        p.grad.div_(dist.get_world_size())
            if mistake.get("copy_before_wait"):
                work.wait()  # too late: the buffer was read above
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


@practice("bucketed_sync", "forward_order", "buckets filled from the first layer")
def bucketed_forward_order(model, cap_bytes):
    # grouped from the first layer, each buffer laid out backward: the grouping, not the layout, is wrong
    return _buckets(model, cap_bytes, order="forward", layout_reversed=True)


def bucketed_forward_order_forward_layout(model, cap_bytes):
    """Forward grouping and forward layout (not registered: the same mistake as bucketed_forward_order)."""
    return _buckets(model, cap_bytes, order="forward")


@practice("bucketed_sync", "not_written_back", "stayed in your bucket's flat buffer")
def bucketed_not_written_back(model, cap_bytes):
    return _buckets(model, cap_bytes, write_back=False)


@practice("bucketed_sync", "stale_state", "still counted an earlier backward")
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


@practice("bucketed_sync", "divided_twice", "divided by the world size twice")
def bucketed_divided_twice(model, cap_bytes):
    return _buckets(model, cap_bytes, divide_again=True)  # divided into the bucket, and again after the copy


@practice("bucketed_sync", "read_before_wait", "before its wait()")
def bucketed_copied_before_wait(model, cap_bytes):
    return _buckets(model, cap_bytes, copy_before_wait=True)


@practice("bucketed_sync", "sent_before_full", "sent before they were full")
def bucketed_sent_before_full(model, cap_bytes):
    return _buckets(model, cap_bytes, send_early=True)  # counted, sent, and only then the last gradient copied


@practice("bucketed_sync", "collective_mismatch", "never joined")
def bucketed_rank0_only(model, cap_bytes):
    return _buckets(model, cap_bytes, rank0_only=True)  # rank 0 waits in wait() for a rank that never sends


@practice("bucketed_sync", "late_binding", "late binding")
def bucketed_late_binding(model, cap_bytes):
    return _buckets(model, cap_bytes, late_binding=True)


@practice("bucketed_sync", "stale_buffer", "still held an earlier backward")
def bucketed_stale_buffer(model, cap_bytes):
    return _buckets(model, cap_bytes, accumulate=True)  # += into buffers never zeroed


@practice("bucketed_sync", "wrote_p_data", "wrote into p.data")
def bucketed_writes_p_data(model, cap_bytes):
    return _buckets(model, cap_bytes, to_data=True)  # the averages land in the weights, not the gradients

