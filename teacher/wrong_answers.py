"""Typical wrong answers to the exercises, each labelled with the mistake code and the hint it must produce.

tests/test_exercises.py runs every check on each of them. Every function here is wrong on purpose.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Callable, List

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

T = datetime.timedelta(seconds=20)


@dataclass(frozen=True)
class WrongAnswer:
    """A wrong answer: which exercise, the mistake code its check must report, and a piece of the hint text."""

    exercise: str
    mistake: str
    hint: str  # must appear in the printed hint
    fn: Callable


WRONG: List[WrongAnswer] = []


def wrong(exercise: str, mistake: str, hint: str) -> Callable[[Callable], Callable]:
    """Register fn as a typical wrong answer."""
    def deco(fn: Callable) -> Callable:
        WRONG.append(WrongAnswer(exercise, mistake, hint, fn))
        return fn
    return deco


# ------------------------------------------------------------------------------------------------ 1. init_group
@wrong("init_group", "fixed_port", "a fixed port (like the listing's 23456)")
def init_listing_port(rank, world_size, port):
    dist.init_process_group("gloo", init_method="tcp://localhost:23456", rank=rank, world_size=world_size, timeout=T)


@wrong("init_group", "wrong_rank", "pass rank=rank")
def init_rank_zero(rank, world_size, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=world_size, timeout=T)


@wrong("init_group", "wrong_world_size", "pass world_size=world_size")
def init_world_four(rank, world_size, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4, timeout=T)


@wrong("init_group", "nccl_on_cpu", "use backend='gloo'")
def init_nccl(rank, world_size, port):
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)


@wrong("init_group", "no_address", "no address to meet at")
def init_env_without_address(rank, world_size, port):
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=T)


@wrong("init_group", "destroyed", "don't call destroy_process_group()")
def init_then_destroy(rank, world_size, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=T)
    dist.destroy_process_group()


@wrong("init_group", "no_init", "call dist.init_process_group")
def init_forgotten(rank, world_size, port):
    return rank, world_size, port


# ----------------------------------------------------------------------------------------------- 2. global_mean
@wrong("global_mean", "no_divide", "divide by dist.get_world_size()")
def mean_sum_only(value):
    dist.all_reduce(value)
    return value


@wrong("global_mean", "divided_twice", "you divided twice")
def mean_avg_then_divide(value):
    dist.all_reduce(value, op=dist.ReduceOp.AVG)
    return value / dist.get_world_size()


@wrong("global_mean", "op_max", "element-wise maximum")
def mean_max(value):
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value


@wrong("global_mean", "no_allreduce", "call dist.all_reduce(value)")
def mean_local(value):
    return value


@wrong("global_mean", "no_return", "return that tensor")
def mean_no_return(value):
    dist.all_reduce(value)
    value /= dist.get_world_size()


@wrong("global_mean", "hardcoded_world_size", "not a fixed 2")
def mean_fixed_two(value):
    dist.all_reduce(value)
    return value / 2


@wrong("global_mean", "collective_mismatch", "never joined")
def mean_rank0_only(value):
    if dist.get_rank() == 0:
        dist.all_reduce(value)
    return value / dist.get_world_size()


# --------------------------------------------------------------------------------------------- 3. shard_indices
@wrong("shard_indices", "every_rank_all", "the listing's bug")
def shard_everything(n, rank, world_size, epoch, seed):
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


@wrong("shard_indices", "overlap", "same seed on every rank")
def shard_seeded_by_rank(n, rank, world_size, epoch, seed):
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch + 1000 * rank)).tolist()
    return perm[rank::world_size]


@wrong("shard_indices", "same_every_epoch", "epoch 1 repeats epoch 0")
def shard_no_epoch(n, rank, world_size, epoch, seed):
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    perm += perm[: -(-n // world_size) * world_size - n]
    return perm[rank::world_size]


@wrong("shard_indices", "unequal_lengths", "wait for it forever")
def shard_no_padding(n, rank, world_size, epoch, seed):
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()[rank::world_size]


@wrong("shard_indices", "not_covering", "never used")
def shard_drop_remainder(n, rank, world_size, epoch, seed):
    per_rank = n // world_size
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return perm[rank * per_rank:(rank + 1) * per_rank]


@wrong("shard_indices", "not_shuffled", "increasing order")
def shard_strided(n, rank, world_size, epoch, seed):
    idx = list(range(n)) + list(range(-(-n // world_size) * world_size - n))
    return idx[rank::world_size]


@wrong("shard_indices", "nondeterministic", "not the global random state")
def shard_global_rng(n, rank, world_size, epoch, seed):
    perm = torch.randperm(n).tolist()  # the forked ranks share one global RNG state, so they agree by luck
    perm += perm[: -(-n // world_size) * world_size - n]
    return perm[rank::world_size]


# ----------------------------------------------------------------------------------------------- 4. make_loader
@wrong("make_loader", "no_sampler", "Listing 7.2's bug")
def loader_listing(dataset, rank, world_size, batch_size, epoch):
    return DataLoader(dataset, batch_size=batch_size, shuffle=True)


@wrong("make_loader", "no_set_epoch", "sampler.set_epoch(epoch)")
def loader_no_set_epoch(dataset, rank, world_size, batch_size, epoch):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


@wrong("make_loader", "shuffle_and_sampler", "drop shuffle=True")
def loader_shuffle_and_sampler(dataset, rank, world_size, batch_size, epoch):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=True)


@wrong("make_loader", "wrong_rank", "pass rank=rank")
def loader_rank_zero(dataset, rank, world_size, batch_size, epoch):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=0)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


@wrong("make_loader", "seed_per_rank", "same seed")
def loader_seed_per_rank(dataset, rank, world_size, batch_size, epoch):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=rank)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


@wrong("make_loader", "not_shuffled", "shuffle=True")
def loader_no_shuffle(dataset, rank, world_size, batch_size, epoch):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


@wrong("make_loader", "batch_size", "batch_size=batch_size")
def loader_listing_batch(dataset, rank, world_size, batch_size, epoch):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    sampler.set_epoch(epoch)
    return DataLoader(dataset, batch_size=64, sampler=sampler)


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


@wrong("average_gradients", "no_allreduce", "call dist.all_reduce(p.grad)")
def avg_local_divide(model):
    for p in model.parameters():
        p.grad /= dist.get_world_size()


@wrong("average_gradients", "hardcoded_world_size", "not a fixed 2")
def avg_fixed_two(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= 2


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


@wrong("accumulation_step", "no_no_sync", "once per micro-batch")
def acc_without_no_sync(ddp_model, optimizer, micro_batches):
    optimizer.zero_grad()
    for x, y in micro_batches:
        (_loss(ddp_model, x, y) / len(micro_batches)).backward()  # correct sum, but an all-reduce every time
    optimizer.step()


@wrong("accumulation_step", "zero_grad_inside", "only the last micro-batch counted")
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


@wrong("save_checkpoint", "no_file", "no file at `path`")
def ckpt_never_moved(ddp_model, optimizer, step, path):
    if dist.get_rank() == 0:
        torch.save(_payload(ddp_model, optimizer, step), f"{path}.tmp")
