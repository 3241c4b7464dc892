"""A class-sized set of answers to notebook 0's two blanks, AfterBackward (step 1) and AsGradientsArrive (step 2),
written the way learners write them: each wrong one registers in SYNC_WRONG with the mistake its check must name
and a piece of the hint; each correct one in SYNC_RIGHT. tests/exercises/test_sync_class.py runs them all, many to
a launch. (The notebook's own typical mistakes, one per code, are in core_sync, in PRACTICE_WRONG.)
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ._registry import SYNC_RIGHT, SYNC_WRONG, wrong

s1 = functools.partial(wrong, "after_backward", registry=SYNC_WRONG)
s2 = functools.partial(wrong, "as_gradients_arrive", registry=SYNC_WRONG)
right1 = wrong("after_backward", "", "", registry=SYNC_RIGHT)
right2 = wrong("as_gradients_arrive", "", "", registry=SYNC_RIGHT)


class _Model:
    def __init__(self, model):
        self.model = model


# ------------------------------------------------------------------------------------------- step 1, wrong
@s1("no_divide", "the sum over the ranks")
class S1Sum(_Model):
    def finish(self):
        for p in self.model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)


@s1("rebound_divide", "never reached p.grad")
class S1Rebound(_Model):
    def finish(self):
        for p in self.model.parameters():
            g = p.grad
            dist.all_reduce(g)
            g = g / dist.get_world_size()  # a new tensor; p.grad keeps the sum


@s1("rebound_divide", "never reached p.grad")
class S1DivDiscarded(_Model):
    def finish(self):
        for p in self.model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div(dist.get_world_size())  # out of place, thrown away


@s1("wrong_op", "ReduceOp.MAX")
class S1Max(_Model):
    def finish(self):
        for p in self.model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.MAX)
            p.grad /= dist.get_world_size()


@s1("wrong_op", "ReduceOp.MIN")
class S1Min(_Model):
    def finish(self):
        for p in self.model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.MIN)


@s1("wrong_divisor", "the batch size of each rank")
class S1GlobalBatch(_Model):
    def finish(self):
        for p in self.model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size() * 16  # "the global batch"


@s1("wrong_divisor", "the sum over the ranks divided by")
class S1PlusOne(_Model):
    def finish(self):
        for p in self.model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size() + 1


@s1("not_all_reduce", "every rank held rank 0's own gradient divided by the world size")
class S1Broadcast(_Model):
    def finish(self):
        for p in self.model.parameters():
            dist.broadcast(p.grad, src=0)
            p.grad /= dist.get_world_size()


@s1("not_all_reduce", "you called dist.reduce")
class S1Reduce(_Model):
    def finish(self):
        for p in self.model.parameters():
            dist.reduce(p.grad, dst=0)
            p.grad /= dist.get_world_size()


@s1("not_all_reduce", "you called dist.all_gather")
class S1GatherOnly(_Model):
    def finish(self):
        for p in self.model.parameters():
            parts = [torch.zeros_like(p.grad) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, p.grad)  # gathered, never summed into p.grad


@s1("not_all_reduce", "it sends no gradient")
class S1BarrierOnly(_Model):
    def finish(self):
        dist.barrier()
        for p in self.model.parameters():
            p.grad /= dist.get_world_size()


@s1("reduced_copy", "a copy of the gradients")
class S1FlatNotCopiedBack(_Model):
    def finish(self):
        flat = torch.cat([p.grad.reshape(-1) for p in self.model.parameters()])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()


@s1("reduced_params", "you all-reduced the parameters")
class S1Weights(_Model):
    def finish(self):
        for p in self.model.parameters():
            dist.all_reduce(p)
            p.data /= dist.get_world_size()


@s1("wrote_p_data", "wrote into p.data")
class S1IntoWeights(_Model):
    def finish(self):
        for p in self.model.parameters():
            dist.all_reduce(p.grad)
            p.data.copy_(p.grad / dist.get_world_size())


@s1("some_params", "do not")
class S1FirstLayerForgotten(_Model):
    def finish(self):
        for p in list(self.model.parameters())[2:]:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


@s1("divided_twice", "divided by the world size twice")
class S1AvgAndDivide(_Model):
    def finish(self):
        for p in self.model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            p.grad /= dist.get_world_size()


@s1("unwaited", "never waited for")
class S1AsyncForgotten(_Model):
    def finish(self):
        for p in self.model.parameters():
            p.grad /= dist.get_world_size()
            dist.all_reduce(p.grad, async_op=True)


@s1("unwaited", "on rank 1 were never waited for")
class S1WaitOnRank0(_Model):
    def finish(self):
        works = []
        for p in self.model.parameters():
            p.grad /= dist.get_world_size()
            works.append(dist.all_reduce(p.grad, async_op=True))
        if dist.get_rank() == 0:  # only rank 0 waits
            for w in works:
                w.wait()


@s1("sync_in_step", "inside optimizer.step()")
class S1InStepHook(_Model):
    def __init__(self, model):
        super().__init__(model)
        register_optimizer_step_pre_hook(self.before_step)

    def before_step(self, optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()

    def finish(self):
        pass  # the step hook does it


@s1("sync_in_forward", "a forward pre-hook")
class S1InForwardPreHook(_Model):
    def __init__(self, model):
        super().__init__(model)
        model.register_forward_pre_hook(self.before_forward)

    def before_forward(self, module, inputs):
        for p in module.parameters():
            if p.grad is not None:  # after zero_grad(set_to_none=True): never
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()

    def finish(self):
        pass


@s1("averaged_output", "on the model's output")
class S1AveragedOutput(_Model):
    def __init__(self, model):
        super().__init__(model)
        model.register_forward_hook(self.average)

    def average(self, module, inputs, output):
        with torch.no_grad():
            dist.all_reduce(output)
            output /= dist.get_world_size()

    def finish(self):
        pass


@s1("no_finish", "has no finish() method")
class S1Step(_Model):
    def step(self):
        for p in self.model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


@s1("hardcoded_world_size", "not a fixed number")
class S1Half(_Model):
    def finish(self):
        for p in self.model.parameters():
            dist.all_reduce(p.grad)
            p.grad *= 0.5


# ------------------------------------------------------------------------------------------- step 2, wrong
class _Hooks:
    """The worked step 2's shape; each wrong answer changes one method."""

    def __init__(self, model):
        self.works = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self.ready)

    def ready(self, p):
        p.grad /= dist.get_world_size()
        self.works.append(dist.all_reduce(p.grad, async_op=True))

    def finish(self):
        for w in self.works:
            w.wait()
        self.works.clear()


