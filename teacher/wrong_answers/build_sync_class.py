"""A class-sized set of answers to notebook 3b's bucketed_sync(model, cap_bytes), written the way learners write
them: each wrong one registers in SYNC_WRONG with the mistake its check must name and a piece of the hint; each
correct one in SYNC_RIGHT. tests/exercises/test_sync_class.py runs them all, many to a launch. (The notebook's
typical mistakes, one per code, are in build_sync, in PRACTICE_WRONG.)

Most are one class, Buckets, with one thing done wrong: the learner's bookkeeping (buckets of parameters from the
last layer back, a flat buffer each, a count of the gradients still to come), then the mistake.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ._registry import SYNC_RIGHT, SYNC_WRONG, wrong

bad = functools.partial(wrong, "bucketed_sync", registry=SYNC_WRONG)
good = wrong("bucketed_sync", "", "", registry=SYNC_RIGHT)


class Buckets:
    """Buckets closed once they reach cap_bytes, walking model.parameters() backward; each sent when full."""

    def __init__(self, model, cap_bytes, order=None):
        params = list(model.parameters())
        self.world = dist.get_world_size()
        self.buckets, current, size = [], [], 0
        for p in (order or reversed)(params):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= cap_bytes:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self.flats = [torch.zeros(sum(p.numel() for p in b)) for b in self.buckets]
        self.where = {}
        for i, b in enumerate(self.buckets):
            offset = 0
            for p in b:
                self.where[p] = (i, offset)
                offset += p.numel()
        self.left = [len(b) for b in self.buckets]
        self.works = []
        self.register(params)

    def register(self, params):
        for p in params:
            p.register_post_accumulate_grad_hook(self.hook)

    def put(self, p):
        i, offset = self.where[p]
        self.flats[i][offset:offset + p.numel()].copy_(p.grad.reshape(-1)).div_(self.world)
        return i

    def send(self, i):
        self.works.append((i, dist.all_reduce(self.flats[i], async_op=True)))

    def hook(self, p):
        i = self.put(p)
        self.left[i] -= 1
        if self.left[i] == 0:
            self.send(i)

    def back(self, i):
        for p in self.buckets[i]:
            offset = self.where[p][1]
            p.grad.copy_(self.flats[i][offset:offset + p.numel()].view_as(p.grad))

    def finish(self):
        for i, work in self.works:
            work.wait()
            self.back(i)
        self.works = []
        self.left = [len(b) for b in self.buckets]


# ----------------------------------------------------------------------------------------------------- wrong
class _NoWait(Buckets):
    def finish(self):
        for i, _ in self.works:
            self.back(i)
        self.works = []
        self.left = [len(b) for b in self.buckets]


@bad("unwaited", "never waited for")
def bucket_no_wait(model, cap_bytes):
    return _NoWait(model, cap_bytes).finish


class _Rank0Waits(Buckets):
    def finish(self):
        for i, work in self.works:
            if dist.get_rank() == 0:
                work.wait()
            self.back(i)
        self.works = []
        self.left = [len(b) for b in self.buckets]


@bad("unwaited", "on rank 1 were never waited for")
def bucket_rank0_waits(model, cap_bytes):
    return _Rank0Waits(model, cap_bytes).finish


class _NoDivide(Buckets):
    def put(self, p):
        i, offset = self.where[p]
        self.flats[i][offset:offset + p.numel()].copy_(p.grad.reshape(-1))
        return i


@bad("no_divide", "the sum over the ranks")
def bucket_no_divide(model, cap_bytes):
    return _NoDivide(model, cap_bytes).finish


class _AvgToo(Buckets):
    def send(self, i):
        self.works.append((i, dist.all_reduce(self.flats[i], op=dist.ReduceOp.AVG, async_op=True)))


@bad("divided_twice", "divided by the world size twice")
def bucket_avg_and_divide(model, cap_bytes):
    return _AvgToo(model, cap_bytes).finish


class _Max(Buckets):
    def send(self, i):
        self.works.append((i, dist.all_reduce(self.flats[i], op=dist.ReduceOp.MAX, async_op=True)))


@bad("wrong_op", "ReduceOp.MAX")
def bucket_max(model, cap_bytes):
    return _Max(model, cap_bytes).finish


class _Broadcast(Buckets):
    def send(self, i):
        self.works.append((i, dist.broadcast(self.flats[i], src=0, async_op=True)))


@bad("not_all_reduce", "you called dist.broadcast")
def bucket_broadcast(model, cap_bytes):
    return _Broadcast(model, cap_bytes).finish


class _BackFromZero(Buckets):
    def back(self, i):
        for p in self.buckets[i]:  # every gradient read from the start of the buffer
            p.grad.copy_(self.flats[i][:p.numel()].view_as(p.grad))


@bad("wrong_offsets", "read the wrong slice")
def bucket_back_from_zero(model, cap_bytes):
    return _BackFromZero(model, cap_bytes).finish


class _BackReversed(Buckets):
    def back(self, i):
        offset = 0
        for p in reversed(self.buckets[i]):  # offsets counted in the other order than they were filled
            p.grad.copy_(self.flats[i][offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()


@bad("wrong_offsets", "but its own gradient sits at offset")
def bucket_back_reversed(model, cap_bytes):
    return _BackReversed(model, cap_bytes).finish


class _Dropped(Buckets):
    def __init__(self, model, cap_bytes):
        super().__init__(model, cap_bytes)
        last = self.buckets[-1]
        if sum(p.numel() * p.element_size() for p in last) < cap_bytes:
            self.left[-1] = -1  # never reaches 0: the partial bucket is never sent

    def finish(self):
        super().finish()
        self.left[-1] = -1


@bad("not_flushed", "held this rank's own gradient after finish(): no all_reduce carried them")
def bucket_partial_never_sent(model, cap_bytes):
    return _Dropped(model, cap_bytes).finish


class _DroppedCopiedBack(_Dropped):
    def finish(self):
        sent = {i for i, _ in self.works}
        super().finish()
        for i in range(len(self.buckets)):
            if i not in sent:
                self.back(i)  # the unsent buffer: this rank's gradients, divided, never summed


@bad("not_flushed", "divided by the world size (your buffer's values, never summed)")
def bucket_partial_copied_back_unsent(model, cap_bytes):
    return _DroppedCopiedBack(model, cap_bytes).finish


class _ForwardPre(Buckets):
    def __init__(self, model, cap_bytes):
        super().__init__(model, cap_bytes)
        model.register_forward_pre_hook(self.before)

    def hook(self, p):
        pass

    def before(self, module, inputs):
        for i, b in enumerate(self.buckets):  # p.grad is None before backward
            self.flats[i].copy_(torch.cat([p.grad.reshape(-1) for p in b]))
            self.send(i)


@bad("sync_in_forward", "a forward pre-hook")
def bucket_sent_in_forward_pre_hook(model, cap_bytes):
    return _ForwardPre(model, cap_bytes).finish


class _ForwardPreGuarded(_ForwardPre):
    def before(self, module, inputs):
        for i, b in enumerate(self.buckets):
            if all(p.grad is not None for p in b):  # never true: zero_grad left them None
                self.put(b[0])
                self.send(i)


@bad("sync_in_forward", "sent nothing there")
def bucket_forward_pre_hook_guarded(model, cap_bytes):
    return _ForwardPreGuarded(model, cap_bytes).finish


class _ReturnsSlice(Buckets):
    def hook(self, p):
        i, offset = self.where[p]
        self.left[i] -= 1
        part = self.flats[i][offset:offset + p.numel()].copy_(p.grad.reshape(-1)).div_(self.world)
        if self.left[i] == 0:
            self.send(i)
        return part


@bad("hook_returned", "Tensor post accumulate grad hooks should return None.")
def bucket_hook_returns_slice(model, cap_bytes):
    return _ReturnsSlice(model, cap_bytes).finish


class _WaitsInHook(Buckets):
    def send(self, i):
        super().send(i)
        self.works[-1][1].wait()


@bad("waited_in_hook", "wait() in the hook")
def bucket_waits_in_hook(model, cap_bytes):
    return _WaitsInHook(model, cap_bytes).finish


class _Blocking(Buckets):
    def send(self, i):
        dist.all_reduce(self.flats[i])
        self.back(i)

    def finish(self):
        self.left = [len(b) for b in self.buckets]


@bad("blocking", "without async_op=True")
def bucket_blocking(model, cap_bytes):
    return _Blocking(model, cap_bytes).finish


class _KeepsWorks(Buckets):
    def finish(self):
        for i, work in self.works:
            work.wait()
            self.back(i)
        self.left = [len(b) for b in self.buckets]  # the works are kept: the list grows


@bad("kept_works", "never empties")
def bucket_keeps_works(model, cap_bytes):
    return _KeepsWorks(model, cap_bytes).finish


class _NotBack(Buckets):
    def back(self, i):
        pass


@bad("not_written_back", "stayed in your bucket's flat buffer")
def bucket_not_written_back(model, cap_bytes):
    return _NotBack(model, cap_bytes).finish


class _Accumulates(Buckets):
    def put(self, p):
        i, offset = self.where[p]
        self.flats[i][offset:offset + p.numel()].add_(p.grad.reshape(-1) / self.world)
        return i


@bad("stale_buffer", "still held an earlier backward")
def bucket_accumulates(model, cap_bytes):
    return _Accumulates(model, cap_bytes).finish


class _CountsKept(Buckets):
    def finish(self):
        for i, work in self.works:
            work.wait()
            self.back(i)
        self.works = []  # the counts are never reset


@bad("stale_state", "still counted an earlier backward")
def bucket_counts_kept(model, cap_bytes):
    return _CountsKept(model, cap_bytes).finish


class _BackBeforeWait(Buckets):
    def finish(self):
        for i, work in self.works:
            self.back(i)
            work.wait()
        self.works = []
        self.left = [len(b) for b in self.buckets]


@bad("read_before_wait", "before its wait()")
def bucket_back_before_wait(model, cap_bytes):
    return _BackBeforeWait(model, cap_bytes).finish


class _DivideAfterSend(_NoDivide):
    def send(self, i):
        super().send(i)
        self.flats[i].div_(self.world)  # the buffer is the collective's until wait()


@bad("changed_in_flight", "still running")
def bucket_divides_while_sending(model, cap_bytes):
    return _DivideAfterSend(model, cap_bytes).finish


class _SentEarly(Buckets):
    def hook(self, p):
        i, _ = self.where[p]
        self.left[i] -= 1
        if self.left[i] == 0:
            self.send(i)  # sent, then the last gradient copied in
        self.put(p)


@bad("sent_before_full", "sent before they were full")
def bucket_sent_early(model, cap_bytes):
    return _SentEarly(model, cap_bytes).finish


@bad("one_bucket", "one all_reduce carried all")
def bucket_cap_in_numbers(model, cap_bytes):
    return Buckets(model, cap_bytes * 1000).finish  # every gradient fits in the first bucket


@bad("per_parameter", "one per gradient")
def bucket_per_parameter(model, cap_bytes):
    return Buckets(model, 1).finish  # every gradient reaches a 1-byte cap alone


@bad("forward_order", "buckets filled from the first layer")
def bucket_forward_order(model, cap_bytes):
    return Buckets(model, cap_bytes, order=list).finish


class _InFinish(Buckets):
    def send(self, i):
        self.works.append((i, None))

    def finish(self):
        self.works = [(i, dist.all_reduce(self.flats[i], async_op=True)) for i, _ in self.works]
        super().finish()


class _BlockingInFinish(Buckets):
    def send(self, i):
        self.works.append(i)

    def finish(self):
        for i in self.works:  # blocking, after backward
            dist.all_reduce(self.flats[i])
            self.back(i)
        self.works = []
        self.left = [len(b) for b in self.buckets]


@bad("after_backward", "started in finish()")
def bucket_blocking_in_finish(model, cap_bytes):
    return _BlockingInFinish(model, cap_bytes).finish


@bad("after_backward", "started in finish()")
def bucket_sent_in_finish(model, cap_bytes):
    return _InFinish(model, cap_bytes).finish


class _IntoWeights(Buckets):
    def back(self, i):
        for p in self.buckets[i]:
            offset = self.where[p][1]
            p.data.copy_(self.flats[i][offset:offset + p.numel()].view_as(p))


@bad("wrote_p_data", "wrote into p.data")
def bucket_into_weights(model, cap_bytes):
    return _IntoWeights(model, cap_bytes).finish


class _LateBound(Buckets):
    def register(self, params):
        for p in params:
            p.register_post_accumulate_grad_hook(lambda _: self.hook(p))  # p: the loop's last, when it runs


@bad("late_binding", "late binding")
def bucket_late_binding(model, cap_bytes):
    return _LateBound(model, cap_bytes).finish


@bad("hardcoded_world_size", "not a fixed number")
def bucket_divides_by_two(model, cap_bytes):
    b = Buckets(model, cap_bytes)
    b.world = 2
    return b.finish


@bad("no_finish", "not a function")
def bucket_returns_object(model, cap_bytes):
    Buckets(model, cap_bytes)
    return "finish"


PENDING = []  # a module global: every call of the function below shares it


@bad("shared_state", "the global `PENDING` went from 0 to")
def bucket_global_works(model, cap_bytes):
    b = Buckets(model, cap_bytes)

    def send(i):
        PENDING.append((i, dist.all_reduce(b.flats[i], async_op=True)))

    def finish():
        for i, work in PENDING:
            work.wait()
            b.back(i)
        PENDING.clear()
        b.left = [len(x) for x in b.buckets]

    b.send = send
    return finish


@bad("shared_state", "the default argument `works`")
def bucket_default_argument(model, cap_bytes, works=[]):  # noqa: B006 - the mistake this answer makes
    b = Buckets(model, cap_bytes)
    b.works = works  # one list, made once, when the function was defined

    def finish():
        Buckets.finish(b)
        b.works = works
        works.clear()

    return finish


# --------------------------------------------------------------------------------------------------- correct
@good
def bucket_class(model, cap_bytes):
    return Buckets(model, cap_bytes).finish


class _DivideAfter(_NoDivide):
    def finish(self):
        for i, work in self.works:
            work.wait()
            self.flats[i].div_(self.world)
            self.back(i)
        self.works = []
        self.left = [len(b) for b in self.buckets]


@good
def bucket_divide_after_wait(model, cap_bytes):
    return _DivideAfter(model, cap_bytes).finish


class _Avg(_NoDivide):
    def send(self, i):
        self.works.append((i, dist.all_reduce(self.flats[i], op=dist.ReduceOp.AVG, async_op=True)))


@good
def bucket_avg(model, cap_bytes):
    return _Avg(model, cap_bytes).finish


class _Futures(Buckets):
    def send(self, i):
        fut = dist.all_reduce(self.flats[i], async_op=True).get_future()
        self.works.append((i, fut.then(lambda f, i=i: self.back(i))))

    def finish(self):
        torch.futures.wait_all([f for _, f in self.works])
        self.works = []
        self.left = [len(b) for b in self.buckets]


@good
def bucket_future_callbacks(model, cap_bytes):
    return _Futures(model, cap_bytes).finish


class _CloseBeforeCap(Buckets):
    """Buckets that never pass the cap (closed before the gradient that would take them past it)."""

    def __init__(self, model, cap_bytes):
        params = list(model.parameters())
        groups, current, size = [], [], 0
        for p in reversed(params):
            if current and size + p.numel() * p.element_size() > cap_bytes:
                groups.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        groups.append(current)
        order = [p for g in groups for p in g]
        super().__init__(model, cap_bytes, order=lambda _: order)
        self.buckets = groups  # the same buffers' layout, regrouped
        self.flats = [torch.zeros(sum(p.numel() for p in b)) for b in groups]
        self.where = {}
        for i, b in enumerate(groups):
            offset = 0
            for p in b:
                self.where[p] = (i, offset)
                offset += p.numel()
        self.left = [len(b) for b in groups]


@good
def bucket_closed_before_cap(model, cap_bytes):
    return _CloseBeforeCap(model, cap_bytes).finish

