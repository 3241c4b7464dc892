"""Typical wrong answers to exercises 5-7: averaging gradients, accumulation with no_sync, checkpoints."""
from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._registry import wrong


# ----------------------------------------------------------------------------------------- 5. average_gradients
@wrong("average_gradients", "no_divide", "divide every p.grad by dist.get_world_size()")
def avg_sum_only(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)


@wrong("average_gradients", "divided_twice", "you divided twice")
def avg_divide_twice(model):
    for p in model.parameters():
        p.grad /= dist.get_world_size()
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()


@wrong("average_gradients", "some_params", "only some parameters were averaged")
def avg_weights_only(model):
    first = next(model.parameters())  # the weight; the bias is forgotten
    dist.all_reduce(first.grad)
    first.grad /= dist.get_world_size()


@wrong("average_gradients", "op_max", "element-wise maximum")
def avg_max(model):
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.MAX)


@wrong("average_gradients", "reduced_params", "not p (or p.data)")
def avg_params_not_grads(model):
    for p in model.parameters():
        dist.all_reduce(p.data)
        p.data /= dist.get_world_size()


@wrong("average_gradients", "no_allreduce", "no all_reduce was called): call dist.all_reduce(p.grad)")
def avg_local_divide(model):
    for p in model.parameters():
        p.grad /= dist.get_world_size()