@s2("hook_returned", "returned a Work")
class S2ReturnsWork(_Hooks):
    def ready(self, p):
        p.grad /= dist.get_world_size()
        work = dist.all_reduce(p.grad, async_op=True)
        self.works.append(work)
        return work


@s2("hook_returned", "TypeError: expected Variable, but hook returned 'torch._C._distributed_c10d.Work'")
class S2LambdaReturns(_Hooks):
    def __init__(self, model):
        self.works = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda q: self.works.append(q.grad.div_(dist.get_world_size())))
            p.register_post_accumulate_grad_hook(lambda q: dist.all_reduce(q.grad, async_op=True))


@s2("hook_returned", "Tensor post accumulate grad hooks should return None.")
class S2ReturnsGrad(_Hooks):
    def ready(self, p):
        self.works.append(dist.all_reduce(p.grad.div_(dist.get_world_size()), async_op=True))
        return p.grad


@s2("waited_in_hook", "wait() in the hook")
class S2WaitAtOnce(_Hooks):
    def ready(self, p):
        p.grad /= dist.get_world_size()
        dist.all_reduce(p.grad, async_op=True).wait()


@s2("waited_in_hook", "were waited for during backward")
class S2WaitLast(_Hooks):
    def ready(self, p):
        super().ready(p)
        self.works[-1].wait()


@s2("kept_works", "never empties")
class S2NeverCleared(_Hooks):
    def finish(self):
        for w in self.works:
            w.wait()


@s2("shared_state", "class attribute")
class S2ClassList(_Hooks):
    works = []  # one list, shared by every instance

    def __init__(self, model):
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self.ready)


@s2("shared_state", "every instance of your class shares")
class S2ClassParams(_Hooks):
    params = []

    def __init__(self, model):
        super().__init__(model)
        self.params.extend(model.parameters())


@s2("shared_state", "registered 12 hooks on the first object's parameters")
class S2ClassParamsHooked(_Hooks):
    params = []  # every instance's parameters, in one list

    def __init__(self, model):
        self.works = []
        self.params.extend(model.parameters())
        for p in self.params:  # the second object hooks the first object's parameters again
            p.register_post_accumulate_grad_hook(self.ready)


