"""Correct answers to notebooks/exercises/exercises.ipynb, one function per exercise (same names and signatures).

Below them, other correct answers (ALTERNATIVES), written the other ways learners write them; then the same
(PRACTICE_SOLUTIONS, PRACTICE_ALTERNATIVES) for the checked exercises of lesson notebooks 0, 3b, 11 and 12.
Check them all with:  python -m teacher.solutions
"""
from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from ddp_helpers import fingerprint
from ddp_helpers.lesson import core_sync


def init_group(rank: int, world_size: int, port: int) -> None:
    """Exercise 1: join a gloo process group that meets at 127.0.0.1:port."""
    dist.init_process_group(
        backend="gloo",  # CPU tensors; the listing's nccl needs one GPU per rank
        init_method=f"tcp://127.0.0.1:{port}",  # the port we were given, never a fixed one
        rank=rank,
        world_size=world_size,
        # a missing rank becomes an error, not a 30-minute hang
        timeout=datetime.timedelta(seconds=30),
    )


def global_mean(value: torch.Tensor) -> torch.Tensor:
    """Exercise 2: the element-wise mean of `value` over all ranks."""
    dist.all_reduce(value, op=dist.ReduceOp.SUM)  # in place: every rank now holds the sum
    return value / dist.get_world_size()


