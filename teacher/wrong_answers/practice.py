"""Typical wrong answers to the checked exercises of notebooks 11 (the global loss, loading a checkpoint) and 12
(do the replicas agree?), registered in PRACTICE_WRONG."""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ddp_helpers import fingerprint

from ._registry import PRACTICE_WRONG, wrong

practice = functools.partial(wrong, registry=PRACTICE_WRONG)


# ----------------------------------------------------------------------------------- notebook 11: global_loss
@practice("global_loss", "unweighted", "the plain mean of the ranks' losses")
def loss_mean_of_means(local_loss, n_samples):
    loss = local_loss.clone()
    dist.all_reduce(loss)
    return loss / dist.get_world_size()  # every rank's loss counts the same, whatever its number of samples


@practice("global_loss", "rank_local", "called no collective")
def loss_rank_local(local_loss, n_samples):
    return local_loss.item()  # what rank 0 logs when nobody all-reduces: its own samples' loss


@practice("global_loss", "no_divide", "the sum of the ranks' losses")
def loss_sum_only(local_loss, n_samples):
    loss = local_loss.clone()
    dist.all_reduce(loss)
    return loss


@practice("global_loss", "divided_by_world_size", "divided by the number of ranks")
def loss_divided_by_ranks(local_loss, n_samples):
    total = local_loss * n_samples
    dist.all_reduce(total)
    return total / dist.get_world_size()  # the sum over samples divided as if it were a sum over ranks


@practice("global_loss", "local_count", "by its own n_samples")
def loss_divided_by_own_count(local_loss, n_samples):
    total = local_loss * n_samples
    dist.all_reduce(total)
    return total / n_samples


@practice("global_loss", "two_collectives", "2 collective calls (all_reduce, all_reduce)")
def loss_two_all_reduces(local_loss, n_samples):
    total = local_loss * n_samples
    count = torch.tensor(float(n_samples))
    dist.all_reduce(total)
    dist.all_reduce(count)  # right, but a second round trip for one number
    return total / count


@practice("global_loss", "hardcoded_world_size", "right on 2 ranks but wrong on 3")
def loss_fixed_total(local_loss, n_samples):
    total = local_loss * n_samples
    dist.all_reduce(total)
    return total / 19  # the two ranks' samples, counted once by hand


@practice("global_loss", "changed_input", "changed the caller's local_loss in place")
def loss_scaled_in_place(local_loss, n_samples):
    local_loss *= n_samples  # the caller's tensor: its rank's loss is gone
    stats = torch.stack([local_loss, torch.tensor(float(n_samples))])
    dist.all_reduce(stats)
    return stats[0] / stats[1]


@practice("global_loss", "reduced_to_one", "delivers its result to one rank (dst) only")
def loss_reduced_to_rank_zero(local_loss, n_samples):
    stats = torch.stack([local_loss.detach() * n_samples, torch.tensor(float(n_samples))])
    dist.reduce(stats, dst=0)  # "rank 0 logs it": but the others get no global loss
    return stats[0] / stats[1]


# ------------------------------------------------------------------------------- notebook 11: load_checkpoint
@practice("load_checkpoint", "no_barrier", "got the old checkpoint still at `path`")
def load_without_barrier(path, device):
    return torch.load(path, map_location=device, weights_only=True)


@practice("load_checkpoint", "barrier_after_load", "comes after torch.load")
def load_then_barrier(path, device):
    ckpt = torch.load(path, map_location=device, weights_only=True)
    dist.barrier()
    return ckpt


@practice("load_checkpoint", "no_map_location", "without map_location torch.load puts them back there")
def load_without_map_location(path, device):
    dist.barrier()
    return torch.load(path, weights_only=True)


@practice("load_checkpoint", "fixed_device", "map_location was 'cpu'")
def load_onto_cpu(path, device):
    dist.barrier()
    return torch.load(path, map_location="cpu", weights_only=True)  # right on CPU ranks only


@practice("load_checkpoint", "unmapped_location", "left the storages tagged 'cuda:0'")
def load_mapping_another_gpu(path, device):
    dist.barrier()
    return torch.load(path, map_location={"cuda:1": "cpu"}, weights_only=True)


@practice("load_checkpoint", "no_return", "returned None")
def load_no_return(path, device):
    dist.barrier()
    torch.load(path, map_location=device, weights_only=True)


@practice("load_checkpoint", "collective_mismatch", "never joined")
def load_barrier_on_the_readers_only(path, device):
    if dist.get_rank() != 0:  # "rank 0 wrote it, so only the others wait": rank 0 never joins
        dist.barrier()
    return torch.load(path, map_location=device, weights_only=True)


# -------------------------------------------------------------------------------- notebook 12: replicas_agree
@practice("replicas_agree", "no_collective", "called no collective")
def agree_locally(model):
    return fingerprint(model.parameters()) == fingerprint(model.parameters())


@practice("replicas_agree", "ranks_disagree", "never learned that rank")
def agree_with_rank_zero_only(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    theirs = flat.clone()
    dist.broadcast(theirs, src=0)
    return torch.equal(theirs, flat)  # rank 0 compares with itself: always True there


@practice("replicas_agree", "summary", "a sum or a norm of the parameters is the same")
def agree_on_the_sum(model):
    total = torch.stack([p.detach().sum() for p in model.parameters()]).sum()
    low, high = total.clone(), total.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(low == high)


@practice("replicas_agree", "tolerance", "allows a tolerance")
def agree_within_tolerance(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.allclose(g, flat) for g in gathered)


@practice("replicas_agree", "some_params", "compare all of model.parameters()")
def agree_on_the_first_weight(model):
    prints = [None] * dist.get_world_size()
    dist.all_gather_object(prints, fingerprint(next(model.parameters())))
    return len(set(prints)) == 1


@practice("replicas_agree", "some_ranks", "not only the first and the last rank's")
def agree_first_and_last(model):
    prints = [None] * dist.get_world_size()
    dist.all_gather_object(prints, fingerprint(model.parameters()))
    return prints[0] == prints[-1]  # right on 2 ranks; a middle rank is never looked at


@practice("replicas_agree", "wrong_type", "return True or False")
def agree_returns_the_fingerprints(model):
    prints = [None] * dist.get_world_size()
    dist.all_gather_object(prints, fingerprint(model.parameters()))
    return prints