@s2("ignores_argument", "not every parameter")
class S2EveryParam(_Hooks):
    def __init__(self, model):
        self.model = model
        super().__init__(model)

    def ready(self, _):
        for p in self.model.parameters():
            if p.grad is not None:
                self.works.append(dist.all_reduce(p.grad, async_op=True))

    def finish(self):
        super().finish()
        for p in self.model.parameters():
            p.grad /= dist.get_world_size()


@s2("rebound_divide", "never reached p.grad")
class S2Rebound(_Hooks):
    def ready(self, p):
        self.works.append((p, dist.all_reduce(p.grad, async_op=True)))

    def finish(self):
        for p, w in self.works:
            w.wait()
            g = p.grad
            g = g / dist.get_world_size()
        self.works.clear()


@s2("wrong_op", "ReduceOp.MAX")
class S2Max(_Hooks):
    def ready(self, p):
        p.grad /= dist.get_world_size()
        self.works.append(dist.all_reduce(p.grad, op=dist.ReduceOp.MAX, async_op=True))


@s2("not_all_reduce", "you called dist.broadcast")
class S2Broadcast(_Hooks):
    def ready(self, p):
        p.grad /= dist.get_world_size()
        self.works.append(dist.broadcast(p.grad, src=0, async_op=True))


@s2("sync_in_forward", "there it raised")
class S2ForwardPreHook(_Hooks):
    def __init__(self, model):
        self.works = []
        self.model = model
        model.register_forward_pre_hook(self.before)

    def before(self, module, inputs):
        for p in module.parameters():  # p.grad is None here
            self.works.append(dist.all_reduce(p.grad, async_op=True))


@s2("unwaited", "on rank 1 were never waited for")
class S2Rank0Waits(_Hooks):
    def finish(self):
        if dist.get_rank() == 0:
            for w in self.works:
                w.wait()
        self.works.clear()


@s2("read_before_wait", "before its wait()")
class S2MeanFirst(_Hooks):
    def ready(self, p):
        g = p.grad.clone()
        self.works.append((p, g, dist.all_reduce(g, async_op=True)))

    def finish(self):
        for p, g, w in self.works:
            p.grad.copy_(g / dist.get_world_size())
            w.wait()
        self.works.clear()


@s2("changed_in_flight", "still running")
class S2DivideWhileSending(_Hooks):
    def ready(self, p):
        self.works.append(dist.all_reduce(p.grad, async_op=True))
        p.grad /= dist.get_world_size()


@s2("divided_twice", "divided by the world size twice")
class S2AvgAndDivide(_Hooks):
    def ready(self, p):
        p.grad /= dist.get_world_size()
        self.works.append(dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, async_op=True))


@s2("no_divide", "the sum over the ranks")
class S2NoDivide(_Hooks):
    def ready(self, p):
        self.works.append(dist.all_reduce(p.grad, async_op=True))


@s2("wrong_divisor", "the batch size of each rank")
class S2DividedByBatch(_Hooks):
    def ready(self, p):
        p.grad /= 16 * dist.get_world_size()
        self.works.append(dist.all_reduce(p.grad, async_op=True))


@s2("reduced_copy", "a copy of the gradients")
class S2ClonedGrad(_Hooks):
    def ready(self, p):
        self.works.append(dist.all_reduce(p.grad.clone() / dist.get_world_size(), async_op=True))


@s2("some_params", "do not")
class S2WeightsOnly(_Hooks):
    def __init__(self, model):
        self.works = []
        for name, p in model.named_parameters():
            if "weight" in name:
                p.register_post_accumulate_grad_hook(self.ready)


@s2("blocking", "without async_op=True")
class S2Sync(_Hooks):
    def ready(self, p):
        p.grad /= dist.get_world_size()
        dist.all_reduce(p.grad)


@s2("after_backward", "that is step 1")
class S2Collects(_Hooks):
    def ready(self, p):
        self.works.append(p)

    def finish(self):
        works = [dist.all_reduce(p.grad, async_op=True) for p in self.works]
        for w in works:
            w.wait()
        for p in self.works:
            p.grad /= dist.get_world_size()
        self.works.clear()