def shard_indices(n: int, rank: int, world_size: int, epoch: int, seed: int) -> list:
    """Exercise 3: this rank's indices, as DistributedSampler(shuffle=True) with set_epoch(epoch) gives them."""
    # same permutation on every rank, new one every epoch
    g = torch.Generator().manual_seed(seed + epoch)
    perm = torch.randperm(n, generator=g).tolist()
    per_rank = -(-n // world_size)
    # pad by repeating: every rank gets the same number of batches
    perm += perm[: per_rank * world_size - n]
    return perm[rank::world_size]


def make_loader(dataset, rank: int, world_size: int, batch_size: int, epoch: int) -> DataLoader:
    """Exercise 4: the DataLoader for one rank and one epoch (Listing 7.2's missing sampler, added)."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
    # no shuffle=True: the sampler shuffles
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


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
        # .module: no 'module.' prefix
        torch.save({"step": step, "model": ddp_model.module.state_dict(),
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


# ------------------------------------------------------------------------------------ other correct answers
# Written the other ways learners write them: a hint must come from what a function did, so every one of these
# must pass its check too (tests/exercises/test_exercises.py), not only the one solution above.
def global_mean_avg(value: torch.Tensor) -> torch.Tensor:
    """Exercise 2 with ReduceOp.AVG (gloo supports it): the all_reduce divides."""
    dist.all_reduce(value, op=dist.ReduceOp.AVG)
    return value


def global_mean_on_a_copy(value: torch.Tensor) -> torch.Tensor:
    """Exercise 2 leaving the caller's tensor alone: all-reduce a copy, return the copy."""
    total = value.clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def shard_indices_blocks(n: int, rank: int, world_size: int, epoch: int, seed: int) -> list:
    """Exercise 3 with consecutive blocks of the padded permutation instead of a stride."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    per_rank = -(-n // world_size)
    perm += perm[: per_rank * world_size - n]
    return perm[rank * per_rank:(rank + 1) * per_rank]


def shard_indices_forked_rng(n: int, rank: int, world_size: int, epoch: int, seed: int) -> list:
    """Exercise 3 with torch's global generator, seeded inside fork_rng, which restores its state afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + epoch)
        perm = torch.randperm(n).tolist()
    per_rank = -(-n // world_size)
    perm += perm[: per_rank * world_size - n]
    return perm[rank::world_size]


def make_loader_from_the_group(dataset, rank: int, world_size: int, batch_size: int, epoch: int) -> DataLoader:
    """Exercise 4 with the sampler's defaults: rank and world size read from the process group."""
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    sampler.set_epoch(epoch)  # after building the loader is fine: the sampler is read when iterating
    return loader


def average_gradients_avg(model: torch.nn.Module) -> None:
    """Exercise 5 with ReduceOp.AVG: no division of one's own."""
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)


def average_gradients_flat(model: torch.nn.Module) -> None:
    """Exercise 5 the way DDP's buckets do it: one flat tensor, one all_reduce, the slices copied back."""
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def average_gradients_async(model: torch.nn.Module) -> None:
    """Exercise 5 with every all_reduce started at once (async_op=True), each waited for before dividing."""
    works = [dist.all_reduce(p.grad, async_op=True) for p in model.parameters()]
    for w in works:
        w.wait()
    for p in model.parameters():
        p.grad /= dist.get_world_size()


def accumulation_step_exit_stack(ddp_model, optimizer, micro_batches) -> None:
    """Exercise 6 with one loop body: an ExitStack enters no_sync() for all but the last micro-batch."""
    optimizer.zero_grad()
    for i, (x, y) in enumerate(micro_batches):
        with contextlib.ExitStack() as stack:
            if i < len(micro_batches) - 1:
                stack.enter_context(ddp_model.no_sync())
            loss = F.cross_entropy(ddp_model(x), y) / len(micro_batches)
            loss.backward()
    optimizer.step()


def accumulation_step_backward_outside(ddp_model, optimizer, micro_batches) -> None:
    """Exercise 6 with only the forwards inside no_sync(): the forward decides, so the backward may be outside."""
    optimizer.zero_grad()
    for i, (x, y) in enumerate(micro_batches):
        context = ddp_model.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext()
        with context:
            loss = F.cross_entropy(ddp_model(x), y) / len(micro_batches)
        loss.backward()  # accumulates locally when its forward ran inside no_sync()
    optimizer.step()


def save_checkpoint_mkstemp(ddp_model, optimizer, step: int, path: str) -> None:
    """Exercise 7 with a temporary file of a unique name (tempfile.mkstemp) and Path.replace."""
    if dist.get_rank() == 0:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            torch.save({"step": step, "model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict()}, f)
        Path(tmp).replace(path)
    dist.barrier()


ALTERNATIVES = {
    "global_mean": [global_mean_avg, global_mean_on_a_copy],
    "shard_indices": [shard_indices_blocks, shard_indices_forked_rng],
    "make_loader": [make_loader_from_the_group],
    "average_gradients": [average_gradients_avg, average_gradients_flat, average_gradients_async],
    "accumulation_step": [accumulation_step_exit_stack, accumulation_step_backward_outside],
    "save_checkpoint": [save_checkpoint_mkstemp],
}


# --------------------------------------------------------------- the checked exercises of notebooks 11 and 12
# Written in the lesson notebooks' Exercises sections; teacher/notebook_answers/11_*.md and 12_*.md explain them.
def global_loss(local_loss: torch.Tensor, n_samples: int) -> torch.Tensor:
    """Notebook 11: the mean loss over every sample of every rank, weighted by samples, with one all-reduce."""
    stats = torch.stack([local_loss.detach() * n_samples, torch.tensor(float(n_samples))])  # a new tensor
    dist.all_reduce(stats)  # one round trip: (sum of all losses, number of all samples)
    return stats[0] / stats[1]


def load_checkpoint(path: str, device: torch.device) -> dict:
    """Notebook 11: wait until rank 0 has written the checkpoint, then load it with every tensor on `device`."""
    dist.barrier()  # rank 0 arrives only after writing: nobody reads an older file, or half of one
    return torch.load(path, map_location=device, weights_only=True)  # every storage to this rank's device


def replicas_agree(model: torch.nn.Module) -> bool:
    """Notebook 12: True on every rank when every rank's parameters are bitwise equal, else False on every rank."""
    prints = [None] * dist.get_world_size()
    dist.all_gather_object(prints, fingerprint(model.parameters()))  # 8 bytes per rank, every bit hashed
    return len(set(prints)) == 1


def bucketed_sync(model: torch.nn.Module, cap_bytes: int):
    """Notebook 3b: DDP's buckets by hand; returns finish(), which the loop calls after backward."""
    world_size = dist.get_world_size()
    buckets, current, size = [], [], 0
    for p in reversed(list(model.parameters())):  # backward produces the last layer's gradients first
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= cap_bytes:  # closed once it reaches the cap, as DDP closes its buckets
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)  # the last, partial bucket: sent too
    flats = [torch.zeros(sum(p.numel() for p in b)) for b in buckets]
    slot = {}  # parameter -> (its bucket, its offset in the bucket's flat buffer)
    for i, b in enumerate(buckets):
        offset = 0
        for p in b:
            slot[p] = (i, offset)
            offset += p.numel()
    missing = [len(b) for b in buckets]  # gradients each bucket still waits for in this backward
    works = {}

    def hook(p):
        i, offset = slot[p]
        flats[i][offset:offset + p.numel()].copy_(p.grad.reshape(-1)).div_(world_size)
        missing[i] -= 1
        if missing[i] == 0:  # its last gradient: send the bucket while backward goes on
            works[i] = dist.all_reduce(flats[i], async_op=True)

    for p in slot:
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        for i, work in works.items():
            work.wait()
            for p in buckets[i]:
                offset = slot[p][1]
                p.grad.copy_(flats[i][offset:offset + p.numel()].view_as(p))
        works.clear()
        missing[:] = [len(b) for b in buckets]  # the next backward starts with empty buckets

    return finish


PRACTICE_SOLUTIONS = {
    "global_loss": global_loss,
    "load_checkpoint": load_checkpoint,
    "replicas_agree": replicas_agree,
    "bucketed_sync": bucketed_sync,
    # notebook 0's two blanks: the worked classes the notebook shows behind "Stuck?" (and runs until the
    # learner's own pass)
    "after_backward": core_sync.AfterBackward,
    "as_gradients_arrive": core_sync.AsGradientsArrive,
}


def global_loss_float64(local_loss: torch.Tensor, n_samples: int) -> float:
    """Notebook 11 with Python numbers in a float64 tensor, as the notebook's train_logging does, and a float."""
    stats = torch.tensor([local_loss.item() * n_samples, n_samples], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    return (stats[0] / stats[1]).item()


def global_loss_gathered(local_loss: torch.Tensor, n_samples: int) -> float:
    """Notebook 11 with one all_gather of (loss, count) pairs, summed on every rank."""
    mine = torch.tensor([local_loss.item(), float(n_samples)], dtype=torch.float64)
    pairs = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(pairs, mine)
    return sum(p[0] * p[1] for p in pairs).item() / sum(p[1] for p in pairs).item()


def global_loss_gathered_objects(local_loss: torch.Tensor, n_samples: int) -> float:
    """Notebook 11 with one all_gather_object of (loss x samples, samples) pairs: one call, two all_gathers."""
    pairs = [None] * dist.get_world_size()
    dist.all_gather_object(pairs, (local_loss.item() * n_samples, n_samples))
    return sum(total for total, _ in pairs) / sum(n for _, n in pairs)


def load_checkpoint_mapping(path: str, device: torch.device) -> dict:
    """Notebook 11 with a mapping of rank 0's tag to this rank's device, and monitored_barrier (gloo)."""
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    return torch.load(path, map_location={"cuda:0": str(device)}, weights_only=True)


def load_checkpoint_function(path: str, device: torch.device) -> dict:
    """Notebook 11 with a map_location function: every storage moved to `device`."""
    dist.barrier()
    return torch.load(path, map_location=lambda storage, location: storage.to(device=device), weights_only=True)


def load_checkpoint_broadcast(path: str, device: torch.device) -> dict:
    """Notebook 11 with rank 0 alone reading the file (it wrote it) and sending it to the others."""
    box = [torch.load(path, map_location=device, weights_only=True) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)  # the others wait here until rank 0 has loaded
    return box[0]


def replicas_agree_min_max(model: torch.nn.Module) -> bool:
    """Notebook 12 with the fingerprint in an int64 tensor: its minimum and maximum over the ranks are equal."""
    low = torch.tensor([fingerprint(model.parameters())], dtype=torch.int64)
    high = low.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return bool(low == high)


def replicas_agree_compare_to_rank0(model: torch.nn.Module) -> bool:
    """Notebook 12 with rank 0's parameters broadcast, compared with torch.equal, and the verdicts combined."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    theirs = flat.clone()
    dist.broadcast(theirs, src=0)
    same = torch.tensor([int(torch.equal(theirs, flat))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)  # every rank learns whether any rank differs
    return bool(same.item())


class _ViewBuckets:
    """Notebook 3b's buckets with each p.grad made a view into its bucket (DDP's gradient_as_bucket_view)."""

    def __init__(self, model: torch.nn.Module, cap_bytes: int):
        self.buckets = [[]]
        for p in reversed(list(model.parameters())):
            full = sum(q.numel() * q.element_size() for q in self.buckets[-1])
            if self.buckets[-1] and full + p.numel() * p.element_size() > cap_bytes:
                self.buckets.append([])  # this one never grows past the cap
            self.buckets[-1].append(p)
        self.flats = [torch.empty(sum(p.numel() for p in b)) for b in self.buckets]
        self.place = {}
        for i, b in enumerate(self.buckets):
            views = self.flats[i].split([p.numel() for p in b])
            for p, v in zip(b, views):
                self.place[p] = (i, v.view_as(p))
                p.register_post_accumulate_grad_hook(self.arrived)
        self.reset()

    def reset(self):
        self.count = [0] * len(self.buckets)
        self.next, self.works = 0, []

    def arrived(self, p):
        i, view = self.place[p]
        view.copy_(p.grad)
        p.grad = view  # the average lands in p.grad itself: nothing to copy back
        self.count[i] += 1
        while self.next < len(self.buckets) and self.count[self.next] == len(self.buckets[self.next]):
            flat = self.flats[self.next]  # buckets leave in order, as DDP sends them
            self.works.append(dist.all_reduce(flat, op=dist.ReduceOp.AVG, async_op=True))
            self.next += 1

    def finish(self):
        for work in self.works:
            work.wait()
        self.reset()


def bucketed_sync_views(model: torch.nn.Module, cap_bytes: int):
    """Notebook 3b with a class, buckets that never pass the cap, ReduceOp.AVG and p.grad as views."""
    return _ViewBuckets(model, cap_bytes).finish


def bucketed_sync_futures(model: torch.nn.Module, cap_bytes: int):
    """Notebook 3b with buckets filled as the gradients arrive (torch.cat), written back by a future's callback."""
    params = list(model.parameters())
    state = {"waiting": [], "size": 0, "futures": []}
    arrived = []

    def send(group):
        flat = torch.cat([p.grad.reshape(-1) for p in group]) / dist.get_world_size()

        def write_back(fut):
            for p, chunk in zip(group, fut.value()[0].split([p.numel() for p in group])):
                p.grad.copy_(chunk.view_as(p))

        work = dist.all_reduce(flat, async_op=True)
        state["futures"].append(work.get_future().then(write_back))

    def hook(p):
        arrived.append(p)
        state["waiting"].append(p)
        state["size"] += p.numel() * p.element_size()
        if state["size"] >= cap_bytes or len(arrived) == len(params):  # full, or the last gradient of all
            send(state["waiting"])
            state["waiting"], state["size"] = [], 0

    for p in params:
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        torch.futures.wait_all(state["futures"])
        state["futures"].clear()
        arrived.clear()

    return finish


def bucketed_sync_model_order_layout(model: torch.nn.Module, cap_bytes: int):
    """Notebook 3b with DDP's grouping (from the last layer back), each bucket's buffer laid out in model order."""
    params = list(model.parameters())
    groups, current, size = [], [], 0
    for p in reversed(params):
        current.append(p)
        size += p.numel() * p.element_size()
        if size >= cap_bytes:
            groups.append(current)
            current, size = [], 0
    groups += [current] if current else []
    buckets = [sorted(g, key=lambda p: next(k for k, q in enumerate(params) if q is p)) for g in groups]
    done = {"count": [0] * len(buckets), "works": []}
    where = {p: i for i, b in enumerate(buckets) for p in b}

    def hook(p):
        i = where[p]
        done["count"][i] += 1
        if done["count"][i] == len(buckets[i]):  # every gradient of this bucket is in
            flat = torch.cat([q.grad.reshape(-1) for q in buckets[i]]).div_(dist.get_world_size())
            done["works"].append((i, flat, dist.all_reduce(flat, async_op=True)))

    for p in params:
        p.register_post_accumulate_grad_hook(hook)

    def finish():
        for i, flat, work in done["works"]:
            work.wait()
            for q, part in zip(buckets[i], flat.split([q.numel() for q in buckets[i]])):
                q.grad.copy_(part.view_as(q))
        done["count"], done["works"] = [0] * len(buckets), []

    return finish


class AfterBackwardAsync:
    """Notebook 0, step 1 with every all-reduce started at once (async_op=True), then waited for, then divided."""

    def __init__(self, model):
        self.model = model

    def finish(self):
        works = [dist.all_reduce(p.grad, async_op=True) for p in self.model.parameters()]
        for work in works:
            work.wait()
        for p in self.model.parameters():
            p.grad.div_(dist.get_world_size())


class AfterBackwardFlat:
    """Notebook 0, step 1 with one flat tensor of every gradient, ReduceOp.AVG, and the means copied back."""

    def __init__(self, model):
        self.params = list(model.parameters())

    def finish(self):
        flat = torch.cat([p.grad.reshape(-1) for p in self.params])
        dist.all_reduce(flat, op=dist.ReduceOp.AVG)
        for p, part in zip(self.params, flat.split([p.numel() for p in self.params])):
            p.grad.copy_(part.view_as(p))


class AsGradientsArriveDivideAfter:
    """Notebook 0, step 2 keeping (parameter, work) pairs, dividing each gradient after its wait()."""

    def __init__(self, model):
        self.pending = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda q: self.pending.append(
                (q, dist.all_reduce(q.grad, async_op=True))))

    def finish(self):
        for p, work in self.pending:
            work.wait()
            p.grad /= dist.get_world_size()
        self.pending = []


class AsGradientsArriveFutures:
    """Notebook 0, step 2 with each all-reduce's future, the mean written by its callback; finish() waits all."""

    def __init__(self, model):
        self.futures = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self.ready)

    def ready(self, p):
        p.grad.mul_(1 / dist.get_world_size())
        self.futures.append(dist.all_reduce(p.grad, async_op=True).get_future())

    def finish(self):
        torch.futures.wait_all(self.futures)
        self.futures.clear()