@wrong("average_gradients", "hardcoded_world_size", "not a fixed 2")
def avg_fixed_two(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= 2


@wrong("average_gradients", "reduced_copy", "you all-reduced a copy of p.grad")
def avg_reduce_a_clone(model):
    for p in model.parameters():
        g = p.grad.data.clone()
        dist.all_reduce(g)
        g /= dist.get_world_size()  # averaged, but g is a new tensor: p.grad never sees it


@wrong("average_gradients", "no_wait", "never waited for")
def avg_async_no_wait(model):
    for p in model.parameters():
        dist.all_reduce(p.grad, async_op=True)  # returns at once; the sum arrives whenever it arrives


# ----------------------------------------------------------------------------------------- 6. accumulation_step
def _loss(ddp_model, x, y):
    return F.cross_entropy(ddp_model(x), y)


@wrong("accumulation_step", "no_sync_everywhere", "outside ddp_model.no_sync()")
def acc_no_sync_on_last_too(ddp_model, optimizer, micro_batches):
    optimizer.zero_grad()
    with ddp_model.no_sync():
        for x, y in micro_batches:
            (_loss(ddp_model, x, y) / len(micro_batches)).backward()
    optimizer.step()


@wrong("accumulation_step", "loss_not_scaled", "divide each micro-batch's loss")
def acc_not_scaled(ddp_model, optimizer, micro_batches):
    optimizer.zero_grad()
    for i, (x, y) in enumerate(micro_batches):
        if i < len(micro_batches) - 1:
            with ddp_model.no_sync():
                _loss(ddp_model, x, y).backward()
        else:
            _loss(ddp_model, x, y).backward()
    optimizer.step()


@wrong("accumulation_step", "divided_by_world_size", "by the world size as well as by the number of micro-batches")
def acc_divided_by_world_size_too(ddp_model, optimizer, micro_batches):
    optimizer.zero_grad()
    scale = len(micro_batches) * dist.get_world_size()  # "the mean over all ranks": DDP averages already
    for i, (x, y) in enumerate(micro_batches):
        if i < len(micro_batches) - 1:
            with ddp_model.no_sync():
                (_loss(ddp_model, x, y) / scale).backward()
        else:
            (_loss(ddp_model, x, y) / scale).backward()
    optimizer.step()


@wrong("accumulation_step", "no_no_sync", "once per micro-batch")
def acc_without_no_sync(ddp_model, optimizer, micro_batches):
    optimizer.zero_grad()
    for x, y in micro_batches:
        (_loss(ddp_model, x, y) / len(micro_batches)).backward()  # correct sum, but an all-reduce every time
    optimizer.step()


@wrong("accumulation_step", "zero_grad_inside", "optimizer.zero_grad() ran after micro-batch 1's backward")
def acc_zero_grad_inside(ddp_model, optimizer, micro_batches):
    for i, (x, y) in enumerate(micro_batches):
        optimizer.zero_grad()
        if i < len(micro_batches) - 1:
            with ddp_model.no_sync():
                (_loss(ddp_model, x, y) / len(micro_batches)).backward()
        else:
            (_loss(ddp_model, x, y) / len(micro_batches)).backward()
    optimizer.step()


@wrong("accumulation_step", "step_each", "then step once")
def acc_step_every_micro_batch(ddp_model, optimizer, micro_batches):
    optimizer.zero_grad()
    for i, (x, y) in enumerate(micro_batches):
        if i < len(micro_batches) - 1:
            with ddp_model.no_sync():
                (_loss(ddp_model, x, y) / len(micro_batches)).backward()
        else:
            (_loss(ddp_model, x, y) / len(micro_batches)).backward()
        optimizer.step()


@wrong("accumulation_step", "no_step", "optimizer.step() was never called")
def acc_no_step(ddp_model, optimizer, micro_batches):
    optimizer.zero_grad()
    for i, (x, y) in enumerate(micro_batches):
        if i < len(micro_batches) - 1:
            with ddp_model.no_sync():
                (_loss(ddp_model, x, y) / len(micro_batches)).backward()
        else:
            (_loss(ddp_model, x, y) / len(micro_batches)).backward()


@wrong("accumulation_step", "forward_outside_no_sync", "but their forwards ran outside it")
def acc_forward_outside_no_sync(ddp_model, optimizer, micro_batches):
    optimizer.zero_grad()
    for i, (x, y) in enumerate(micro_batches):
        loss = _loss(ddp_model, x, y) / len(micro_batches)  # the forward, outside no_sync: it decides
        if i < len(micro_batches) - 1:
            with ddp_model.no_sync():
                loss.backward()  # still all-reduces
        else:
            loss.backward()
    optimizer.step()


@wrong("accumulation_step", "last_forward_inside", "Run the last micro-batch's forward outside no_sync() too")
def acc_every_forward_inside(ddp_model, optimizer, micro_batches):
    optimizer.zero_grad()
    for i, (x, y) in enumerate(micro_batches):
        with ddp_model.no_sync():
            loss = _loss(ddp_model, x, y) / len(micro_batches)  # every forward inside: none prepares the sync
        if i < len(micro_batches) - 1:
            with ddp_model.no_sync():
                loss.backward()
        else:
            loss.backward()  # outside, but its forward decided already
    optimizer.step()


@wrong("accumulation_step", "bypassed_ddp", "called ddp_model.module(x), the model inside DDP")
def acc_through_the_module(ddp_model, optimizer, micro_batches):
    optimizer.zero_grad()
    for x, y in micro_batches:
        (F.cross_entropy(ddp_model.module(x), y) / len(micro_batches)).backward()  # DDP never sees these
    optimizer.step()


@wrong("accumulation_step", "ranks_differ", "accumulated locally after the last all-reduce")
def acc_first_synced(ddp_model, optimizer, micro_batches):
    optimizer.zero_grad()
    for i, (x, y) in enumerate(micro_batches):
        if i == 0:  # the synchronized one first, the local ones after it
            (_loss(ddp_model, x, y) / len(micro_batches)).backward()
        else:
            with ddp_model.no_sync():
                (_loss(ddp_model, x, y) / len(micro_batches)).backward()
    optimizer.step()


@wrong("accumulation_step", "missing_backward", "ran forward but never backward")
def acc_backward_after_the_loop(ddp_model, optimizer, micro_batches):
    optimizer.zero_grad()
    for i, (x, y) in enumerate(micro_batches):
        if i < len(micro_batches) - 1:
            with ddp_model.no_sync():
                loss = _loss(ddp_model, x, y) / len(micro_batches)
        else:
            loss = _loss(ddp_model, x, y) / len(micro_batches)
    loss.backward()  # only the last loss: the others are overwritten, never backward
    optimizer.step()


# -------------------------------------------------------------------------------------------- 7. save_checkpoint
def _payload(ddp_model, optimizer, step):
    return {"step": step, "model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict()}


@wrong("save_checkpoint", "every_rank_writes", "only rank 0 should save")
def ckpt_every_rank(ddp_model, optimizer, step, path):
    tmp = f"{path}.tmp{dist.get_rank()}"
    torch.save(_payload(ddp_model, optimizer, step), tmp)
    os.replace(tmp, path)


@wrong("save_checkpoint", "not_atomic", "os.replace(tmp, path)")
def ckpt_direct_write(ddp_model, optimizer, step, path):
    if dist.get_rank() == 0:
        torch.save(_payload(ddp_model, optimizer, step), path)


@wrong("save_checkpoint", "module_prefix", "ddp_model.module.state_dict()")
def ckpt_module_prefix(ddp_model, optimizer, step, path):
    if dist.get_rank() == 0:
        torch.save({"step": step, "model": ddp_model.state_dict(), "optimizer": optimizer.state_dict()},
                   f"{path}.tmp")
        os.replace(f"{path}.tmp", path)


@wrong("save_checkpoint", "not_weights_only", "not the model or optimizer objects")
def ckpt_whole_model(ddp_model, optimizer, step, path):
    if dist.get_rank() == 0:
        torch.save({"step": step, "model": ddp_model.module, "optimizer": optimizer}, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)


@wrong("save_checkpoint", "not_rank0", "let rank 0 do it")
def ckpt_last_rank(ddp_model, optimizer, step, path):
    if dist.get_rank() == dist.get_world_size() - 1:
        torch.save(_payload(ddp_model, optimizer, step), f"{path}.tmp")
        os.replace(f"{path}.tmp", path)


@wrong("save_checkpoint", "no_file", "saved checkpoint.pt.tmp but never moved it")
def ckpt_never_moved(ddp_model, optimizer, step, path):
    if dist.get_rank() == 0:
        torch.save(_payload(ddp_model, optimizer, step), f"{path}.tmp")


@wrong("save_checkpoint", "copied_not_moved", "then copied it to `path`")
def ckpt_copied(ddp_model, optimizer, step, path):
    if dist.get_rank() == 0:
        torch.save(_payload(ddp_model, optimizer, step), f"{path}.tmp")
        shutil.copyfile(f"{path}.tmp", path)  # a temporary file, but copied: not atomic
        os.remove(f"{path}.tmp")