@s2("after_backward", "that is step 1")
class S2StepOneInFinish(_Hooks):
    def ready(self, p):
        self.works.append(p)

    def finish(self):
        for p in self.works:  # blocking, after backward: step 1, not a hook that blocks
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        self.works.clear()


@s2("tensor_hook", "p.register_hook")
class S2GradHookDividesGrad(_Hooks):
    def __init__(self, model):
        self.works = []
        self.params = list(model.parameters())
        for p in self.params:
            p.register_hook(lambda g, p=p: self.ready(p))  # p.grad is not there yet: ready() fails


@s2("hook_on_data", "on p.data")
class S2HookOnDetached(_Hooks):
    def __init__(self, model):
        self.works = []
        for p in model.parameters():
            p.detach().register_post_accumulate_grad_hook(self.ready)


@s2("late_binding", "late binding")
class S2LoopLambda(_Hooks):
    def __init__(self, model):
        self.works = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda _: self.ready(p))


@s2("stale_state", "after a later one it did not")
class S2PairsKept(_Hooks):
    def ready(self, p):
        self.works.append((p, dist.all_reduce(p.grad, async_op=True)))

    def finish(self):
        for p, w in self.works:
            w.wait()
            p.grad /= dist.get_world_size()


@s2("hardcoded_world_size", "not a fixed number")
class S2Halves(_Hooks):
    def ready(self, p):
        p.grad /= 2
        self.works.append(dist.all_reduce(p.grad, async_op=True))


@s2("no_finish", "has no finish() method")
class S2Wait(_Hooks):
    finish = None

    def wait(self):
        for w in self.works:
            w.wait()
        self.works.clear()


# ------------------------------------------------------------------------------------------- correct variants
@right1
class R1DivideFirst(_Model):
    def finish(self):
        for p in self.model.parameters():
            p.grad /= dist.get_world_size()
            dist.all_reduce(p.grad)


@right1
class R1Avg(_Model):
    def finish(self):
        for p in self.model.parameters():
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


@right1
class R1GatherThenMean(_Model):
    def finish(self):
        for p in self.model.parameters():
            parts = [torch.empty_like(p.grad) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, p.grad)
            p.grad.copy_(torch.stack(parts).sum(0) / dist.get_world_size())


@right1
class R1Futures(_Model):
    def finish(self):
        params = [p for p in self.model.parameters()]
        futures = [dist.all_reduce(p.grad, async_op=True).get_future() for p in params]
        torch.futures.wait_all(futures)
        for p in params:
            p.grad.div_(dist.get_world_size())


@right1
class R1FlatMul(_Model):
    def finish(self):
        params = list(self.model.parameters())
        flat = torch.cat([p.grad.flatten() for p in params]).mul_(1.0 / dist.get_world_size())
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()


@right2
class R2Avg(_Hooks):
    def ready(self, p):
        self.works.append(dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, async_op=True))


@right2
class R2DictOfWorks(_Hooks):
    def __init__(self, model):
        self.pending = {}
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self.ready)

    def ready(self, p):
        self.pending[p] = dist.all_reduce(p.grad, async_op=True)

    def finish(self):
        for p, w in self.pending.items():
            w.wait()
            p.grad /= dist.get_world_size()
        self.pending = {}


@right2
class R2FutureCallbacks(_Hooks):
    def ready(self, p):
        fut = dist.all_reduce(p.grad, async_op=True).get_future()
        self.works.append(fut.then(lambda f, p=p: p.grad.div_(dist.get_world_size())))

    def finish(self):
        for fut in self.works:
            fut.wait()
        self.works = []


@right2
class R2RemovableHandles(_Hooks):
    def __init__(self, model):
        self.works = []
        self.handles = [p.register_post_accumulate_grad_hook(self.ready) for p in model.parameters()]

    def close(self):
        for h in self.handles:
            h.remove()


@s2("read_before_wait", "before its wait()")
class S2TensorHookOnGrad(_Hooks):
    """register_hook with its grad argument, all-reduced in place: autograd then accumulates that tensor into
    p.grad (a copy, as the work still holds it) before the sum is there."""

    def __init__(self, model):
        self.works = []
        for p in model.parameters():
            p.register_hook(self.on_grad)

    def on_grad(self, grad):
        grad.div_(dist.get_world_size())
        self.works.append(dist.all_reduce(grad, async_op=True))
