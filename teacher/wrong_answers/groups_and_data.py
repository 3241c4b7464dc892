"""Typical wrong answers to exercises 1-4: the process group, the global mean, sharding, the loader."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from ._registry import T, wrong


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


@wrong("init_group", "no_address", "reads MASTER_ADDR and MASTER_PORT (env://)")
def init_env_without_address(rank, world_size, port):
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=T)


@wrong("init_group", "destroyed", "don't call destroy_process_group()")
def init_then_destroy(rank, world_size, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=T)
    dist.destroy_process_group()


@wrong("init_group", "refused_call", "Your function passed timeout=30 (an int): pass a datetime.timedelta")
def init_timeout_in_seconds(rank, world_size, port):
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world_size, timeout=30)  # an int: seconds?


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


@wrong("global_mean", "reduced_copy", "you all-reduced a copy of value, but returned value divided by")
def mean_reduce_a_copy(value):
    total = value.clone()
    dist.all_reduce(total)  # the sum lands in the copy ...
    return value / dist.get_world_size()  # ... and the rank's own value is returned


@wrong("global_mean", "returned_copy", "returned a tensor saved before the all_reduce")
def mean_returns_saved_input(value):
    before = value.clone()  # "keep the input safe": but the all_reduce is meant to change it
    dist.all_reduce(value)
    return before / dist.get_world_size()


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


@wrong("shard_indices", "global_rng", "changed torch's global random state (torch.manual_seed(7)")
def shard_reseeding_the_global_rng(n, rank, world_size, epoch, seed):
    torch.manual_seed(seed + epoch)  # reproducible shards, but every other draw of the script restarts here too
    perm = torch.randperm(n).tolist()
    perm += perm[: -(-n // world_size) * world_size - n]
    return perm[rank::world_size]


@wrong("shard_indices", "overlapping_slices", "they all hold the same permutation")
def shard_overlapping_windows(n, rank, world_size, epoch, seed):
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    per_rank = -(-n // world_size)
    perm += perm[: per_rank * world_size - n]
    return perm[rank:rank + per_rank]  # windows that start one apart: neighbours share all but one index


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


@wrong("make_loader", "epochs_differ", "the ranks told their samplers different epochs")
def loader_epoch_per_rank(dataset, rank, world_size, batch_size, epoch):
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    sampler.set_epoch(epoch + rank)  # set_epoch was called, but each rank shuffles its own permutation
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)
