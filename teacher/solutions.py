"""Correct answers to notebooks/exercises/exercises.ipynb, one function per exercise (same names and signatures).

Check them all with:  python -m teacher.solutions
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler


def init_group(rank: int, world_size: int, port: int) -> None:
    """Exercise 1: join a gloo process group that meets at 127.0.0.1:port."""
    dist.init_process_group(
        backend="gloo",  # CPU tensors; the listing's nccl needs one GPU per rank
        init_method=f"tcp://127.0.0.1:{port}",  # the port we were given, never a fixed one
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=30),  # a missing rank becomes an error, not a 30-minute hang
    )


def global_mean(value: torch.Tensor) -> torch.Tensor:
    """Exercise 2: the element-wise mean of `value` over all ranks."""
    dist.all_reduce(value, op=dist.ReduceOp.SUM)  # in place: every rank now holds the sum
    return value / dist.get_world_size()


def shard_indices(n: int, rank: int, world_size: int, epoch: int, seed: int) -> list:
    """Exercise 3: this rank's indices, as DistributedSampler(shuffle=True) with set_epoch(epoch) gives them."""
    g = torch.Generator().manual_seed(seed + epoch)  # same permutation on every rank, new one every epoch
    perm = torch.randperm(n, generator=g).tolist()
    per_rank = -(-n // world_size)
    perm += perm[: per_rank * world_size - n]  # pad by repeating: every rank gets the same number of batches
    return perm[rank::world_size]


def make_loader(dataset, rank: int, world_size: int, batch_size: int, epoch: int) -> DataLoader:
    """Exercise 4: the DataLoader for one rank and one epoch (Listing 7.2's missing sampler, added)."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)  # no shuffle=True: the sampler shuffles


def average_gradients(model: torch.nn.Module) -> None:
    """Exercise 5: replace every p.grad by its mean over all ranks (what DDP does during backward)."""
    world_size = dist.get_world_size()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad /= world_size


def accumulation_step(ddp_model, optimizer, micro_batches) -> None:
    """Exercise 6: one optimizer step over several micro-batches, with a single all-reduce."""
    optimizer.zero_grad(set_to_none=True)
    last = len(micro_batches) - 1
    for i, (x, y) in enumerate(micro_batches):
        if i < last:
            with ddp_model.no_sync():  # gradients accumulate locally, no communication
                (F.cross_entropy(ddp_model(x), y) / len(micro_batches)).backward()
        else:  # the last backward all-reduces the accumulated sum
            (F.cross_entropy(ddp_model(x), y) / len(micro_batches)).backward()
    optimizer.step()


def save_checkpoint(ddp_model, optimizer, step: int, path: str) -> None:
    """Exercise 7: rank 0 writes {'step', 'model', 'optimizer'} atomically; the other ranks write nothing."""
    if dist.get_rank() == 0:
        tmp = f"{path}.tmp"
        torch.save({"step": step, "model": ddp_model.module.state_dict(),  # .module: no 'module.' prefix
                    "optimizer": optimizer.state_dict()}, tmp)
        os.replace(tmp, path)  # atomic: readers see the old file or the complete new one
    dist.barrier()  # nobody goes on (e.g. to load it) before the file is there


SOLUTIONS = {
    "init_group": init_group,
    "global_mean": global_mean,
    "shard_indices": shard_indices,
    "make_loader": make_loader,
    "average_gradients": average_gradients,
    "accumulation_step": accumulation_step,
    "save_checkpoint": save_checkpoint,
}

if __name__ == "__main__":
    from ddp_helpers.exercises import EXERCISES

    results = [EXERCISES[name](fn) for name, fn in SOLUTIONS.items()]
    raise SystemExit(0 if all(r.passed for r in results) else 1)