PRACTICE_ALTERNATIVES = {
    "global_loss": [global_loss_float64, global_loss_gathered, global_loss_gathered_objects],
    "load_checkpoint": [load_checkpoint_mapping, load_checkpoint_function, load_checkpoint_broadcast],
    "replicas_agree": [replicas_agree_min_max, replicas_agree_compare_to_rank0],
    "bucketed_sync": [bucketed_sync_views, bucketed_sync_futures, bucketed_sync_model_order_layout],
    "after_backward": [AfterBackwardAsync, AfterBackwardFlat],
    "as_gradients_arrive": [AsGradientsArriveDivideAfter, AsGradientsArriveFutures],
}

if __name__ == "__main__":
    from ddp_helpers.exercises import EXERCISES, PRACTICE_EXERCISES

    answers = [(EXERCISES[name], fn) for name, fn in SOLUTIONS.items()]
    answers += [(EXERCISES[name], fn) for name, fns in ALTERNATIVES.items() for fn in fns]
    answers += [(PRACTICE_EXERCISES[name], fn) for name, fn in PRACTICE_SOLUTIONS.items()]
    answers += [(PRACTICE_EXERCISES[name], fn) for name, fns in PRACTICE_ALTERNATIVES.items() for fn in fns]
    results = [check(fn) for check, fn in answers]
    raise SystemExit(0 if all(r.passed for r in results) else 1)
