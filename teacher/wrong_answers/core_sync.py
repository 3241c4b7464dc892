"""Typical wrong answers to notebook 0's two blanks, AfterBackward (step 1) and AsGradientsArrive (step 2), in
PRACTICE_WRONG: each is the worked class with one mistake people make when they write it."""
from __future__ import annotations

import functools

import torch.distributed as dist

from ._registry import PRACTICE_WRONG, wrong

step_1 = functools.partial(wrong, "after_backward", registry=PRACTICE_WRONG)
step_2 = functools.partial(wrong, "as_gradients_arrive", registry=PRACTICE_WRONG)


# --------------------------------------------------------------------------------------- step 1: after backward
class _Step1:
    def __init__(self, model):
        self.model = model


@step_1("no_divide", "the sum over the ranks")
class AfterBackwardNoDivide(_Step1):
    def finish(self):
        for p in self.model.parameters():
            dist.all_reduce(p.grad)


@step_1("divided_twice", "divided by the world size twice")
class AfterBackwardDividedTwice(_Step1):
    def finish(self):
        for p in self.model.parameters():
            p.grad /= dist.get_world_size()
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


@step_1("unwaited", "never waited for")
class AfterBackwardNoWait(_Step1):
    def finish(self):
        for p in self.model.parameters():
            dist.all_reduce(p.grad, async_op=True)  # returns at once; nobody waits
            p.grad /= dist.get_world_size()


@step_1("changed_in_flight", "still running")
class AfterBackwardDividedBeforeWait(_Step1):
    def finish(self):
        works = [(p, dist.all_reduce(p.grad, async_op=True)) for p in self.model.parameters()]
        for p, work in works:
            p.grad /= dist.get_world_size()  # the all_reduce may still be adding into p.grad
            work.wait()


@step_1("collective_mismatch", "never joined")
class AfterBackwardRank0Only(_Step1):
    def finish(self):
        if dist.get_rank() == 0:  # rank 1 never joins these all_reduces
            for p in self.model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()


@step_1("reduced_copy", "a copy of the gradients")
class AfterBackwardCopy(_Step1):
    def finish(self):
        for p in self.model.parameters():
            g = p.grad.clone()
            dist.all_reduce(g)
            g /= dist.get_world_size()  # and never written back


@step_1("reduced_params", "you all-reduced the parameters")
class AfterBackwardWeights(_Step1):
    def finish(self):
        for p in self.model.parameters():
            dist.all_reduce(p.data)
            p.data /= dist.get_world_size()


@step_1("some_params", "do not")
class AfterBackwardWeightsOnly(_Step1):
    def finish(self):
        for name, p in self.model.named_parameters():
            if name.endswith("weight"):  # the biases are forgotten
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()


@step_1("no_finish", "has no finish() method")
class AfterBackwardOtherName(_Step1):
    def synchronize(self):
        for p in self.model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


@step_1("hardcoded_world_size", "not a fixed number")
class AfterBackwardTwo(_Step1):
    def finish(self):
        for p in self.model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= 2


# ------------------------------------------------------------------------------- step 2: as gradients arrive
class _Step2:
    def __init__(self, model):
        self.works = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self.ready)

    def ready(self, p):
        p.grad /= dist.get_world_size()
        self.works.append(dist.all_reduce(p.grad, async_op=True))

    def finish(self):
        for work in self.works:
            work.wait()
        self.works.clear()


@step_2("no_divide", "the sum over the ranks")
class ArriveNoDivide(_Step2):
    def ready(self, p):
        self.works.append(dist.all_reduce(p.grad, async_op=True))


@step_2("divided_twice", "divided by the world size twice")
class ArriveDividedTwice(_Step2):
    def ready(self, p):
        super().ready(p)
        self.params = getattr(self, "params", []) + [p]

    def finish(self):
        super().finish()
        for p in self.params:
            p.grad /= dist.get_world_size()  # already divided in ready()
        self.params = []


@step_2("unwaited", "never waited for")
class ArriveNoWait(_Step2):
    def finish(self):
        self.works.clear()  # the sums may not be there yet


@step_2("changed_in_flight", "still running")
class ArriveAveragedBeforeWait(_Step2):
    def ready(self, p):
        self.works.append((p, dist.all_reduce(p.grad, async_op=True)))

    def finish(self):
        for p, work in self.works:
            p.grad /= dist.get_world_size()  # before wait(): the tensor is the collective's
            work.wait()
        self.works.clear()


@step_2("read_before_wait", "before its wait()")
class ArriveCopiedBeforeWait(_Step2):
    def ready(self, p):
        mean = p.grad / dist.get_world_size()
        self.works.append((p, mean, dist.all_reduce(mean, async_op=True)))

    def finish(self):
        for p, mean, work in self.works:
            p.grad.copy_(mean)  # read before wait()
            work.wait()
        self.works.clear()


@step_2("collective_mismatch", "never joined")
class ArriveRank0Only(_Step2):
    def ready(self, p):
        p.grad /= dist.get_world_size()
        if dist.get_rank() == 0:
            self.works.append(dist.all_reduce(p.grad, async_op=True))


@step_2("tensor_hook", "p.register_hook")
class ArriveTensorHook(_Step2):
    def __init__(self, model):
        self.works = []
        for p in model.parameters():
            p.register_hook(self.ready)  # called with the incoming gradient, before p.grad is written


@step_2("hook_on_data", "on p.data")
class ArriveHookOnData(_Step2):
    def __init__(self, model):
        self.works = []
        for p in model.parameters():
            p.data.register_post_accumulate_grad_hook(self.ready)


@step_2("late_binding", "late binding")
class ArriveLateBinding(_Step2):
    def __init__(self, model):
        self.works = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda _: self.ready(p))


@step_2("stale_state", "after a later one it did not")
class ArriveKeepsWorks(_Step2):
    def ready(self, p):
        self.works.append((p, dist.all_reduce(p.grad, async_op=True)))

    def finish(self):
        for p, work in self.works:  # the first backward's pairs too, the second time
            work.wait()
            p.grad /= dist.get_world_size()


@step_2("blocking", "without async_op=True")
class ArriveBlocking(_Step2):
    def ready(self, p):
        p.grad /= dist.get_world_size()
        dist.all_reduce(p.grad)


@step_2("after_backward", "that is step 1")
class ArriveAllInFinish(_Step2):
    def ready(self, p):
        self.works.append(p)

    def finish(self):
        for p in self.works:
            p.grad /= dist.get_world_size()
            dist.all_reduce(p.grad, async_op=True).wait()
        self.works.clear()
